"""Portable kernels: Triton table-batched embeddings with a fused optimizer, the DLRM dot interaction
and the DCNv2 cross-layer epilogue, each with a pure-torch oracle.

Public entry points (torchrec is imported only by `anyrec.kernels.ebc` and
`anyrec.kernels.torchrec_kernel`):
  `tbe.TritonTableBatchedEmbedding`, `optimizers.OptimizerConfig`, `optimizers.state_bytes_per_row`,
  `ebc.TritonEmbeddingBagCollection` (unsharded, single-device, no FBGEMM op) and
  `ebc.dense_named_parameters`, `torchrec_kernel.TritonEmbeddingBagCollectionSharder`,
  `torchrec_kernel.TRITON_COMPUTE_KERNEL`, `interaction.dot_interaction`, `dcn.cross_epilogue`,
  `python -m anyrec.kernels.aot` (portability gate).
"""

from anyrec.kernels.layout import BoundsCheckMode
from anyrec.kernels.optimizers import OptimizerConfig, OptimizerKind, state_bytes_per_row
from anyrec.kernels.tbe import TritonTableBatchedEmbedding
from anyrec.kernels.triton_tbe import HAS_TRITON

__all__ = [
    "HAS_TRITON",
    "BoundsCheckMode",
    "OptimizerConfig",
    "OptimizerKind",
    "TritonTableBatchedEmbedding",
    "state_bytes_per_row",
]
