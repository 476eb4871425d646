"""Portability gate: compile every Triton kernel ahead of time for NVIDIA and AMD targets, no GPU needed.

    python -m anyrec.kernels.aot [--targets sm_90,gfx942] [--json out.json]

Compiles each kernel variant (the constexpr combinations the launchers use) for sm_90, sm_100, gfx942 and
gfx950 with `triton.compile(ASTSource(...), target=GPUTarget(...))`, prints registers, spills and shared
memory per kernel and target, and exits 1 if any compile fails. NVIDIA register and spill counts come
from `ptxas -v` on the generated PTX (Triton reads them from the driver only when a kernel is loaded);
AMD ones from the metadata in the generated AMDGCN (VGPRs, VGPR spills to scratch; SGPR spills into
VGPR lanes are not counted). '-' where unknown.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from anyrec.kernels.optimizers import OptimizerKind

# Triton 3.9 warns when this is unset (its default changes in 3.10); fusion on is what we ship. Read at
# compile time, so setting it here covers an already-imported triton too.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

# Triton's own compile-target names (`GPUTarget(backend, arch, warp_size)`), not torch device types
TARGETS = {
    "sm_90": ("cuda", 90, 32),
    "sm_100": ("cuda", 100, 32),
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
}


@dataclass
class CompileResult:
    """One kernel variant compiled for one target (counts are None where the toolchain hides them)."""

    kernel: str
    variant: str
    target: str
    ok: bool
    registers: int | None = None  # per thread (NVIDIA) / VGPRs per lane (AMD)
    spills: int | None = None  # spill-store bytes (NVIDIA) / VGPRs spilled to scratch (AMD)
    shared_bytes: int | None = None
    seconds: float = 0.0
    error: str = ""


def _variants():
    """(kernel name, variant label, jit fn, signature types, constexprs, num_warps: an int, or a dict by the
    target's warp size where the launcher picks by it)."""
    from anyrec.kernels.triton_tbe import forward_blocks, tbe_forward_kernel  # needs triton
    from anyrec.kernels.triton_tbe_backward import (  # needs triton
        LONG_SEGMENT,
        OPTIMIZER_CODES,
        backward_blocks,
        tbe_backward_kernel,
    )

    out = []
    bb, bd, unroll, nw = forward_blocks(128)
    for wdt, psw, mean in (("fp32", False, False), ("bf16", True, True), ("fp16", False, False)):
        types = ["*" + wdt] + ["*i64"] * 5 + ["*i64", "*i64", "*fp32", "*fp32", "i32", "i32", "i32"]
        cx = {"HAS_PSW": psw, "MEAN": mean, "ALIGN": 16, "UNROLL": unroll, "BLOCK_B": bb, "BLOCK_D": bd}
        out.append(("tbe_forward", f"w={wdt} psw={int(psw)} mean={int(mean)} D<=128", tbe_forward_kernel,
                    types, cx, nw))
    cases = [(k, wdt, 128) for k in OPTIMIZER_CODES
             for wdt in (("fp32", "bf16") if k == OptimizerKind.ROWWISE_ADAGRAD else ("fp32",))]
    cases.append((OptimizerKind.ROWWISE_ADAGRAD, "fp32", 512))  # D tiles: the two-pass path
    for kind, wdt, dim in cases:
        bu, bl, bd, tiles, nw = backward_blocks(dim)
        types = (["*" + wdt, "*fp32", "*fp32", "*fp32"] + ["*i64"] * 6 + ["*fp32"] + ["*i64"] * 4
                 + ["*fp32", "i32", "i32", "i32", "i64", "fp32", "fp32", "fp32", "fp32", "fp32", "i32"])
        cx = {"OPTIMIZER": OPTIMIZER_CODES[kind], "HAS_PSW": False, "MEAN": False,
              "STOCHASTIC_ROUNDING": wdt != "fp32", "DROPPED_BITS": 16, "ALIGN": 16,
              "LONG_SEGMENT": LONG_SEGMENT, "BLOCK_U": bu, "BLOCK_L": bl, "BLOCK_D": bd, "NUM_D_TILES": tiles}
        out.append(("tbe_backward", f"{kind.value} w={wdt} D<={dim}", tbe_backward_kernel, types, cx, nw))
    out += _sequence_variants()
    out += _dense_variants()
    out += _attention_variants()
    return out


def _sequence_variants():
    """The unpooled (sequence) lookups as `sequence_tbe` launches the pooled kernels: every lookup a one-id
    bag of a batch of one, so `batch` is 1 (a value the launcher specialises, a variant of its own), at the
    DLRMv4 reference's dim 512 with its row-wise Adagrad; int64 ids (forward) and the sort order (backward)
    stand in for the unread per-sample weights, and a row's stride (lookups x 512) divides by 16."""
    from anyrec.kernels.triton_tbe import forward_blocks, tbe_forward_kernel  # needs triton
    from anyrec.kernels.triton_tbe_backward import (  # needs triton
        LONG_SEGMENT,
        OPTIMIZER_CODES,
        backward_blocks,
        tbe_backward_kernel,
    )

    dim = 512
    bb, bd, unroll, nw = forward_blocks(dim)
    types = ["*fp32"] + ["*i64"] * 5 + ["*i64", "*i64", "*i64", "*fp32", "i32", "i32:16"]
    cx = {"batch": 1, "HAS_PSW": False, "MEAN": False, "ALIGN": 16, "UNROLL": unroll, "BLOCK_B": bb,
          "BLOCK_D": bd}
    out = [("tbe_forward", f"sequence w=fp32 batch=1 D<={dim}", tbe_forward_kernel, types, cx, nw)]
    kind = OptimizerKind.ROWWISE_ADAGRAD
    bu, bl, bd, tiles, nw = backward_blocks(dim)
    types = (["*fp32", "*fp32", "*fp32", "*fp32"] + ["*i64"] * 6 + ["*i64"] + ["*i64"] * 4
             + ["*fp32", "i32:16", "i32", "i64", "fp32", "fp32", "fp32", "fp32", "fp32", "i32"])
    cx = {"batch": 1, "OPTIMIZER": OPTIMIZER_CODES[kind], "HAS_PSW": False, "MEAN": False,
          "STOCHASTIC_ROUNDING": False, "DROPPED_BITS": 16, "ALIGN": 16, "LONG_SEGMENT": LONG_SEGMENT,
          "BLOCK_U": bu, "BLOCK_L": bl, "BLOCK_D": bd, "NUM_D_TILES": tiles}
    out.append(("tbe_backward", f"sequence {kind.value} w=fp32 batch=1 D<={dim}", tbe_backward_kernel, types,
                cx, nw))
    return out


def _attention_variants():
    """HSTU attention at the DLRMv4 reference's shapes (4 heads, q/k and v dims 128; heads and lengths are
    runtime values), bf16 (its mixed precision) and fp32, with targets and contextual tokens."""
    from anyrec.kernels.triton_hstu import (  # needs triton
        attention_blocks,
        hstu_bwd_dkdv_kernel,
        hstu_bwd_dq_kernel,
        hstu_fwd_kernel,
    )

    # strides (H * 128, 128) and dims 128 divisible by 16; num_heads (4) and num_contextual are not.
    # num_heads, dq, dv, num_contextual, alpha, 1 / max_len:
    scalars = ["i32", "i32:16", "i32:16", "i32", "fp32", "fp32"]
    out = []
    for dt in ("bf16", "fp32"):
        by_warp = {w: attention_blocks(128, 128, dt == "fp32", w) for w in (32, 64)}
        block_dq, block_dv, _ = by_warp[32]["dims"]
        label = f"x={dt} H=4 D<=128"
        ints = ["*i64", "*i64"]  # offsets, num_targets
        kernels = (("hstu_fwd", hstu_fwd_kernel, ["*" + dt] * 4 + ints + ["i32:16"] * 8),
                   ("hstu_bwd_dq", hstu_bwd_dq_kernel, ["*" + dt] * 5 + ints + ["i32:16"] * 6),
                   ("hstu_bwd_dkdv", hstu_bwd_dkdv_kernel, ["*" + dt] * 6 + ints + ["i32:16"] * 6))
        for name, fn, types in kernels:
            block_m, block_n, _ = by_warp[32][name.removeprefix("hstu_")]
            warps = {w: blocks[name.removeprefix("hstu_")][2] for w, blocks in by_warp.items()}
            cx = {"HAS_TARGETS": True, "DOT_FP32": dt == "fp32", "BLOCK_M": block_m, "BLOCK_N": block_n,
                  "BLOCK_DQ": block_dq, "BLOCK_DV": block_dv}
            out.append((name, label, fn, types + scalars, cx, warps))
    return out


def _dense_variants():
    """The dense ops at the production shapes: DLRM's dot interaction (27 rows of D=128) and DLRMv2's
    cross-layer epilogue (N = 27 * 128), fp32 and bf16 (autocast: bf16 GEMM output, fp32 x0 and x)."""
    from anyrec.kernels.dcn import (  # needs triton
        cross_epilogue_bwd_kernel,
        cross_epilogue_fwd_kernel,
        epilogue_blocks,
    )
    from anyrec.kernels.interaction import (  # needs triton
        dot_interaction_bwd_kernel,
        dot_interaction_fwd_kernel,
        interaction_blocks,
    )

    out = []
    bb, bn, bd, nw = interaction_blocks(27)
    for dt in ("fp32", "bf16"):
        cx = {"DOT_FP32": dt == "fp32", "BLOCK_B": bb, "BLOCK_N": bn, "BLOCK_D": bd}
        label = f"x={dt} n<={bn} D<=128"
        out.append(("dot_fwd", label, dot_interaction_fwd_kernel, ["*" + dt] * 3 + ["i32"] * 4, cx, nw))
        out.append(("dot_bwd", label, dot_interaction_bwd_kernel, ["*" + dt] * 5 + ["i32"] * 4, cx, nw))
    bb, bn, nw = epilogue_blocks(27 * 128)
    cx = {"BLOCK_B": bb, "BLOCK_N": bn}
    for dt, ydt in (("fp32", "fp32"), ("fp32", "bf16")):
        label = f"x={dt} y={ydt} D<=128 N=3456"
        out.append(("dcn_epi_fwd", label, cross_epilogue_fwd_kernel,
                    ["*" + dt, "*" + ydt, "*fp32", "*" + dt, "*" + dt, "i32", "i32"], cx, nw))
        # grad_out, x0, y, b, grad_x0, grad_y, grad_b partials, batch, n, rows_per_split
        types = ["*" + dt, "*" + dt, "*" + ydt, "*fp32", "*" + dt, "*" + ydt, "*fp32", "i32", "i32", "i32"]
        out.append(("dcn_epi_bwd", label, cross_epilogue_bwd_kernel, types, cx, nw))
    return out


def _nvidia_counts(ptx: str, arch: int) -> tuple[int | None, int | None]:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}",
                               str(src), "-o", str(Path(d) / "k.o")], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None)


