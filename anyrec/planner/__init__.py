"""Co-design planner: shard and place embedding tables from the device's memory and bandwidths."""

from anyrec.planner.planner import CoDesignPlanner, InfeasiblePlanError, PlanResult, evaluate_assignment
from anyrec.planner.types import Placement, PlanOptions, ShardingType, TableSpec, Topology

__all__ = [
    "CoDesignPlanner",
    "InfeasiblePlanError",
    "Placement",
    "PlanOptions",
    "PlanResult",
    "ShardingType",
    "TableSpec",
    "Topology",
    "evaluate_assignment",
]
