"""Data sources: synthetic Criteo-shaped batches and Criteo files."""
