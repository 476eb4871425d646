"""Op dispatch: one `Impl` record per (op, implementation), and the backend's choice among them.

Each op (`embedding`, `interaction`, `dcn_cross`, `hstu_attention`, `collectives`, `sparse_ops`) has
implementations named after the library that provides them (`fbgemm`, `triton`, `torch`, `nccl`, `gloo`,
`portable`), each one `Impl` record, built in or a plugin's (the `anyrec.impls` entry points, or
`register_impl` before first use); the registry is read-only once plugins are loaded. `select` returns the
first record in the backend's `kernel_order` whose probe passes (probed once per process), or the one the
config forces; the caller hands the record down: the planner, the sharder and the model builder never take
a name.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from anyrec.backends.interface import Backend

logger = logging.getLogger(__name__)

# A probe answers None when the implementation can run, else the reason it cannot.
Probe = Callable[["Backend"], "str | None"]
IMPL_ENTRY_POINT_GROUP = "anyrec.impls"
# torchrec's compute kernel for data-parallel (replicated) tables: plain embedding bags, whatever the
# implementation of the sharded ones.
DATA_PARALLEL_KERNEL = "dense"


@dataclass(frozen=True)
class Op:
    """An op the trainer asks the backend for; `config_key` is its `backend.*` setting (None: auto only)."""

    name: str
    config_key: str | None
    default_order: tuple[str, ...] = ()  # for backends whose kernel_order does not list the op


OPS: dict[str, Op] = {op.name: op for op in (
    Op("embedding", "embedding_kernel"),  # pooled lookup with the optimizer fused into backward
    Op("interaction", "interaction_kernel"),  # DLRM pairwise dot interaction
    Op("dcn_cross", "dcn_kernel"),  # DCNv2 low-rank cross layers
    # jagged HSTU (pointwise SiLU) attention; a backend written before it gets the torch version
    Op("hstu_attention", "attention_kernel", default_order=("torch",)),
    Op("collectives", None),  # the torch.distributed process-group backend
    # FBGEMM ops of torchrec's input/output distribution: KJT permutes, offsets and bucketisation,
    # pooled-embedding permutes (sparse_ops.py)
    Op("sparse_ops", "sparse_ops", default_order=("fbgemm", "portable")),
)}


@dataclass(frozen=True)
class KernelProfile:
    """How well an embedding implementation uses the memory system: the planner's cost inputs. An Impl
    carries its built-in profile; a calibration's measured one travels in the `Hardware` value."""

    bw_efficiency: float  # achieved lookup bandwidth / device memory bandwidth
    access_bytes: int = 32  # smallest memory transaction on a GPU: rows are read in multiples of this
    per_row_s: float = 0.0  # latency-bound cost per looked-up row (CPU: DRAM misses), seconds
    source: str = ""
    # Fixed seconds per training step for the rank's batched lookup (launches, bucketing, python):
    # forward + backward with the fused optimizer, paid once per rank whatever its table count.
    per_launch_s: float = 0.0

    def __post_init__(self) -> None:
        # written so that a NaN fails every comparison and is refused
        if not (0.0 < self.bw_efficiency <= 1.0 and self.access_bytes > 0 and 0.0 <= self.per_row_s < 1.0
                and 0.0 <= self.per_launch_s < 1.0):
            raise ValueError(f"kernel profile needs 0 < bw_efficiency <= 1, access_bytes > 0, "
                             f"0 <= per_row_s < 1 s and 0 <= per_launch_s < 1 s; got {self}")


