"""Op dispatch: for each op, the backend's ordered implementations, each behind an availability probe.

An op (`embedding`, `interaction`, `dcn_cross`, `collectives`, `sparse_ops`) has implementations named
after the library that provides them (`fbgemm`, `triton`, `torch`, `nccl`, `gloo`, `portable`, or a
plugin's own). A backend
lists them in preference order (`Backend.kernel_order`); `select` takes the first whose probe passes,
or the one the config forces, and fails clearly when a forced one cannot run. Probes run once per
process (`reset_probes()` lets tests run them again); each op's choice is logged once.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from anyrec.backends.interface import Backend

logger = logging.getLogger(__name__)

# A probe answers None when the implementation can run, else the reason it cannot.
Probe = Callable[["Backend"], "str | None"]


@dataclass(frozen=True)
class Op:
    """An op the trainer asks the backend for; `config_key` is its `backend.*` setting (None: auto only)."""

    name: str
    config_key: str | None
    description: str
    requirements: dict[str, Probe]  # op-specific checks on top of the library's device probe
    default_order: tuple[str, ...] = ()  # for backends whose kernel_order does not list the op


def _kernel_module(module: str) -> Probe:
    """An op's Triton kernels live in `module`; Triton reaching the device is the library probe's job."""
    def probe(_: Backend) -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{module} (the op's Triton kernels) is not installed"
        return None

    return probe


def _triton_tbe(_: Backend) -> str | None:
    if importlib.util.find_spec("anyrec.kernels.torchrec_kernel") is None:
        return "anyrec.kernels.torchrec_kernel (the Triton TBE sharder) is not installed"
    return None


def _fbgemm_sparse_ops(backend: Backend) -> str | None:
    from anyrec.backends.sparse_ops import SPARSE_OPS, missing_kernels

    key = dispatch_key(backend.device_type)
    missing = missing_kernels(key)
    if missing:
        return (f"fbgemm_gpu has no {key} kernel for {len(missing)} of {len(SPARSE_OPS)} sparse ops "
                f"({', '.join(missing)})")
    return None


OPS: dict[str, Op] = {
    "embedding": Op("embedding", "embedding_kernel",
                    "pooled embedding lookup with the optimizer fused into backward",
                    {"triton": _triton_tbe}),
    "interaction": Op("interaction", "interaction_kernel", "DLRM pairwise dot interaction",
                      {"triton": _kernel_module("anyrec.kernels.interaction"),
                       "fbgemm": lambda _: "no fbgemm kernel for this op"}),
    "dcn_cross": Op("dcn_cross", "dcn_kernel", "DCNv2 low-rank cross layers",
                    {"triton": _kernel_module("anyrec.kernels.dcn"),
                     "fbgemm": lambda _: "no fbgemm kernel for this op"}),
    "collectives": Op("collectives", None, "torch.distributed process-group backend", {}),
    # torchrec's KJT permutes, offsets and bucketisation, pooled-embedding permutes (sparse_ops.py).
    "sparse_ops": Op("sparse_ops", "sparse_ops", "FBGEMM sparse ops of torchrec's input/output distribution",
                     {"fbgemm": _fbgemm_sparse_ops}, default_order=("fbgemm", "portable")),
}

# What each embedding implementation means to torchrec: the compute kernels it runs, by placement
# (hbm, uvm_caching, ddr). `triton` and `torch` are anyrec's own TBE (anyrec.kernels.torchrec_kernel)
# under torchrec's `fused_triton` kernel name, executed by Triton or by plain torch ops; they keep
# tables in device memory. Extend here for new kernels.
TORCHREC_COMPUTE_KERNELS: dict[str, dict[str, str]] = {
    "fbgemm": {"hbm": "fused", "uvm_caching": "fused_uvm_caching", "ddr": "fused_uvm"},
    "triton": {"hbm": "fused_triton"},
    "torch": {"hbm": "fused_triton"},
}

# torch dispatch keys per device type (ROCm registers its kernels under CUDA).
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mtia": "MTIA", "mps": "MPS"}


def dispatch_key(device_type: str) -> str:
    """torch's dispatch key for a device type; a renamed PrivateUse1 device maps to PrivateUse1."""
    if device_type in _DISPATCH_KEYS:
        return _DISPATCH_KEYS[device_type]
    if device_type == torch._C._get_privateuse1_backend_name():
        return "PrivateUse1"
    return device_type.upper()

# Any one of these with a kernel for the device means FBGEMM's training TBE runs there.
_FBGEMM_TBE_OPS = (
    "fbgemm::split_embedding_codegen_forward_unweighted_cuda",
    "fbgemm::split_embedding_codegen_forward_unweighted_pt2_wrapper",
    "fbgemm::split_embedding_codegen_forward_cpu",
)


