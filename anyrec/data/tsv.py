"""Criteo TSV rows, read in blocks of whole lines in bounded memory: `iter_tsv` yields numpy chunks.

Each block (a few MiB of whole lines) is parsed with numpy when every row is in the plain form Criteo
writes (label 0/1, decimal dense integers, hex ids, LF or CRLF endings); a block holding anything else
(an empty line, '+5', '0x1f', a malformed row) is parsed row by row with `parse_row`, the rule both paths
share: they accept the same rows and give the same values, so only speed depends on which one ran.
Lines are numbered from 1 as a text reader numbers them (a lone CR ends a line too).
Legend: n rows of a chunk, I dense features (13), F sparse features (26).
"""

from __future__ import annotations

import io
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT

logger = logging.getLogger(__name__)

NUM_FIELDS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
MALFORMED = ("error", "skip")
# torchrec stores raw dense integers as int32 and ids as int64 before transforming them.
INT32 = (-(2**31), 2**31 - 1)
MAX_ID = 2**63 - 1
BLOCK_BYTES = 2 << 20  # read size: a block's arrays are ~10 times this (bounds memory)
MAX_LINE_BYTES = 1 << 20  # a valid row has under 700 bytes; a longer line is malformed
FAST_PARSE = True  # tests flip it to check that the row-by-row parser gives the same bytes

_DENSE_DIGITS = 10  # int32 needs at most 10 decimal digits; more (leading zeros) goes row by row
_ID_DIGITS = 16  # int64 needs at most 16 hex digits
_HEX = np.full(256, 255, dtype=np.uint8)
for _c in b"0123456789":
    _HEX[_c] = _c - 48
for _c in b"abcdef":
    _HEX[_c] = _c - 87
for _c in b"ABCDEF":
    _HEX[_c] = _c - 55


_EMPTY = (np.zeros((0, INT_FEATURE_COUNT), np.int32), np.zeros((0, CAT_FEATURE_COUNT), np.int64),
          np.zeros(0, np.int32))


@dataclass
class TsvChunk:
    """Consecutive valid rows: raw dense integers, raw ids and labels."""

    dense_nI: np.ndarray  # int32
    sparse_nF: np.ndarray  # int64
    labels_n: np.ndarray  # int32
    malformed_rows: int = 0  # skipped among these lines


def parse_row(fields: list[str]) -> tuple[list[int], list[int], int]:
    """(dense, sparse, label) of one split TSV row; ValueError says what is wrong with it."""
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
    label = fields[0]
    if label not in ("0", "1"):
        raise ValueError(f"label must be 0 or 1, got {label!r}")
    try:
        dense = [int(x) if x else 0 for x in fields[1:1 + INT_FEATURE_COUNT]]
    except ValueError as e:
        raise ValueError(f"non-integer dense feature ({e})") from None
    if dense and not INT32[0] <= min(dense) <= max(dense) <= INT32[1]:
        bad = next(x for x in dense if not INT32[0] <= x <= INT32[1])
        raise ValueError(f"dense value {bad} does not fit in 32 bits (torchrec stores dense values as int32)")
    try:
        sparse = [int(x, 16) if x else 0 for x in fields[1 + INT_FEATURE_COUNT:]]
    except ValueError as e:
        raise ValueError(f"non-hex categorical feature ({e})") from None
    if sparse and min(sparse) < 0:
        raise ValueError(f"categorical id {min(sparse):#x} is negative (ids are unsigned hex)")
    if sparse and max(sparse) > MAX_ID:
        raise ValueError(f"categorical id {max(sparse):#x} does not fit in 63 bits (ids are stored as int64)")
    return dense, sparse, int(label)