def _resolve(ref: str | Callable) -> Callable:
    """A callable, or one named "module:attr" (imported on first use, as entry points are)."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    return functools.reduce(getattr, attr.split("."), importlib.import_module(module))


@functools.lru_cache(maxsize=4096)
def _state_bytes_per_row(layout: str | Callable, optimizer: str, dim: int) -> int:
    # Cached by the layout function itself: a re-registered Impl with another layout is never stale.
    # The planner asks for every shard of every option it enumerates.
    return int(_resolve(layout)(optimizer, dim))


@dataclass(frozen=True)
class Impl:
    """One implementation of one op: everything anyrec needs to probe, build, shard and cost it.

    `builder` (a callable or "module:attr", called with `options` plus the caller's arguments) makes
    what the op runs: the embedding op's EBC sharder, the interaction's and cross net's nn.Module.
    Embedding-only: `compute_kernels` (placement "hbm" | "uvm_caching" | "ddr" -> torchrec compute
    kernel), `data_parallel` (replicated tables can run with it), `state_bytes_per_row` ((optimizer,
    dim) -> bytes of fused optimizer state), `profile`, `unsharded_builder` (no torchrec sharding),
    `sequence_builder` (the EmbeddingCollection sharder: sequence embeddings).
    """

    op: str
    name: str
    builder: str | Callable | None = None
    probe: Probe | str | None = None  # or "module:attr"; None: runs wherever `Backend.probe(name)` allows
    options: Mapping[str, Any] = field(default_factory=dict)
    compute_kernels: Mapping[str, str] = field(default_factory=dict)
    data_parallel: bool = False
    state_bytes_per_row: str | Callable[[str, int], int] | None = None
    profile: KernelProfile | None = None
    description: str = ""
    # embedding: builds the whole EmbeddingBagCollection on one device without torchrec sharding
    # (called with the table configs, optimizer= and device=, plus `options`); None: always shard.
    unsharded_builder: str | Callable | None = None
    # embedding: builds the torchrec EmbeddingCollection sharder for sequence (unpooled) tables, with the
    # same compute kernels (called with `options`); None: the implementation has no sequence lookup.
    sequence_builder: str | Callable | None = None
    # embedding: its fused update applies `optim.weight_decay` (False: the trainer refuses a decay)
    fused_weight_decay: bool = False
    # embedding: the fused update rules it has on CPU devices (None: every one)
    cpu_optimizers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"implementation {self.name!r}: unknown op {self.op!r}; known: {', '.join(OPS)}")
        if self.op == "embedding":
            if "hbm" not in self.compute_kernels:
                raise ValueError(f"embedding implementation {self.name!r} needs a compute kernel for "
                                 f"placement 'hbm'")
            if self.profile is None or self.state_bytes_per_row is None or self.builder is None:
                raise ValueError(f"embedding implementation {self.name!r} needs a builder (its sharder), "
                                 f"state_bytes_per_row and a profile")

    def build(self, *args: Any, **kwargs: Any) -> Any:
        """The implementation's module or sharder (`builder(*args, **options, **kwargs)`)."""
        if self.builder is None:
            raise ValueError(f"{self.op} implementation {self.name!r} builds nothing")
        return _resolve(self.builder)(*args, **{**self.options, **kwargs})

    def build_sequence(self) -> Any:
        """The EmbeddingCollection sharder (`sequence_builder(**options)`)."""
        if self.sequence_builder is None:
            raise ValueError(f"{self.op} implementation {self.name!r} has no sequence lookup")
        return _resolve(self.sequence_builder)(**self.options)

    def build_unsharded(self, *args: Any, **kwargs: Any) -> Any:
        """The single-device EmbeddingBagCollection (`unsharded_builder(*args, **options, **kwargs)`)."""
        if self.unsharded_builder is None:
            raise ValueError(f"{self.op} implementation {self.name!r} has no single-device build")
        return _resolve(self.unsharded_builder)(*args, **{**self.options, **kwargs})

    def optimizer_state_bytes_per_row(self, optimizer: str, dim: int) -> int:
        """Bytes of fused optimizer state one row of width `dim` keeps (embedding implementations)."""
        if self.state_bytes_per_row is None:
            raise ValueError(f"{self.op} implementation {self.name!r} keeps no embedding optimizer state")
        return _state_bytes_per_row(self.state_bytes_per_row, optimizer, dim)

    def fused_update_reason(self, optimizer: str, device_type: str) -> str | None:
        """Why this embedding implementation has no fused `optimizer` update on `device_type`, or None: the
        planner then offers such tables only replication, and the trainer refuses a plan that shards them."""
        if device_type == "cpu" and self.cpu_optimizers is not None and optimizer not in self.cpu_optimizers:
            return f"the {self.name} embedding implementation has no fused {optimizer} on the CPU"
        return None

    def compute_kernel(self, placement: str = "hbm") -> str:
        """The torchrec compute kernel that runs this implementation with tables in `placement`."""
        if placement not in self.compute_kernels:
            can = [i.name for i in implementations(self.op) if placement in i.compute_kernels]
            key = f"backend.{OPS[self.op].config_key}"
            need = " or ".join(f"{key}={n}" for n in can) or "an implementation that serves it"
            raise ValueError(f"{key}={self.name} keeps tables in {', '.join(self.compute_kernels)}; "
                             f"placement {placement!r} needs {need}")
        return self.compute_kernels[placement]


# ---- probes ---------------------------------------------------------------------------------------

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


def fbgemm_load_error() -> str | None:
    """None when fbgemm_gpu imports, else why not (not installed, or a wheel that fails to load)."""
    if importlib.util.find_spec("fbgemm_gpu") is None:
        return "fbgemm_gpu is not installed"
    try:
        importlib.import_module("fbgemm_gpu")
    except Exception as e:  # a mismatched wheel fails with OSError/RuntimeError on load
        return f"fbgemm_gpu failed to load ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether torch's dispatcher knows `op` and has a kernel for it at `dispatch_key`."""
    return (op in set(torch._C._dispatch_get_all_op_names())
            and torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key))


