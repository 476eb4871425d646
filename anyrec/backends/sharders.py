"""The torchrec side of the `embedding` op: each implementation's sharders, read from its Impl record.
`fbgemm` is torchrec's FBGEMM TBE family (optimizer fused into backward), sharded by `KernelFamilySharder`
(pooled tables) and `SequenceKernelFamilySharder` (sequence tables); `triton` and `torch` are anyrec's own
TBE (`anyrec.kernels.torchrec_kernel`, `anyrec.kernels.torchrec_sequence`), needing no FBGEMM kernel.
"""

from __future__ import annotations

from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder, ShardingType

from anyrec.backends.dispatch import Impl, implementations


class _KernelFamily:
    """A torchrec sharder restricted to one implementation's compute kernels: a plan naming another kernel
    for a sharded table is an error, never rewritten (what runs is what the planner costed)."""

    impl: str
    kernels: list[str]

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


class KernelFamilySharder(_KernelFamily, EmbeddingBagCollectionSharder):
    """torchrec's EBC sharder restricted to one implementation's compute kernels (pooled tables)."""

    def __init__(self, impl: str, kernels: list[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.impl = impl
        self.kernels = kernels


class SequenceKernelFamilySharder(_KernelFamily, EmbeddingCollectionSharder):
    """torchrec's EmbeddingCollection sharder restricted to one implementation's compute kernels
    (sequence tables)."""

    def __init__(self, impl: str, kernels: list[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.impl = impl
        self.kernels = kernels


def _built(impl: Impl, build) -> ModuleSharder:
    try:
        return build()
    except ImportError as e:  # e.g. a build without anyrec.kernels, or a plugin's missing library
        raise ValueError(f"backend.embedding_kernel={impl.name} is not available: {e}") from None


def embedding_sharder(impl: Impl) -> EmbeddingBagCollectionSharder:
    """The EBC sharder for the selected `embedding` implementation (its Impl's builder)."""
    return _built(impl, impl.build)


def sequence_sharder(embedding: Impl) -> EmbeddingCollectionSharder:
    """The EmbeddingCollection sharder of the selected `embedding` implementation (its Impl's
    sequence_builder); ValueError naming the implementations that have one where it has none."""
    if embedding.sequence_builder is None:
        have = [i.name for i in implementations("embedding") if i.sequence_builder is not None]
        raise ValueError(f"backend.embedding_kernel={embedding.name} has no kernel for sequence embeddings "
                         f"(EmbeddingCollection); use one of: {', '.join(have)}")
    return _built(embedding, embedding.build_sequence)


def collection_sharder(impl: Impl, pooled: bool = True) -> ModuleSharder:
    """The sharder of a model's embedding collection: the implementation's EBC sharder (pooled), else
    torchrec's EmbeddingCollection sharder (sequence embeddings)."""
    return embedding_sharder(impl) if pooled else sequence_sharder(impl)