class _Gunzip:
    """A gzip file's bytes (concatenated members as one stream, as gzip reads them), decompressed by zlib
    a read at a time: twice gzip.GzipFile's speed, whose reads go through 8 KiB buffers. A read returns at
    most `n` bytes however well the file compresses."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._d = zlib.decompressobj(31)  # 31: a gzip header and trailer around deflate
        self._pending = b""  # compressed bytes the decompressor has not taken yet
        self._in_member = False

    def read(self, n: int) -> bytes:
        parts, size = [], 0
        while size < n:
            if not self._pending:
                self._pending = self._raw.read(1 << 20)
                if not self._pending:
                    if self._in_member and not self._d.eof:
                        raise EOFError("compressed file ended before the end-of-stream marker was reached")
                    break
            if self._d.eof:  # the next member
                self._d, self._in_member = zlib.decompressobj(31), False
            data = self._d.decompress(self._pending, n - size)
            self._in_member = True
            self._pending = self._d.unused_data if self._d.eof else self._d.unconsumed_tail
            parts.append(data)
            size += len(data)
        return b"".join(parts)

    def __enter__(self) -> _Gunzip:
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.close()


def _open_binary(path: Path) -> BinaryIO | _Gunzip:
    """The file's bytes, gunzipped when it starts with gzip's magic bytes."""
    raw = path.open("rb")
    if raw.read(2) == b"\x1f\x8b":
        raw.seek(0)
        return _Gunzip(raw)
    raw.seek(0)
    return raw


def _digits(a: np.ndarray, start: np.ndarray, count: np.ndarray, width: int, base: int,
            table: np.ndarray) -> tuple[np.ndarray, bool]:
    """(value as uint64, all characters valid) of the fields a[start:start + count] in `base`: the fields
    right-aligned in a [fields, width] matrix of digit values (0 left of a field), then Horner's rule."""
    count = count.ravel()
    end = (start.ravel() + count).astype(np.int32)
    j = np.arange(-width, 0, dtype=np.int32)
    d = table[a[np.maximum(end[:, None] + j, 0)]]
    d *= j >= -count[:, None]
    value = np.zeros(len(end), dtype=np.uint64)
    for col in d.T:
        value *= np.uint64(base)
        value += col
    return value.reshape(start.shape), bool((d < base).all())


def _fast_block(block: bytes) -> TsvChunk | None:
    """The rows of `block` (whole lines, ending in LF) when every line is a plain-form row, else None."""
    a = np.frombuffer(block, dtype=np.uint8)
    cr = np.flatnonzero(a == 13)
    if cr.size:
        if not np.all(a[cr + 1] == 10):
            return None  # a lone CR: a line break only a text reader sees
        a = np.delete(a, cr)
    seps = np.flatnonzero((a == 9) | (a == 10))
    is_nl = a[seps] == 10
    if seps.size % NUM_FIELDS or not seps.size or is_nl.sum() != seps.size // NUM_FIELDS:
        return None  # an empty line, or a row with a wrong field count
    n = seps.size // NUM_FIELDS
    if not is_nl.reshape(n, NUM_FIELDS)[:, -1].all():
        return None
    start = np.empty_like(seps)
    start[0], start[1:] = 0, seps[:-1] + 1
    start_nf, count_nf = start.reshape(n, NUM_FIELDS), (seps - start).reshape(n, NUM_FIELDS)
    if not np.all(count_nf[:, 0] == 1):
        return None
    labels = a[start_nf[:, 0]].astype(np.int32) - 48
    if not np.all((labels == 0) | (labels == 1)):
        return None
    d_start, d_count = start_nf[:, 1:1 + INT_FEATURE_COUNT], count_nf[:, 1:1 + INT_FEATURE_COUNT]
    neg = (d_count > 0) & (a[d_start] == ord("-"))
    d_count = d_count - neg
    if np.any(neg & (d_count == 0)) or (d_count.size and d_count.max() > _DENSE_DIGITS):
        return None
    dense, ok = _digits(a, d_start + neg, d_count, int(d_count.max(initial=0)), 10, _HEX)
    if not ok:
        return None
    dense_nI = np.where(neg, -dense.astype(np.int64), dense.astype(np.int64))
    if dense_nI.size and not INT32[0] <= dense_nI.min() <= dense_nI.max() <= INT32[1]:
        return None
    s_start, s_count = start_nf[:, 1 + INT_FEATURE_COUNT:], count_nf[:, 1 + INT_FEATURE_COUNT:]
    width = int(s_count.max(initial=0))
    if width > _ID_DIGITS:
        return None
    sparse, ok = _digits(a, s_start, s_count, width, 16, _HEX)
    if not ok or (sparse.size and sparse.max() > MAX_ID):
        return None
    return TsvChunk(dense_nI.astype(np.int32), sparse.astype(np.int64), labels)


