"""Co-design planner: shard and place embedding tables from the device's memory and bandwidths. Modules,
lowest first (each imports only those before it): types, estimators, enumerators, proposers,
partitioners, evaluate, advice, planner, report, torchrec_plan, simple, workloads, job."""

from anyrec.planner.evaluate import evaluate_assignment
from anyrec.planner.planner import CoDesignPlanner
from anyrec.planner.types import (
    InfeasiblePlanError,
    Placement,
    PlanOptions,
    PlanResult,
    ShardingType,
    TableSpec,
    Topology,
)

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
