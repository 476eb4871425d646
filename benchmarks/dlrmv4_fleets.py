"""Which fleets can train DLRMv4: `anyrec-plan model=dlrmv4` at the reference batch (1,024 samples per rank)
on 8, 16 and 32 GPUs of every SKU in the table, its STU layers recomputing selectively as the reference's do
(`model.hstu.stu_recompute`, the default), and where the tables and activations do not fit in HBM, what
does: tables in UVM caching, whole-layer activation recompute (not implemented in the trainer: a what-if),
the largest batch per rank that fits in HBM without either (where none does: with tables in host memory),
or more GPUs (the next column). Each answer carries the predicted step, samples/s and time to the
reference's 69.3 M samples.

    python benchmarks/dlrmv4_fleets.py [--out-dir benchmarks/results/2026-12-07_planning] [--skus h100,mi355x]

Writes fleets.json, fleets.txt (the table) and fleets.svg (SKU x GPU count coloured by the predicted time
to 69.3 M samples of each cell's first answer, blank where nothing fits), and hbm_terms.txt: on 8 x MI355X
(`--terms`), every table in HBM at the reference batch with the STU layers' selective recompute and without
it, each predicted memory term of the rank predicted highest against the usable HBM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from anyrec import _hydra
from anyrec.config import STURecompute
from anyrec.plan import run
from anyrec.planner.advice import size_text
from anyrec.planner.estimators import usable_caps
from anyrec.planner.memory import predict_memory
from anyrec.planner.report import duration_text, samples_per_s
from anyrec.planner.sequence import (
    REFERENCE_SAMPLES,
    hstu_memory_per_sample,
    input_bytes_per_token,
    job_activation_dtypes,
    memory_tokens_per_sample,
)
from anyrec.planner.types import InfeasiblePlanError, Placement, PlanResult

SKUS = ("h100", "h200", "b200", "gb200", "mi300x", "mi325x", "mi350x", "mi355x")
GPUS = (8, 16, 32)
REFERENCE_BATCH = 1024
DEFAULT_OUT = Path("benchmarks/results/2026-12-07_planning")


@dataclass(frozen=True)
class Answer:
    """One plan that fits: how (`mode`), at which batch per rank, and what the planner predicts of it."""

    mode: str  # "hbm" | "uvm" | "recompute" | "uvm+recompute" | "smaller batch" | "uvm, smaller"
    batch_per_rank: int
    step_ms: float
    samples_per_s: float
    hours_to_reference: float
    tables_off_hbm: int


@dataclass(frozen=True)
class Cell:
    """What fits on `gpus` x `sku`: the answers in order of preference (empty: nothing fits) and, where
    the reference batch with every table in HBM does not fit, the refusal's line."""

    sku: str
    gpus: int
    answers: list[Answer]
    refusal: str = ""


def plan(sku: str, gpus: int, batch: int, uvm: bool, *extra: str) -> PlanResult | str:
    """anyrec-plan's plan (what-if: activation recompute allowed, said in the plan), or its refusal line."""
    cfg = _hydra.compose_job(["model=dlrmv4", f"hardware={sku}", f"topology.world_size={gpus}",
                              f"plan.batch_size={batch}", f"planner.allow_uvm={str(uvm).lower()}", *extra])
    try:
        return run(cfg, print_fn=lambda _: None)
    except InfeasiblePlanError as e:
        return str(e)


def answer(result: PlanResult, mode: str) -> Answer:
    rate = samples_per_s(result)
    off = sum(o.placement != Placement.HBM for o in result.tables.values())
    return Answer(mode, result.workload.batch_size_per_rank, result.predicted_step_s * 1e3, rate,
                  REFERENCE_SAMPLES / rate / 3600, off)


def recomputes(result: PlanResult) -> bool:
    return result.workload.options.activation_recompute


def largest_batch(sku: str, gpus: int, uvm: bool = False) -> PlanResult | None:
    """The plan at the largest batch per rank (a multiple of 32, below the reference's) that fits with no
    recompute and every table in HBM (`uvm`: tables in host memory allowed); None where not even 32 does."""
    lo, hi, best = 1, REFERENCE_BATCH // 32 - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = plan(sku, gpus, 32 * mid, uvm=uvm)
        if isinstance(got, PlanResult) and not recomputes(got):
            best, lo = got, mid + 1
        else:
            hi = mid - 1
    return best