def probe_fbgemm(backend: Backend) -> str | None:
    """FBGEMM's TBE ops are importable and have kernels for this backend's device type."""
    reason = fbgemm_load_error()
    if reason is not None:
        return reason
    if any(has_kernel(op, dispatch_key(backend.device_type)) for op in _FBGEMM_TBE_OPS):
        return None
    return f"fbgemm_gpu has no TBE kernels for {backend.device_type} (wrong fbgemm_gpu build?)"


def probe_triton(backend: Backend) -> str | None:
    """Triton is importable and can target this backend's device (CPU only through its interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if backend.device_type == "cpu":
        from anyrec.kernels._triton import interpreter_enabled  # imports triton: only once it is installed

        if not interpreter_enabled():
            return ("triton does not compile for CPU "
                    "(set TRITON_INTERPRET=1 to opt in to its slow interpreter)")
        return None
    try:
        target = importlib.import_module("triton").runtime.driver.active.get_current_target()
    except Exception as e:
        return f"triton has no driver for this device ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if backend.device_type == "cuda" and target.backend not in ("cuda", "hip"):
        return f"triton targets {target.backend}, not {backend.name}"
    return None


def probe_nccl(_: Backend) -> str | None:
    """NCCL (RCCL on ROCm) is built into torch.distributed."""
    return None if dist.is_available() and dist.is_nccl_available() else "torch was built without NCCL/RCCL"


def probe_gloo(_: Backend) -> str | None:
    """Gloo is built into torch.distributed."""
    return None if dist.is_available() and dist.is_gloo_available() else "torch was built without gloo"


@dataclass(frozen=True)
class _ModulePresent:
    """A probe that passes when `module` can be imported (a value, so a plan holding its Impl pickles)."""

    module: str
    what: str

    def __call__(self, _: Backend) -> str | None:
        if importlib.util.find_spec(self.module) is None:
            return f"{self.module} ({self.what}) is not installed"
        return None


@dataclass(frozen=True)
class _AllOf:
    """A probe that passes when every one of `probes` does (the first reason otherwise)."""

    probes: tuple[Probe, ...]

    def __call__(self, backend: Backend) -> str | None:
        return next((reason for p in self.probes if (reason := p(backend)) is not None), None)


def _module_present(module: str, what: str) -> Probe:
    return _ModulePresent(module, what)


def all_of(*probes: Probe) -> Probe:
    """A probe that passes when every one of `probes` does (the first reason otherwise)."""
    return _AllOf(probes)


# ---- the registry ---------------------------------------------------------------------------------

# FBGEMM TBE's optimizer state as (bytes per row, bytes per element) (fp32 `momentum1`/`momentum2`;
# checked against fbgemm-gpu's SplitTableBatchedEmbeddingBagsCodegen: EXACT_ROWWISE_ADAGRAD keeps one
# fp32 per row, EXACT_ADAGRAD one per element, ADAM two per element).
_FBGEMM_STATE_BYTES = {"sgd": (0, 0), "adagrad": (0, 4), "rowwise_adagrad": (4, 0), "adam": (0, 8)}


def fbgemm_state_bytes_per_row(optimizer: str, dim: int) -> int:
    """Bytes of optimizer state FBGEMM's TBE keeps per row of width `dim`."""
    if optimizer not in _FBGEMM_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(sorted(_FBGEMM_STATE_BYTES))}")
    per_row, per_element = _FBGEMM_STATE_BYTES[optimizer]
    return per_row + per_element * dim


