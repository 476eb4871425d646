"""The HSTU records: an HSTU job's kernels' rates (its attention implementation, its GEMMs, its elementwise
passes, its whole dense part) measured on its shapes on this machine, kept beside the calibration cache
entry they were measured with, so a later job of the same shapes plans with them without measuring again.

A record lives in the cache folder (`$ANYREC_CACHE_DIR/hstu/<key>.json`), named by `record_key`: the
content of the calibration entry (a re-measured entry, a quiet host's after a busy one's, names new
records), the implementation, the dtype, the heads, dims and lengths, and the batch. A record cut short,
made for another key, of another version or holding a value out of range is ignored, in one line, and
measured again; records are written whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path

from anyrec.backends.hardware import HSTURates
from anyrec.io_checks import atomic_write
from anyrec.safe_load import UnsafeFileError, load_json
from anyrec.schema import HSTUShape
from anyrec.signing import cache_dir

logger = logging.getLogger(__name__)

RECORD_VERSION = 3  # 2: the whole dense part's step (dense_step_s); 3: timed for DENSE_BUDGET_S, not 5 passes
MAX_RECORD_BYTES = 4096
DTYPES = ("fp32", "bf16")


def record_key(entry_text: str, impl: str, half: bool, shape: HSTUShape, batch: int) -> str:
    """The digest naming a record: the calibration entry's text, the implementation, the dtype (bf16
    where `half`), the shape's heads, dims and lengths, and the batch per rank."""
    parts = {"entry": hashlib.sha256(entry_text.encode()).hexdigest(), "impl": impl,
             "dtype": DTYPES[half], "heads": shape.num_heads, "qk_dim": shape.qk_dim, "v_dim": shape.v_dim,
             "seq_len": shape.seq_len, "mean": shape.mean_tokens, "rms": shape.rms_tokens,
             "longest": shape.longest_tokens, "batch": batch}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def record_path(key: str, directory: Path | None = None) -> Path:
    """Where the record named `key` lives: `directory` (default: the cache folder) / hstu / key.json."""
    return (directory or cache_dir()) / "hstu" / f"{key}.json"


def _problem(data: object, key: str) -> str | None:
    """Why `data` is not a record for `key`, or None."""
    if not isinstance(data, dict) or data.get("key") != key or data.get("version") != RECORD_VERSION:
        return "not a record of this version for this job"
    rate = data.get("rate")
    if not isinstance(rate, dict):
        return "no rate"
    texts = (rate.get("impl"), rate.get("source", ""))
    if rate.get("dtype") not in DTYPES or not all(isinstance(t, str) for t in texts):
        return "its implementation, dtype or source is not one"
    for name in ("forward_s", "step_s", "flops_per_s", "gemm_flops_per_s", "elementwise_bw_bytes_per_s",
                 "mean_tokens", "rms_tokens", "longest_tokens", "dense_step_s"):
        v = rate.get(name)
        if isinstance(v, bool) or not isinstance(v, float | int) or not math.isfinite(v) or v <= 0:
            return f"{name} is not a positive number"
    spread = rate.get("spread", 0.0)
    if isinstance(spread, bool) or not isinstance(spread, float | int) or not 0 <= spread < math.inf:
        return "spread is not a number >= 0"
    for name in ("heads", "qk_dim", "v_dim", "batch"):
        v = rate.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{name} is not a positive integer"
    return None


def read_record(path: Path, key: str) -> HSTURates | None:
    """The rate recorded at `path` if the record is whole, for `key` and of this version; None (said in one
    line when a file is there) else."""
    if not path.exists():
        return None
    try:
        data = load_json(path, f"HSTU record {path}", max_bytes=MAX_RECORD_BYTES)
        problem = _problem(data, key)
        if problem is None:
            return HSTURates(**data["rate"])
    except (UnsafeFileError, TypeError) as e:
        problem = str(e).splitlines()[0]
    logger.warning("HSTU record %s ignored (%s)", path, problem)
    return None


def write_record(path: Path, key: str, rate: HSTURates) -> None:
    """Write `rate` as the record named `key`, whole or not at all (a rename; a link at `path` is
    replaced, never written through)."""
    with atomic_write(path) as f:
        json.dump({"version": RECORD_VERSION, "key": key, "rate": dataclasses.asdict(rate)}, f)