def probe_fbgemm(backend: Backend) -> str | None:
    """FBGEMM's TBE ops are importable and have kernels for this backend's device type."""
    if importlib.util.find_spec("fbgemm_gpu") is None:
        return "fbgemm_gpu is not installed"
    try:
        importlib.import_module("fbgemm_gpu")
    except Exception as e:  # a mismatched wheel fails with OSError/RuntimeError on load
        return f"fbgemm_gpu failed to load ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    key = dispatch_key(backend.device_type)
    names = set(torch._C._dispatch_get_all_op_names())
    for op in _FBGEMM_TBE_OPS:
        if op in names and torch._C._dispatch_has_kernel_for_dispatch_key(op, key):
            return None
    return f"fbgemm_gpu has no TBE kernels for {backend.device_type} (wrong fbgemm_gpu build?)"


def probe_triton(backend: Backend) -> str | None:
    """Triton is importable and can target this backend's device (CPU only through its interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if backend.device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return ("triton does not compile for CPU "
                    "(set TRITON_INTERPRET=1 to opt in to its slow interpreter)")
        return None
    try:
        import triton

        target = triton.runtime.driver.active.get_current_target()
    except Exception as e:
        return f"triton has no driver for this device ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if backend.device_type == "cuda" and target.backend not in ("cuda", "hip"):
        return f"triton targets {target.backend}, not {backend.name}"
    return None


def probe_nccl(_: Backend) -> str | None:
    """NCCL (RCCL on ROCm) is built into torch.distributed."""
    import torch.distributed as dist

    return None if dist.is_available() and dist.is_nccl_available() else "torch was built without NCCL/RCCL"


def probe_gloo(_: Backend) -> str | None:
    """Gloo is built into torch.distributed."""
    import torch.distributed as dist

    return None if dist.is_available() and dist.is_gloo_available() else "torch was built without gloo"


# Library probes by implementation name; a plugin adds its own through `Backend.probe`.
PROBES: dict[str, Probe] = {
    "fbgemm": probe_fbgemm, "triton": probe_triton, "torch": lambda _: None,
    "nccl": probe_nccl, "gloo": probe_gloo, "portable": lambda _: None,
}

_probe_cache: dict[tuple[str, str, str], str | None] = {}
_logged: set[tuple[str, str, str]] = set()


def reset_probes() -> None:
    """Forget probe results and logged choices (tests flip the environment and probe again)."""
    _probe_cache.clear()
    _logged.clear()


def availability(backend: Backend, op: str, impl: str) -> str | None:
    """None if `impl` can serve `op` on `backend`, else why not (cached per backend, op and impl)."""
    key = (backend.name, op, impl)
    if key not in _probe_cache:
        # The library must reach the device first; then the op must have a kernel in it.
        reason = backend.probe(impl)
        if reason is None:
            reason = OPS[op].requirements.get(impl, lambda _: None)(backend)
        _probe_cache[key] = reason
    return _probe_cache[key]


def select(backend: Backend, op: str, requested: str = "auto") -> str:
    """The implementation of `op` on `backend`: the first available in its order, or the forced one.

    A forced implementation that cannot run raises ValueError with the probe's reason.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    order = backend.kernel_order.get(op) or OPS[op].default_order
    if not order:
        raise ValueError(f"backend {backend.name} lists no implementation for op {op}")
    setting = f"backend.{OPS[op].config_key}" if OPS[op].config_key else f"op {op}"
    chain = " > ".join(order)
    if requested != "auto":
        if requested not in order:
            raise ValueError(f"{setting}={requested} is not offered by backend {backend.name}; "
                             f"choose auto or one of {', '.join(order)}")
        reason = availability(backend, op, requested)
        if reason is not None:
            raise ValueError(f"{setting}={requested} is not available on {backend.name}: {reason}")
        _log_once(backend, op, requested, f"forced by {setting}")
        return requested
    skipped = []
    for impl in order:
        reason = availability(backend, op, impl)
        if reason is None:
            for name, why in skipped:
                # On a GPU a skipped preferred kernel costs speed: say so. On CPU only FBGEMM matters.
                level = logging.WARNING if backend.device_type != "cpu" or name == "fbgemm" else logging.INFO
                if (backend.name, op, f"skip {name}") not in _logged:
                    _logged.add((backend.name, op, f"skip {name}"))
                    logger.log(level, "op %s: %s skipped on %s: %s", op, name, backend.name, why)
            _log_once(backend, op, impl, f"fallback chain: {chain}")
            return impl
        skipped.append((impl, reason))
    reasons = "; ".join(f"{n}: {r}" for n, r in skipped)
    raise ValueError(f"no implementation of op {op} is available on {backend.name} ({reasons})")


def _log_once(backend: Backend, op: str, impl: str, why: str) -> None:
    if (backend.name, op, impl) not in _logged:
        _logged.add((backend.name, op, impl))
        logger.info("op %s -> %s (%s)", op, impl, why)


def select_all(backend: Backend, requested: dict[str, str] | None = None) -> dict[str, str]:
    """Every op's implementation; `requested` maps op name to a forced implementation or 'auto'."""
    requested = requested or {}
    return {op: select(backend, op, requested.get(op, "auto")) for op in OPS
            if op in backend.kernel_order or OPS[op].default_order}