def fleet_cell(sku: str, gpus: int) -> Cell:
    """Every way `gpus` x `sku` trains DLRMv4 (see the module doc)."""
    hbm = plan(sku, gpus, REFERENCE_BATCH, uvm=False)
    if isinstance(hbm, PlanResult) and not recomputes(hbm):
        return Cell(sku, gpus, [answer(hbm, "hbm")])
    answers: list[Answer] = []
    refusal = hbm if isinstance(hbm, str) else "every table in HBM fits only with activation recompute"
    uvm = plan(sku, gpus, REFERENCE_BATCH, uvm=True)
    if isinstance(uvm, PlanResult) and not recomputes(uvm):
        answers.append(answer(uvm, "uvm"))
    if isinstance(hbm, PlanResult):
        answers.append(answer(hbm, "recompute"))
    elif isinstance(uvm, PlanResult) and recomputes(uvm):
        answers.append(answer(uvm, "uvm+recompute"))
    smaller = largest_batch(sku, gpus)
    if smaller is not None:
        answers.append(answer(smaller, "smaller batch"))
    elif not answers and (smaller := largest_batch(sku, gpus, uvm=True)) is not None:
        answers.append(answer(smaller, "uvm, smaller"))
    return Cell(sku, gpus, answers, refusal)


def table_text(cells: list[Cell]) -> str:
    lines = [f"DLRMv4 at {REFERENCE_BATCH} samples/rank: what fits, predicted step, samples/s, time to "
             f"{REFERENCE_SAMPLES / 1e6:.1f} M samples; STU layers: selective recompute, as the reference "
             f"(recompute: whole-layer activation recompute, not in the trainer, a what-if)",
             f"{'SKU':<7} {'GPUs':>4}  {'mode':<14} {'batch':>5} {'step ms':>8} {'samples/s':>10} "
             f"{'time':>6}  {'off HBM':>7}"]
    for c in cells:
        if not c.answers:
            lines.append(f"{c.sku:<7} {c.gpus:>4}  nothing fits: {c.refusal}")
        for i, a in enumerate(c.answers):
            head = f"{c.sku:<7} {c.gpus:>4}" if i == 0 else " " * 12
            lines.append(f"{head}  {a.mode:<14} {a.batch_per_rank:>5} {a.step_ms:>8.0f} "
                         f"{a.samples_per_s:>10,.0f} {duration_text(a.hours_to_reference * 3600):>6}  "
                         f"{a.tables_off_hbm:>7}")
    return "\n".join(lines)


def _colour(hours: float, lo: float, hi: float) -> str:
    """Green (fastest) to red (slowest) on a log scale."""
    import math

    x = 0.0 if hi <= lo else (math.log(hours) - math.log(lo)) / (math.log(hi) - math.log(lo))
    r, g = int(60 + 180 * x), int(180 - 120 * x)
    return f"rgb({r},{g},80)"


def fleet_svg(cells: list[Cell]) -> str:
    """SKU (rows) x GPU count (columns), each cell coloured by its first answer's time to the reference's
    samples and labelled with it and the answer's mode; blank where nothing fits."""
    skus = list(dict.fromkeys(c.sku for c in cells))
    gpus = sorted({c.gpus for c in cells})
    hours = [c.answers[0].hours_to_reference for c in cells if c.answers]
    lo, hi = (min(hours), max(hours)) if hours else (1.0, 1.0)
    w, h, left, top = 150, 44, 80, 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + w * len(gpus) + 20}" '
           f'height="{top + h * len(skus) + 50}" font-family="sans-serif" font-size="12">',
           f'<text x="10" y="20" font-size="14">DLRMv4, 1,024 samples/rank: predicted time to '
           f'{REFERENCE_SAMPLES / 1e6:.1f} M samples (anyrec cost model)</text>']
    for j, n in enumerate(gpus):
        out.append(f'<text x="{left + j * w + w / 2}" y="{top - 8}" text-anchor="middle">{n} GPUs</text>')
    for i, sku in enumerate(skus):
        y = top + i * h
        out.append(f'<text x="10" y="{y + h / 2 + 4}">{sku.upper()}</text>')
        for j, n in enumerate(gpus):
            x = left + j * w
            cell = next(c for c in cells if c.sku == sku and c.gpus == n)
            if not cell.answers:
                out.append(f'<rect x="{x}" y="{y}" width="{w - 2}" height="{h - 2}" fill="white" '
                           f'stroke="#ccc"/>')
                continue
            a = cell.answers[0]
            out.append(f'<rect x="{x}" y="{y}" width="{w - 2}" height="{h - 2}" '
                       f'fill="{_colour(a.hours_to_reference, lo, hi)}"/>')
            label = f"{duration_text(a.hours_to_reference * 3600)} ({a.mode}"
            label += f", b={a.batch_per_rank})" if a.batch_per_rank != REFERENCE_BATCH else ")"
            out.append(f'<text x="{x + (w - 2) / 2}" y="{y + h / 2 + 4}" text-anchor="middle" '
                       f'fill="white">{label}</text>')
    out.append(f'<text x="10" y="{top + h * len(skus) + 25}">hbm: every table in HBM at the reference batch; '
               f'uvm: some tables in host memory; recompute: whole-layer activation recompute (a what-if); '
               f'b=: a smaller batch per rank; blank: nothing fits</text>')
    out.append("</svg>")
    return "\n".join(out)