def _slow_block(block: bytes, path: Path, first_line: int, on_malformed: str) -> tuple[TsvChunk, int]:
    """(rows, lines read) of `block`, row by row as a text reader splits it."""
    dense, sparse, labels = [], [], []
    bad = lines = 0
    for lines, line in enumerate(io.StringIO(block.decode("utf-8", errors="replace"), newline=""), start=1):
        line = line.rstrip("\n").rstrip("\r")
        if not line:
            continue
        try:
            d, s, y = parse_row(line.split("\t"))
        except ValueError as e:
            if on_malformed == "error":
                raise ValueError(f"criteo: {path} line {first_line + lines - 1}: malformed row: {e} "
                                 "(set data.on_malformed=skip to count and skip such rows)") from None
            bad += 1
            continue
        dense.append(d)
        sparse.append(s)
        labels.append(y)
    chunk = TsvChunk(np.asarray(dense, dtype=np.int32).reshape(-1, INT_FEATURE_COUNT),
                     np.asarray(sparse, dtype=np.int64).reshape(-1, CAT_FEATURE_COUNT),
                     np.asarray(labels, dtype=np.int32), bad)
    return chunk, lines


def _blocks(f: BinaryIO | _Gunzip, path: Path, on_malformed: str, where: list[int]) -> Iterator[bytes | None]:
    """Blocks of whole lines (the last one given its LF); None for a line over MAX_LINE_BYTES, skipped.
    `where[0]` is the caller's next line number, for the error."""
    carry = b""
    dropping = False  # inside an over-long line being skipped
    while True:
        data = f.read(BLOCK_BYTES)
        if not data:
            if carry and not dropping:
                yield carry + b"\n"
            return
        if dropping:
            nl = data.find(b"\n")
            if nl < 0:
                continue
            dropping, data = False, data[nl + 1:]
        buf = carry + data
        cut = buf.rfind(b"\n") + 1
        carry = buf[cut:]
        if cut:
            yield buf[:cut]
        elif len(carry) > MAX_LINE_BYTES:
            if on_malformed == "error":
                raise ValueError(f"criteo: {path} line {where[0]}: malformed row: longer than "
                                 f"{MAX_LINE_BYTES} bytes (set data.on_malformed=skip to count and "
                                 "skip such rows)")
            dropping, carry = True, b""
            yield None


def iter_tsv(path: Path, on_malformed: str = "error") -> Iterator[TsvChunk]:
    """The valid rows of a Criteo TSV file (plain or gzipped), a block at a time. Malformed rows raise
    ValueError naming the line (`error`) or are counted and logged at the end (`skip`); a file with no
    valid row is an error."""
    if on_malformed not in MALFORMED:
        raise ValueError(f"data.on_malformed must be one of {MALFORMED}, got {on_malformed!r}")
    if not path.is_file():
        raise ValueError(f"criteo: no such TSV file {path}")
    where = [1]  # the next line's number
    bad = rows = 0
    try:
        with _open_binary(path) as f:
            for block in _blocks(f, path, on_malformed, where):
                if block is None:  # an over-long line, skipped
                    chunk, lines = TsvChunk(*_EMPTY, malformed_rows=1), 1
                elif (chunk := _fast_block(block) if FAST_PARSE else None) is not None:
                    lines = block.count(b"\n")
                else:
                    chunk, lines = _slow_block(block, path, where[0], on_malformed)
                where[0] += lines
                bad += chunk.malformed_rows
                rows += len(chunk.labels_n)
                yield chunk
    except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt .gz
        raise ValueError(f"criteo: {path}: unreadable after line {where[0] - 1}: {e}") from None
    if bad:
        logger.warning("criteo: %s: skipped %d malformed rows of %d", path, bad, bad + rows)
    if not rows:
        raise ValueError(f"criteo: {path} has no valid rows")
