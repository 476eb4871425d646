"""Conversions between anyrec plans and torchrec ShardingPlans (both directions). Each table's compute
kernel is its embedding implementation's for the placement (its Impl record), as the report shows it."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from anyrec.backends.dispatch import torchrec_kernel_placements
from anyrec.planner.types import Placement, PlanResult, ShardingType, TableSpec

DEFAULT_EBC_FQN = "sparse_arch.embedding_bag_collection"  # torchrec DLRM's EmbeddingBagCollection


def meta_ebc(tables: list[TableSpec]) -> EmbeddingBagCollection:
    """A torchrec EmbeddingBagCollection on the meta device: no table memory is allocated."""
    dtypes = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16, "int8": DataType.INT8}
    configs = [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_rows,
                                  feature_names=list(t.feature_names),
                                  data_type=dtypes.get(t.weight_dtype, DataType.FP32))
               for t in tables]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def build_sharding_plan(module: nn.Module, per_table: dict[str, tuple[str, list[int], str]], module_path: str,
                        world_size: int, local_world_size: int, device_type: str,
                        sharder: ModuleSharder | None = None) -> ShardingPlan:
    """torchrec ShardingPlan {module_path: per-table ParameterSharding} for the EmbeddingBagCollection
    `module`, from table -> (sharding type, ranks, compute kernel), for both planners. Table-wise uses
    ranks[0], column-wise one shard per listed rank, table-row-wise the host of ranks[0]; row-wise and
    data-parallel span every rank."""
    generators = {}
    for name, (kind, ranks, kernel) in per_table.items():
        if kind == ShardingType.DATA_PARALLEL:
            generators[name] = data_parallel()
        elif kind == ShardingType.TABLE_WISE:
            generators[name] = table_wise(rank=ranks[0], compute_kernel=kernel)
        elif kind == ShardingType.COLUMN_WISE:
            generators[name] = column_wise(ranks=list(ranks), compute_kernel=kernel)
        elif kind == ShardingType.ROW_WISE:
            generators[name] = row_wise(compute_kernel=kernel)
        elif kind == ShardingType.TABLE_ROW_WISE:
            generators[name] = table_row_wise(host_index=ranks[0] // local_world_size)
        else:
            raise ValueError(f"table {name}: unknown sharding {kind!r}")
    module_plan = construct_module_sharding_plan(module, generators, sharder=sharder,
                                                 local_size=local_world_size, world_size=world_size,
                                                 device_type=device_type)
    for name, ps in module_plan.items():
        if per_table[name][0] != ShardingType.DATA_PARALLEL:
            ps.compute_kernel = per_table[name][2]  # table_row_wise() takes no kernel argument
    return ShardingPlan({module_path: module_plan})


def to_sharding_plan(plan: PlanResult, module_path: str = DEFAULT_EBC_FQN, module: nn.Module | None = None,
                     compute_device: str | None = None, sharder: ModuleSharder | None = None) -> ShardingPlan:
    """torchrec ShardingPlan for a PlanResult (`module`: the EmbeddingBagCollection, default one on the meta
    device). Each table keeps the compute kernel the plan chose, except that on a CPU compute device
    sharded tables live in host memory anyway and run the implementation's HBM kernel."""
    topo = plan.topology
    device = compute_device or topo.compute_device
    module = module if module is not None else meta_ebc(plan.workload.tables)
    hbm_kernel = plan.workload.options.embedding.impl.compute_kernel(Placement.HBM.value)
    per_table = {}
    for name, opt in plan.tables.items():
        ranks = [s.rank for s in opt.shards]
        if opt.sharding == ShardingType.TABLE_ROW_WISE:
            ranks = [opt.host * topo.local_world_size]
        sharded_on_cpu = device == "cpu" and opt.sharding != ShardingType.DATA_PARALLEL
        kernel = hbm_kernel if sharded_on_cpu else opt.compute_kernel
        per_table[name] = (opt.sharding.value, ranks, kernel)
    return build_sharding_plan(module, per_table, module_path, topo.world_size, topo.local_world_size, device,
                               sharder)


def from_sharding_plan(sharding_plan: ShardingPlan,
                       module_path: str | None = None) -> dict[str, tuple[str, str, list[int]]]:
    """Per table (sharding type, placement, ranks) from a torchrec ShardingPlan, for costing it."""
    placement_of = torchrec_kernel_placements()
    plans = sharding_plan.plan
    return {name: (ps.sharding_type, placement_of.get(ps.compute_kernel, Placement.HBM.value),
                   list(ps.ranks or []))
            for path in ([module_path] if module_path else plans) for name, ps in plans[path].items()}
