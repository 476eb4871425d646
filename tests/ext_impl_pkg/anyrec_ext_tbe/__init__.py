"""An embedding implementation from outside anyrec, registered through the `anyrec.impls` entry point.

It is the whole porting recipe for a kernel library: one `Impl` record naming the builder of its
torchrec sharder, its compute kernel per placement, its optimizer-state layout and its performance
profile. The sharder here runs anyrec's TBE with plain torch ops under torchrec's `fused_triton`
kernel name and counts what it shards, so a test can see that it, and nothing else, did the work.
"""

from __future__ import annotations

import logging

from anyrec.backends.dispatch import Impl, KernelProfile
from anyrec.kernels.optimizers import state_bytes_per_row
from anyrec.kernels.torchrec_kernel import TritonEmbeddingBagCollectionSharder

logger = logging.getLogger("anyrec_ext_tbe")


class ExtSharder(TritonEmbeddingBagCollectionSharder):
    """anyrec's TBE sharder, logging each EmbeddingBagCollection it shards."""

    def shard(self, module, params, env, device=None, module_fqn=None):
        logger.warning("ext_tbe sharder: %d tables (%s)", len(params),
                       ", ".join(sorted({p.compute_kernel for p in params.values()})))
        return super().shard(module, params, env, device, module_fqn)


IMPL = Impl(
    "embedding", "ext_tbe", ExtSharder, options={"execution": "torch"},
    compute_kernels={"hbm": "fused_triton"}, data_parallel=False,
    state_bytes_per_row=state_bytes_per_row,
    profile=KernelProfile(0.4, 64, source="made up for the registry test"),
    description="anyrec's TBE on torch ops, registered from outside the package",
)