_TRITON_KERNELS = "the op's Triton kernels"  # Triton reaching the device is probe_triton's job
_ANYREC_TBE_PROBE = _module_present("anyrec.kernels.torchrec_kernel", "the Triton TBE sharder")
_ANYREC_TBE = dict(
    builder="anyrec.kernels.torchrec_kernel:TritonEmbeddingBagCollectionSharder",
    compute_kernels={"hbm": "fused_triton"},  # anyrec's own TBE under torchrec's reserved kernel name
    state_bytes_per_row="anyrec.kernels.optimizers:state_bytes_per_row",
    unsharded_builder="anyrec.kernels.ebc:TritonEmbeddingBagCollection",
    sequence_builder="anyrec.kernels.torchrec_sequence:TritonEmbeddingCollectionSharder",
    fused_weight_decay=True,
)

_FBGEMM_KERNELS = {"hbm": "fused", "uvm_caching": "fused_uvm_caching", "ddr": "fused_uvm"}
FBGEMM_EMBEDDING = Impl(
    "embedding", "fbgemm", "anyrec.backends.sharders:KernelFamilySharder", probe_fbgemm,
    options={"impl": "fbgemm", "kernels": list(_FBGEMM_KERNELS.values())},  # the sharder's kernels
    sequence_builder="anyrec.backends.sharders:SequenceKernelFamilySharder",
    compute_kernels=_FBGEMM_KERNELS, data_parallel=True, state_bytes_per_row=fbgemm_state_bytes_per_row,
    profile=KernelProfile(0.55, 32, source="empirical: FBGEMM TBE forward+backward reaches roughly "
                                            "55% of HBM bandwidth on dim-128 fp32 rows"),
    description="FBGEMM's TBE (torchrec's fused kernels), tables in HBM, UVM cache or host DDR",
    cpu_optimizers=("sgd", "rowwise_adagrad", "adagrad"))  # no CPU Adam in FBGEMM
# anyrec's TBE run by plain torch ops; its profile also costs data-parallel tables' plain embedding bags
TORCH_EMBEDDING = Impl(
    "embedding", "torch", probe=_ANYREC_TBE_PROBE, options={"execution": "torch"}, data_parallel=True,
    profile=KernelProfile(0.28, 32, source="measured on an H200 (2026-11-30): nn.EmbeddingBag forward "
                                            "1,345 GB/s of 4.8 TB/s peak"),
    description="anyrec's TBE run by plain torch ops", **_ANYREC_TBE)

