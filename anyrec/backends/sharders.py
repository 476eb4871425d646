"""The torchrec side of the `embedding` op: each implementation's sharder, read from its Impl record.
`fbgemm` is torchrec's FBGEMM TBE family (optimizer fused into backward), sharded by `KernelFamilySharder`;
`triton` and `torch` are anyrec's own TBE (`anyrec.kernels.torchrec_kernel`), needing no FBGEMM kernel.
"""

from __future__ import annotations

from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder, ShardingType

from anyrec.backends.dispatch import Impl


class KernelFamilySharder(EmbeddingBagCollectionSharder):
    """torchrec's EBC sharder restricted to one implementation's compute kernels: a plan naming another
    kernel for a sharded table is an error, never rewritten (what runs is what the planner costed)."""

    def __init__(self, impl: str, kernels: list[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.impl = impl
        self.kernels = kernels

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return super().compute_kernels(sharding_type, compute_device_type)
        available = super().compute_kernels(sharding_type, compute_device_type)
        return [k for k in self.kernels if k in available]

    def shard(self, module, params, env, device=None, module_fqn=None):
        for name, ps in params.items():
            if ps.sharding_type != ShardingType.DATA_PARALLEL.value and ps.compute_kernel not in self.kernels:
                raise ValueError(f"table {name}: the plan uses compute kernel {ps.compute_kernel!r}, but "
                                 f"backend.embedding_kernel={self.impl} runs {', '.join(self.kernels)}")
        return super().shard(module, params, env, device, module_fqn)


def embedding_sharder(impl: Impl) -> EmbeddingBagCollectionSharder:
    """The EBC sharder for the selected `embedding` implementation (its Impl's builder)."""
    try:
        return impl.build()
    except ImportError as e:  # e.g. a build without anyrec.kernels, or a plugin's missing library
        raise ValueError(f"backend.embedding_kernel={impl.name} is not available: {e}") from None


def sequence_sharder(embedding: Impl) -> EmbeddingCollectionSharder:
    """torchrec's EmbeddingCollection sharder, for an implementation whose fused kernel it runs."""
    sharder = EmbeddingCollectionSharder()
    runs = {k for device in ("cpu", "cuda") for k in sharder.compute_kernels("table_wise", device)}
    if embedding.compute_kernel() not in runs:
        raise ValueError(f"backend.embedding_kernel={embedding.name} has no kernel for sequence embeddings "
                         f"(torchrec's EmbeddingCollection runs FBGEMM's fused TBE): use "
                         f"backend.embedding_kernel=fbgemm")
    return sharder


def collection_sharder(impl: Impl, pooled: bool = True) -> ModuleSharder:
    """The sharder of a model's embedding collection: the implementation's EBC sharder (pooled), else
    torchrec's EmbeddingCollection sharder (sequence embeddings)."""
    return embedding_sharder(impl) if pooled else sequence_sharder(impl)
