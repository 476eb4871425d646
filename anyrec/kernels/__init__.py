"""Portable kernels: Triton table-batched embeddings with a fused optimizer (`tbe`; torchrec modules on it
in `ebc` and `torchrec_kernel`, the only modules here that import torchrec), the DLRM dot interaction
(`interaction`), the DCNv2 cross-layer epilogue (`dcn`) and jagged HSTU attention (`hstu` the torch
version, `triton_hstu` the kernels), each with a pure-torch oracle;
`python -m anyrec.kernels.aot` is the portability gate.
"""

from anyrec.kernels.layout import BoundsCheckMode
from anyrec.kernels.optimizers import OptimizerConfig, OptimizerKind, state_bytes_per_row
from anyrec.kernels.tbe import TritonTableBatchedEmbedding
from anyrec.kernels.triton_tbe import HAS_TRITON

__all__ = ["HAS_TRITON", "BoundsCheckMode", "OptimizerConfig", "OptimizerKind", "TritonTableBatchedEmbedding",
           "state_bytes_per_row"]
