"""Sharding planners: the analytical co-design planner and a simple balanced fallback."""