BUILTIN_IMPLS: tuple[Impl, ...] = (
    FBGEMM_EMBEDDING,
    Impl("embedding", "triton", probe=all_of(probe_triton, _ANYREC_TBE_PROBE),
         options={"execution": "triton"},
         profile=KernelProfile(0.69, 32, source="measured on an H200 (2026-11-30): naive Triton forward "
                                                 "3,311 GB/s of 4.8 TB/s peak"),
         description="anyrec's TBE run by Triton kernels (anyrec.kernels)", **_ANYREC_TBE),
    TORCH_EMBEDDING,
    Impl("interaction", "triton", "anyrec.models.interaction:TritonDotInteraction",
         all_of(probe_triton, _module_present("anyrec.kernels.interaction", _TRITON_KERNELS))),
    Impl("interaction", "torch", "anyrec.models.interaction:DotInteraction"),
    Impl("dcn_cross", "triton", "anyrec.models.interaction:TritonLowRankCrossNet",
         all_of(probe_triton, _module_present("anyrec.kernels.dcn", _TRITON_KERNELS))),
    Impl("dcn_cross", "torch", "anyrec.models.interaction:LowRankCrossNet"),
    # each builds the op's function (anyrec.kernels.hstu.HstuAttentionFn)
    Impl("hstu_attention", "triton", "anyrec.kernels.triton_hstu:triton_attention_fn",
         all_of(probe_triton, _module_present("anyrec.kernels.triton_hstu", _TRITON_KERNELS)),
         description="anyrec's Triton kernels, forward and backward"),
    Impl("hstu_attention", "torch", "anyrec.kernels.hstu:torch_attention_fn",
         description="padded chunks of whole sequences in plain torch (the oracle)"),
    Impl("collectives", "nccl", probe=probe_nccl),
    Impl("collectives", "gloo", probe=probe_gloo),
    Impl("sparse_ops", "fbgemm", probe="anyrec.backends.sparse_ops:probe_fbgemm",
         description="FBGEMM's kernels for torchrec's KJT permutes, offsets, bucketisation, pooled permutes"),
    Impl("sparse_ops", "portable",
         description="anyrec's pure-torch kernels for them, registered with torch.library (sparse_ops.py)"),
)

_impls: dict[tuple[str, str], Impl] = {(i.op, i.name): i for i in BUILTIN_IMPLS}
_plugins_loaded = False
_plugin_errors: dict[str, str] = {}


def register_impl(impl: Impl) -> None:
    """Make a plugin's `impl` known; only before the registry is first read (plugins loaded), after
    which it is read-only: whoever resolved a record keeps the one it was given."""
    if _plugins_loaded:
        raise RuntimeError(f"cannot register {impl.op} implementation {impl.name!r}: the registry is read-"
                           f"only once plugins are loaded (use the {IMPL_ENTRY_POINT_GROUP} entry points)")
    _add(impl)


def _add(impl: Impl) -> None:
    key = (impl.op, impl.name)
    if key in _impls and _impls[key] != impl:
        raise ValueError(f"{impl.op} implementation {impl.name!r} is already registered")
    _impls[key] = impl


def load_entry_points(entry_points: Iterable[Any], errors: dict[str, str], kind: str) -> list[tuple]:
    """(entry point, loaded object) for each entry point in name order; one that fails to load is
    left out with a warning, its error kept in `errors` under its name."""
    loaded = []
    for ep in sorted(entry_points, key=lambda e: e.name):
        try:
            loaded.append((ep, ep.load()))
        except Exception as e:
            errors[ep.name] = f"{type(e).__name__}: {e}"
            logger.warning("%s plugin %s (%s) failed to load: %s", kind, ep.name, ep.value, e)
    return loaded


