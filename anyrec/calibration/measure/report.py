"""What a calibration shows its user: the measurements as a table, and the verdict on its figures."""

from __future__ import annotations

import logging

from anyrec.backends.hardware_file import Measurements
from anyrec.history.trust import Trust

logger = logging.getLogger(__name__)


def format_table(m: Measurements) -> str:
    """The measurements as a small text table."""
    rows = [("copy", "", (m.copy_bw_bytes_per_s or 0.0) / 1e9, "GB/s")]
    h2d = ((m.h2d_bw_bytes_per_s, "pinned"), (m.h2d_pageable_bw_bytes_per_s, "pageable"))
    rows += [("host->device", variant, value / 1e9, "GB/s") for value, variant in h2d if value is not None]
    if m.gemm_flops is not None:
        rows += [("gemm", "fp32", m.gemm_flops.fp32 / 1e12, "TFLOP/s"),
                 ("gemm", "bf16", m.gemm_flops.bf16 / 1e12, "TFLOP/s")]
    if m.dlrm_mlp is not None:
        rows.append(("dlrm mlp f+b", "fp32", m.dlrm_mlp.flops / 1e12, "TFLOP/s"))
    skipped = []
    for impl, e in (m.embedding or {}).items():
        if e.profile is None:
            skipped.append(f"embedding {impl}: {e.skipped}")
            continue
        p = e.profile
        rows += [(f"emb {impl}", "bw_eff", p.bw_efficiency, "fraction"),
                 (f"emb {impl}", "per_row", p.per_row_s * 1e9, "ns"),
                 (f"emb {impl}", "per_launch", p.per_launch_s * 1e6, "us"),
                 (f"emb {impl}", "fit_err", (e.fit_max_rel_error or 0.0) * 100, "% (max)")]
    if m.collectives is not None:
        variant = f"{m.collectives.world_size} ranks"
        for op in ("all_to_all", "all_reduce", "reduce_scatter"):
            c = getattr(m.collectives, op)
            if c is None:
                continue
            if c.skipped is not None:
                skipped.append(f"{op}: {c.skipped}")
                continue
            rows += [(op, variant, c.bus_bw_bytes_per_s / 1e9, "GB/s (bus)"),
                     (op, "latency", c.latency_s * 1e6, "us")]
    for g, entry in (m.collectives_subgroups or {}).items():
        if entry.replicas is None:
            skipped.append(f"collectives on groups of {g}: {entry.skipped}")
            continue
        for op, ranks in (("all_to_all", f"{g} of {entry.world_size}"),
                          ("all_reduce_replicas", f"{entry.replicas} of {entry.world_size}")):
            c = getattr(entry, op)
            if c.skipped is not None:
                skipped.append(f"{op} (groups of {g}): {c.skipped}")
                continue
            name = "all_to_all" if op == "all_to_all" else "all_reduce rep"
            rows += [(name, ranks, c.bus_bw_bytes_per_s / 1e9, "GB/s (bus)"),
                     (name, "latency", c.latency_s * 1e6, "us")]
    if m.step is not None and m.step.fields is not None:
        fields = m.step.fields
        rows += [("trainer step", f.removesuffix("_s"), getattr(fields, f) * 1e6, "us")
                 for f in type(fields).__dataclass_fields__]
        if m.step.fit_max_rel_error is not None:
            rows.append(("trainer step", "fit_err", m.step.fit_max_rel_error * 100, "% (max)"))
    lines = [f"{'measurement':<16} {'variant':<10} {'value':>12}  unit"]
    lines += [f"{a:<16} {b:<10} {v:>12.3f}  {u}" for a, b, v, u in rows]
    return "\n".join(lines + [f"(skipped) {s}" for s in skipped])


def report_trust(m: Measurements) -> None:
    """Rank 0's one line on whether the figures are this machine's (a warning when they are not)."""
    if m.trust is None:
        return
    v = m.trust
    trust = Trust(v.trusted, list(v.reasons or ()), v.other_cores, v.cores or 0, v.median_spread)
    (logger.info if trust.trusted else logger.warning)("%s", trust.line())