def hbm_terms(sku: str, gpus: int) -> str:
    """Every table in HBM at the reference batch on `gpus` x `sku`, with the STU layers' selective recompute
    (the model's default) and without it (the HBM-only plan costed without the recompute it needs): the
    predicted memory terms of the highest rank against the usable HBM, and the activations per token by
    part."""
    sections = []
    for recompute in (STURecompute.selective, STURecompute.none):
        got = plan(sku, gpus, REFERENCE_BATCH, False, f"model.hstu.stu_recompute={recompute}")
        if isinstance(got, str):
            sections.append(f"{gpus} x {sku}, STU recompute {recompute}: {got}")
            continue
        opts = dataclasses.replace(got.workload.options, activation_recompute=False)
        workload = dataclasses.replace(got.workload, options=opts)
        sections.append(_terms(dataclasses.replace(got, workload=workload)))
    return "\n\n".join(sections)


def _terms(whole: PlanResult) -> str:
    opts = whole.workload.options
    shape, b = opts.hstu, REFERENCE_BATCH
    m = max(predict_memory(whole), key=lambda p: p.reserved_bytes)
    usable = usable_caps(whole.topology, whole.workload).hbm_bytes
    topo = whole.topology
    lines = [f"{topo.world_size} x {topo.device.name}, {b} samples/rank, every table in HBM, "
             f"STU layers' recompute: {shape.stu_recompute}, no activation recompute: predicted peak of the "
             f"highest rank by term (moment: {m.peak_phase})"]
    lines += [f"  {name:<28} {size_text(v):>10}" for name, v in m.terms().items() if v]
    short = m.reserved_bytes - usable
    lines.append(f"  {'reserved peak':<28} {size_text(m.reserved_bytes):>10}  usable {size_text(usable)}: "
                 + (f"{size_text(short)} short" if short > 0 else f"fits, {size_text(-short)} to spare"))
    tokens = memory_tokens_per_sample(shape, b)
    ab = job_activation_dtypes(whole.topology, opts.dense_dtype)
    h = hstu_memory_per_sample(shape, ab, opts.attention_impl, False, tokens)
    per_rank_tokens, positions = b * tokens, b * (tokens - shape.contextual)
    lines.append(f"activations at {tokens:,.0f} tokens/sample ({per_rank_tokens / 1e6:.2f} M per rank):")
    parts = [(f"{shape.num_layers} STU layers' kept tensors", h.kept_layers, per_rank_tokens)]
    if h.recomputed:
        parts.append(("the last layer's recomputed tensors", h.recomputed, per_rank_tokens))
    parts += [("the gradient arriving at the last layer", ab.gemm * shape.model_dim, per_rank_tokens),
              ("the last layer's largest backward part", h.backward, per_rank_tokens),
              ("the preprocessor's kept tensors", h.preprocessor, positions),
              ("token indices and the input dropout mask", input_bytes_per_token(shape, ab), per_rank_tokens)]
    for what, per, n in parts:
        lines.append(f"  {what:<50} {per:>8,.0f} B/token {size_text(per * n):>10}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--skus", default=",".join(SKUS))
    ap.add_argument("--terms", default="mi355x:8", help="SKU:GPUS whose memory terms hbm_terms.txt lists")
    args = ap.parse_args()
    logging.getLogger("anyrec").setLevel(logging.WARNING)
    sku, gpus = args.terms.split(":")
    terms = hbm_terms(sku, int(gpus))
    print(terms)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "hbm_terms.txt").write_text(terms + "\n")
    cells = [fleet_cell(sku, n) for sku in args.skus.split(",") for n in GPUS]
    text = table_text(cells)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "fleets.txt").write_text(text + "\n")
    (args.out_dir / "fleets.json").write_text(json.dumps([asdict(c) for c in cells], indent=1) + "\n")
    (args.out_dir / "fleets.svg").write_text(fleet_svg(cells) + "\n")


if __name__ == "__main__":
    main()