def _load_plugins(entry_points: Iterable[Any] | None = None) -> None:
    """Register the Impls of the `anyrec.impls` entry-point group (an Impl, or an iterable of them),
    once per process; `entry_points` replaces the installed ones (tests)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=IMPL_ENTRY_POINT_GROUP)
    for ep, obj in load_entry_points(entry_points, _plugin_errors, "implementation"):
        for impl in (obj,) if isinstance(obj, Impl) else tuple(obj):
            if not isinstance(impl, Impl):
                raise TypeError(f"implementation plugin {ep.name} ({ep.value}) gives {impl!r}, not an Impl")
            _add(impl)


def implementations(op: str) -> list[Impl]:
    """Every registered implementation of `op` (built-ins first, then plugins')."""
    _load_plugins()
    return [i for (o, _), i in _impls.items() if o == op]


def find_impl(op: str, name: str) -> Impl | None:
    """The registered Impl of `op` called `name`, or None."""
    _load_plugins()
    return _impls.get((op, name))


def get_impl(op: str, name: str) -> Impl:
    """The registered Impl of `op` called `name`; ValueError names the known ones."""
    impl = find_impl(op, name)
    if impl is None:
        known = ", ".join(i.name for i in implementations(op))
        hint = f" (plugin failed to load: {_plugin_errors[name]})" if name in _plugin_errors else ""
        raise ValueError(f"unknown {op} implementation {name!r}{hint}; known: {known}")
    return impl


def torchrec_kernel_placements() -> dict[str, str]:
    """torchrec compute kernel -> placement, over every registered embedding implementation."""
    out = {DATA_PARALLEL_KERNEL: "hbm"}  # a replica in device memory
    for impl in implementations("embedding"):
        for placement, kernel in impl.compute_kernels.items():
            out.setdefault(kernel, placement)
    return out


# ---- selection ------------------------------------------------------------------------------------

_probe_cache: dict[tuple[str, str, str], str | None] = {}
_logged: set[tuple[str, str, str]] = set()


def availability(backend: Backend, op: str, impl: str) -> str | None:
    """None if `impl` can serve `op` on `backend`, else why not (cached per backend, op and impl)."""
    key = (backend.name, op, impl)
    if key not in _probe_cache:
        # The backend may veto (or answer for a library of its own) first; then the Impl's probe.
        reason = backend.probe(impl)
        if reason is None:
            record = find_impl(op, impl)
            if record is None:
                reason = (f"no {op} implementation {impl!r} is registered (anyrec.backends.dispatch."
                          f"register_impl or the {IMPL_ENTRY_POINT_GROUP} entry points)")
            elif record.probe is not None:
                reason = _resolve(record.probe)(backend)
        _probe_cache[key] = reason
    return _probe_cache[key]


def select(backend: Backend, op: str, requested: str = "auto") -> Impl:
    """The Impl record of `op` on `backend`: the first available in its order, or the forced one (any
    registered implementation; one that cannot run is a ValueError with the probe's reason)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    order = backend.kernel_order.get(op) or OPS[op].default_order
    if not order:
        raise ValueError(f"backend {backend.name} lists no implementation for op {op}")
    setting = f"backend.{OPS[op].config_key}" if OPS[op].config_key else f"op {op}"
    if requested != "auto":
        if requested not in order and find_impl(op, requested) is None:
            raise ValueError(f"{setting}={requested} is not offered by backend {backend.name}; "
                             f"choose auto or one of {', '.join(order)}")
        reason = availability(backend, op, requested)
        if reason is not None:
            raise ValueError(f"{setting}={requested} is not available on {backend.name}: {reason}")
        _log_once((backend.name, op, requested), logging.INFO, "op %s -> %s (%s)", op, requested,
                  f"forced by {setting}")
        return get_impl(op, requested)
    skipped = []
    for impl in order:
        reason = availability(backend, op, impl)
        if reason is None:
            for name, why in skipped:
                # On a GPU a skipped preferred kernel costs speed: say so. On CPU only FBGEMM matters.
                level = logging.WARNING if backend.device_type != "cpu" or name == "fbgemm" else logging.INFO
                _log_once((backend.name, op, f"skip {name}"), level, "op %s: %s skipped on %s: %s",
                          op, name, backend.name, why)
            # The first choice is the trainer's `kernels:` line; a fallback is news for the console.
            level = logging.INFO if skipped else logging.DEBUG
            _log_once((backend.name, op, impl), level, "op %s -> %s (%s)", op, impl,
                      f"fallback chain: {' > '.join(order)}")
            return get_impl(op, impl)
        skipped.append((impl, reason))
    reasons = "; ".join(f"{n}: {r}" for n, r in skipped)
    raise ValueError(f"no implementation of op {op} is available on {backend.name} ({reasons})")


def _log_once(key: tuple[str, str, str], level: int, msg: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def select_all(backend: Backend, requested: dict[str, str] | None = None) -> dict[str, Impl]:
    """Every op's Impl record; `requested` maps op name to a forced implementation or 'auto'."""
    requested = requested or {}
    return {op: select(backend, op, requested.get(op, "auto")) for op in OPS
            if op in backend.kernel_order or OPS[op].default_order}

