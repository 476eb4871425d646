"""The torchrec side of the `embedding` op: the sharder and compute kernels of each implementation.

`fbgemm` is torchrec's FBGEMM TBE family (`fused`, `fused_uvm_caching`, `fused_uvm`: optimizer fused
into backward); `triton` and `torch` are anyrec's own TBE (`anyrec.kernels.torchrec_kernel`) run by
Triton kernels or by plain torch ops, so neither needs an FBGEMM kernel for the device.
"""

from __future__ import annotations

import importlib

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingType

from anyrec.backends.dispatch import TORCHREC_COMPUTE_KERNELS


def _kernels(impl: str) -> dict[str, str]:
    kernels = TORCHREC_COMPUTE_KERNELS.get(impl)
    if kernels is None:
        raise ValueError(f"embedding implementation {impl!r} has no torchrec compute kernel; "
                         f"known: {', '.join(TORCHREC_COMPUTE_KERNELS)}")
    return kernels


def compute_kernel(impl: str, placement: str = "hbm") -> str:
    """The torchrec compute kernel that runs implementation `impl` with tables in `placement`."""
    kernels = _kernels(impl)
    if placement not in kernels:
        raise ValueError(f"backend.embedding_kernel={impl} keeps tables in {', '.join(kernels)}; "
                         f"placement {placement!r} needs backend.embedding_kernel=fbgemm")
    return kernels[placement]


def supported_placements(impl: str) -> tuple[str, ...]:
    """Placements (hbm, uvm_caching, ddr) the implementation can serve."""
    return tuple(_kernels(impl))


def supports_data_parallel(impl: str) -> bool:
    """Whether replicated (data-parallel) tables can run with this implementation."""
    return impl == "fbgemm"


class KernelFamilySharder(EmbeddingBagCollectionSharder):
    """torchrec's EBC sharder restricted to one implementation's compute kernels.

    Planners see only those kernels; a plan naming another kernel for a sharded table is an error,
    never rewritten, so what runs is what the backend selected and the planner costed.
    """

    def __init__(self, impl: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.impl = impl
        self.kernels = list(_kernels(impl).values())

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


def embedding_sharder(impl: str) -> EmbeddingBagCollectionSharder:
    """The EBC sharder for the selected `embedding` implementation."""
    if impl in ("triton", "torch"):
        try:
            module = importlib.import_module("anyrec.kernels.torchrec_kernel")
        except ImportError as e:  # e.g. a build without anyrec.kernels
            raise ValueError(f"backend.embedding_kernel={impl} is not available: {e}") from None
        # The optimizer comes from the parameters' in-backward optimizer, as with torchrec's own.
        return module.TritonEmbeddingBagCollectionSharder(execution=impl)
    _kernels(impl)
    return KernelFamilySharder(impl)
