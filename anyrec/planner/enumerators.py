"""Enumerate candidate sharding options (sharding type x placement x shard count) per table."""

from __future__ import annotations

from anyrec.backends.dispatch import DATA_PARALLEL_KERNEL
from anyrec.planner.estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from anyrec.planner.types import (
    Enumerator,
    Perf,
    Placement,
    Shard,
    ShardEstimator,
    ShardingOption,
    ShardingType,
    Storage,
    TableSpec,
    Topology,
    Workload,
)

MIN_COLUMN_SHARD_DIM = 16  # narrower column shards waste SIMD lanes and multiply the ids all-to-all


def row_shard_sizes(num_rows: int, parts: int) -> list[int]:
    """Rows per shard, torchrec's row-wise split: blocks of ceil(rows / parts), the last one shorter."""
    block = -(-num_rows // parts)
    return [max(0, min(block, num_rows - i * block)) for i in range(parts)]


class EmbeddingEnumerator(Enumerator):
    """All sharding types the topology allows, for each allowed placement of each table. The embedding
    implementation's Impl record (`workload.options.embedding`) sets the compute kernel per placement, which
    placements are offered and whether data-parallel is. Data-parallel only in HBM; row-wise needs at least as
    many rows as ranks; table-row-wise more than one host; column-wise splits into 2, 4, ... pieces that
    divide the dim and stay at least MIN_COLUMN_SHARD_DIM wide."""

    def __init__(self, perf_estimator: ShardEstimator | None = None,
                 storage_estimator: ShardEstimator | None = None) -> None:
        self.perf_estimator = perf_estimator or EmbeddingPerfEstimator()
        self.storage_estimator = storage_estimator or EmbeddingStorageEstimator()

    def enumerate(self, topology: Topology, workload: Workload,
                  placements: dict[str, tuple[Placement, ...]]) -> dict[str, list[ShardingOption]]:
        return {t.name: [o for p in placements[t.name] for o in self._table_options(t, p, topology, workload)]
                for t in workload.tables}

    def _table_options(self, t: TableSpec, placement: Placement, topology: Topology,
                       workload: Workload) -> list[ShardingOption]:
        w, local = topology.world_size, topology.local_world_size
        impl = workload.options.embedding.impl
        if placement.value not in impl.compute_kernels:
            return []
        allowed = [s for s in workload.options.allowed_shardings
                   if s != ShardingType.DATA_PARALLEL or impl.data_parallel]
        kernel = impl.compute_kernel(placement.value)
        ratio = workload.options.uvm_cache_ratio if placement == Placement.UVM_CACHING else 0.0
        zero_s, zero_p = Storage(), Perf()
        opts: list[ShardingOption] = []

        def add(sharding: ShardingType, shards: list[Shard], host: int | None = None, k: str = kernel):
            opt = ShardingOption(t, sharding, placement, k, shards, host, ratio)
            self.storage_estimator.estimate(opt, topology, workload)
            self.perf_estimator.estimate(opt, topology, workload)
            opts.append(opt)

        n, d = t.num_rows, t.embedding_dim
        if ShardingType.TABLE_WISE in allowed or w == 1:
            add(ShardingType.TABLE_WISE, [Shard(n, d, zero_s, zero_p)])
        if w == 1:
            return opts  # every sharding type is table-wise on one rank
        if ShardingType.DATA_PARALLEL in allowed and placement == Placement.HBM:
            replicas = [Shard(n, d, zero_s, zero_p, r) for r in range(w)]
            add(ShardingType.DATA_PARALLEL, replicas, k=DATA_PARALLEL_KERNEL)
        if ShardingType.ROW_WISE in allowed and n >= w:
            sizes = row_shard_sizes(n, w)
            add(ShardingType.ROW_WISE, [Shard(rows, d, zero_s, zero_p, r) for r, rows in enumerate(sizes)])
        if ShardingType.COLUMN_WISE in allowed:
            k = 2
            while k <= min(w, workload.options.max_column_shards):
                if d % k == 0 and d // k >= MIN_COLUMN_SHARD_DIM and (d // k) % 4 == 0:
                    add(ShardingType.COLUMN_WISE, [Shard(n, d // k, zero_s, zero_p) for _ in range(k)])
                k *= 2
        if ShardingType.TABLE_ROW_WISE in allowed and topology.num_hosts > 1 and n >= local:
            sizes = row_shard_sizes(n, local)
            for h in range(topology.num_hosts):
                shards = [Shard(rows, d, zero_s, zero_p, h * local + i) for i, rows in enumerate(sizes)]
                add(ShardingType.TABLE_ROW_WISE, shards, host=h)
        return opts
