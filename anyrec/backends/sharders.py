"""The torchrec side of the `embedding` op: the sharder and compute kernel for each implementation.

`fbgemm` is torchrec's `fused` kernel (FBGEMM TBE, optimizer fused into backward); `torch` is its
`dense` kernel for now; `triton` comes from `anyrec.kernels.torchrec_kernel`
(`TRITON_COMPUTE_KERNEL` and `TritonEmbeddingBagCollectionSharder`).
"""

from __future__ import annotations

import importlib
import logging

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingType

from anyrec.backends.dispatch import TORCHREC_COMPUTE_KERNELS

logger = logging.getLogger(__name__)


def compute_kernel(impl: str) -> str:
    """The torchrec compute kernel that runs the `embedding` implementation `impl`."""
    if impl == "triton":
        return _triton_module().TRITON_COMPUTE_KERNEL
    kernel = TORCHREC_COMPUTE_KERNELS.get(impl)
    if kernel is None:
        raise ValueError(f"embedding implementation {impl!r} has no torchrec compute kernel; "
                         f"known: {', '.join(TORCHREC_COMPUTE_KERNELS)}")
    return kernel


def _triton_module():
    try:
        return importlib.import_module("anyrec.kernels.torchrec_kernel")
    except ImportError as e:
        raise ValueError(f"backend.embedding_kernel=triton is not available: {e}") from None


class KernelPinnedSharder(EmbeddingBagCollectionSharder):
    """torchrec's EBC sharder restricted to one compute kernel: the one the backend selected.

    Planners see only that kernel; a plan naming another one for a sharded table is rewritten to it
    when the model is sharded (logged once), so the dispatch choice is what runs.
    """

    def __init__(self, kernel: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kernel = kernel

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return super().compute_kernels(sharding_type, compute_device_type)
        return [self.kernel]

    def shard(self, module, params, env, device=None, module_fqn=None):
        changed = []
        for name, ps in params.items():
            if ps.sharding_type != ShardingType.DATA_PARALLEL.value and ps.compute_kernel != self.kernel:
                changed.append(f"{name}: {ps.compute_kernel}")
                ps.compute_kernel = self.kernel
        if changed:
            shown = ", ".join(changed[:4]) + (" ..." if len(changed) > 4 else "")
            logger.info("embedding compute kernel %s for %d table(s) the plan gave another (%s)",
                        self.kernel, len(changed), shown)
        return super().shard(module, params, env, device, module_fqn)


def embedding_sharder(impl: str) -> EmbeddingBagCollectionSharder:
    """The EBC sharder for the selected `embedding` implementation."""
    if impl == "triton":
        # Its optimizer comes from the parameters' in-backward optimizer, like torchrec's own.
        return _triton_module().TritonEmbeddingBagCollectionSharder()
    return KernelPinnedSharder(compute_kernel(impl))
