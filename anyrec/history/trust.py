"""Whether a calibration's figures are this machine's: a verdict from the load other processes put on
its cores while it measured, the spread of its repeated measurements and what fell back.

A calibration taken on a busy host measures the other work as much as the machine (a GEMM at 2 % of
its quiet rate, step points out of order). It is still used by the job that took it (that job runs on
the same busy host), but it is cached as untrusted: a later run on a quiet host measures again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from anyrec.backends.core_load import CoreLoad

# Empirical: cores' worth of CPU time other processes may take while calibrating (a desktop's editors
# and daemons stay below 0.1 on this project's 2-core hosts; a second 2-rank job takes 1.4 to 1.9).
BUSY_OTHER_CORES = 0.5
MAX_SPREAD = 0.25  # the measurements' median interquartile range over the median, beyond which: noisy
MAX_FIT_ERROR = 0.30  # a fit missing one of its points by more is used by its job, never trusted later


@dataclass(frozen=True)
class Trust:
    """The verdict: trusted, or the causes (one phrase each) why not."""

    trusted: bool
    reasons: list[str] = field(default_factory=list)
    other_cores: float | None = None  # cores' worth other processes used, where measured
    cores: int = 0
    median_spread: float | None = None

    def line(self) -> str:
        """The one line a user reads: why the figures are not trusted, and what follows."""
        if self.trusted:
            return "calibration: figures trusted (quiet host, repeatable measurements)"
        return (f"calibration: {'; '.join(self.reasons)}; figures not cached as trusted (a later run on a "
                "quiet host measures again)")

    def to_dict(self) -> dict[str, Any]:
        return {"trusted": self.trusted, "reasons": list(self.reasons), "other_cores": self.other_cores,
                "cores": self.cores, "median_spread": self.median_spread}


def assess(load: CoreLoad | None, cores: int, spreads: dict[str, float], fallbacks: list[str],
           approximated: list[str] = ()) -> Trust:
    """The verdict on one calibration: `load` over its whole run on its `cores`, each repeated
    measurement's spread, what fell back to the built-in figures (nothing measured in time) and what was
    `approximated` from a part of its points or a poor fit (used by the job that measured them)."""
    reasons = []
    other = load.other_cores if load is not None else None
    if other is not None and other > BUSY_OTHER_CORES:
        reasons.append(f"host busy: other processes used {other:.1f} of {cores} cores during calibration")
    ordered = sorted(spreads.values())
    median = ordered[len(ordered) // 2] if ordered else None
    if median is not None and median > MAX_SPREAD:
        worst = max(spreads, key=spreads.__getitem__)
        reasons.append(f"noisy: repeated measurements spread by {median * 100:.0f} % (median; {worst}: "
                       f"{spreads[worst] * 100:.0f} %)")
    if approximated:
        reasons.append(f"measured in part or fitted poorly (used as measured): {', '.join(approximated)}")
    if fallbacks:
        reasons.append(f"not measured (built-in figures instead): {', '.join(fallbacks)}")
    return Trust(not reasons, reasons, other, cores, median)
