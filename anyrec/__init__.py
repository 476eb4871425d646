"""anyrec: DLRM-style recommendation training on any accelerator (CUDA, ROCm, CPU)."""

__version__ = "0.1.0"