def _amd_counts(amdgcn: str) -> tuple[int | None, int | None]:
    def field(name: str) -> int | None:
        m = re.search(rf"\.{name}:\s+(\d+)", amdgcn)
        return int(m.group(1)) if m else None

    # SGPR spills go to VGPR lanes (no memory traffic); only VGPR spills reach scratch memory
    return field("vgpr_count"), field("vgpr_spill_count")


def compile_one(name, label, fn, types, constexprs, num_warps, target: str) -> CompileResult:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from anyrec.kernels.triton_tbe_backward import BACKWARD_COMPILE_OPTIONS  # needs triton

    t0 = time.perf_counter()
    res = CompileResult(kernel=name, variant=label, target=target, ok=False)
    try:
        args = [a for a in fn.arg_names if a not in constexprs]
        if len(args) != len(types):
            raise ValueError(f"{name}: {len(args)} runtime args but {len(types)} types")
        # "i32:16": an int the launcher sees divisible by 16 at the shapes compiled for (it specialises such
        # values, as it does pointers: 16-byte aligned torch allocations)
        sig = {a: t.removesuffix(":16") for a, t in zip(args, types, strict=True)} | {k: "constexpr"
                                                                                     for k in constexprs}
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in zip(args, types, strict=True)
                 if t.startswith("*") or t.endswith(":16")}
        backend, arch, warp = TARGETS[target]
        if isinstance(num_warps, dict):
            num_warps = num_warps[warp]
        src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
        # the options each launcher passes besides num_warps, so kernels compile here as they ship
        options = {"num_warps": num_warps, **(BACKWARD_COMPILE_OPTIONS if name == "tbe_backward" else {})}
        k = triton.compile(src, target=GPUTarget(backend, arch, warp), options=options)
        res.shared_bytes = int(k.metadata.shared)
        if "ptx" in k.asm:  # what the compiler produced says whose counts to read, not the target's name
            res.registers, res.spills = _nvidia_counts(k.asm["ptx"], arch)
        else:
            res.registers, res.spills = _amd_counts(k.asm["amdgcn"])
        res.ok = True
    except Exception as ex:  # report every failure, keep compiling the rest
        res.error = f"{type(ex).__name__}: {ex}"[:500]
    res.seconds = time.perf_counter() - t0
    return res


def format_table(results: list[CompileResult]) -> str:
    def c(v):
        return "-" if v is None else str(v)

    head = f"{'kernel':<13} {'variant':<32} {'target':<7} {'ok':<4} {'regs':>5} {'spills':>6} {'smem B':>7}"
    rows = [f"{head} {'s':>5}"]
    for r in results:
        rows.append(f"{r.kernel:<13} {r.variant:<32} {r.target:<7} {'ok' if r.ok else 'FAIL':<4} "
                    f"{c(r.registers):>5} {c(r.spills):>6} {c(r.shared_bytes):>7} {r.seconds:5.1f}")
        if r.error:
            rows.append(f"    {r.error}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma list of " + ", ".join(TARGETS))
    ap.add_argument("--json", default="", help="also write the results here")
    a = ap.parse_args(argv)
    targets = [t for t in a.targets.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown targets {unknown}; choose from {list(TARGETS)}")
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: cannot compile", file=sys.stderr)
        return 1
    results = [compile_one(*v, target=t) for v in _variants() for t in targets]
    print(format_table(results))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    failed = [r for r in results if not r.ok]
    summary = f"{len(results) - len(failed)}/{len(results)} compiled"
    print(summary + (f", {len(failed)} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
