"""`python -m anyrec.data.preprocess` streams: the same bytes as before streaming (hashes recorded with the
in-memory converter), rows split across chunks, the fast and the row-by-row parser agreeing, and errors
naming the line."""

from __future__ import annotations

import gzip
import hashlib
import tracemalloc

import numpy as np
import pytest

from anyrec.data import tsv
from anyrec.data.preprocess import convert
from anyrec.data.preprocess import main as preprocess_main


def golden_tsv(path, n=3000):
    """A TSV exercising every parser case: ids up to 2**63 - 1 in any case, negative and missing dense
    values, forms only Python's int() accepts ('+5', ' 7', '0x1f', '1_0'), CRLF and empty lines,
    and (with `bad`) malformed rows."""
    rng = np.random.default_rng(7)
    lines = []
    for i in range(n):
        dense = [str(int(x)) for x in rng.integers(-3, 100_000, 13)]
        dense[i % 13] = ""
        sparse = [format(int(x), "x") for x in rng.integers(0, 2**63 - 1, 26, dtype=np.int64)]
        sparse[(i * 7) % 26] = ""
        if i % 11 == 0:
            sparse[3] = sparse[3].upper()
        if i % 97 == 0:
            dense[2], dense[4], sparse[1], sparse[2] = "+5", " 7", "0x1f", "1_0"
        if i % 89 == 0:
            sparse[0], dense[0] = "7fffffffffffffff", "-1000"
        if i % 83 == 0:
            dense[1] = "0000000000042"
        end = "\r\n" if i % 5 == 0 else "\n"
        lines.append("\t".join([str(int(rng.integers(0, 2))), *dense, *sparse]) + end)
        if i % 501 == 0:
            lines.append("\n")
    path.write_text("".join(lines), newline="")
    return path


def with_bad_rows(path, out):
    """`path` with a few malformed rows inserted."""
    lines = path.read_text().splitlines(keepends=True)
    for i in (10, 1000, 2500):
        lines.insert(i, "1\t2\t3\n")
        lines.insert(i, "\t".join(["0", "x", *["1"] * 38]) + "\n")
        lines.insert(i, "\t".join(["1", *["1"] * 13, "-1", *["1"] * 25]) + "\n")
    out.write_text("".join(lines), newline="")
    return out


def _hashes(out_dir, prefix="day_0"):
    return {part: hashlib.sha256((out_dir / f"{prefix}_{part}.npy").read_bytes()).hexdigest()[:16]
            for part in ("dense", "sparse", "labels")}


# sha256[:16] of each file as the in-memory converter (before streaming, commit 1a8ce34) wrote it.
GOLDEN = {
    "torchrec": {"dense": "7c5a99405e400008", "sparse": "cb1c3ae16274e683", "labels": "a18cae63456642ca"},
    "log1p": {"dense": "8eeeb1a7ccf8b53f", "sparse": "cb1c3ae16274e683", "labels": "a18cae63456642ca"},
}


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    d = tmp_path_factory.mktemp("golden")
    src = golden_tsv(d / "day_0.tsv")
    (d / "gz").mkdir()
    (d / "gz" / "day_0.gz").write_bytes(gzip.compress(src.read_bytes()))
    (d / "bad").mkdir()
    with_bad_rows(src, d / "bad" / "day_0.tsv")
    return d


@pytest.mark.parametrize("block_bytes", [1 << 22, 3000])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("case", ["plain", "gz", "log1p", "skip"])
def test_output_is_byte_equal_to_the_in_memory_converter(golden, tmp_path, monkeypatch, case, fast,
                                                         block_bytes):
    monkeypatch.setattr(tsv, "BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(tsv, "FAST_PARSE", fast)
    src = {"gz": golden / "gz" / "day_0.gz", "skip": golden / "bad" / "day_0.tsv"}.get(
        case, golden / "day_0.tsv")
    args = {"log1p": ["--dense-transform", "log1p"], "skip": ["--on-malformed", "skip"]}.get(case, [])
    assert preprocess_main([str(src), "--out-dir", str(tmp_path), *args]) == 0
    assert _hashes(tmp_path) == GOLDEN["log1p" if case == "log1p" else "torchrec"]


def test_the_fast_parser_takes_most_blocks_and_agrees_with_the_row_parser(golden, monkeypatch):
    """Most 3000-byte blocks of the golden file are parsed by numpy, each to the row parser's values."""
    monkeypatch.setattr(tsv, "BLOCK_BYTES", 3000)
    seen = []
    parse = tsv._fast_block
    monkeypatch.setattr(tsv, "_fast_block", lambda block: seen.append((block, parse(block))) or seen[-1][1])
    path = golden / "day_0.tsv"
    sum(len(c.labels_n) for c in tsv.iter_tsv(path))
    fast = [(block, chunk) for block, chunk in seen if chunk is not None]
    assert len(fast) > len(seen) // 2 > 0
    for block, chunk in fast:
        rows, _ = tsv._slow_block(block, path, 1, "error")
        for a, b in ((chunk.dense_nI, rows.dense_nI), (chunk.sparse_nF, rows.sparse_nF),
                     (chunk.labels_n, rows.labels_n)):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_memory_does_not_grow_with_the_rows(tmp_path, monkeypatch):
    """Peak Python+numpy allocation converting 20k rows stays under a few blocks (the in-memory
    converter held every row: ~30 MB here)."""
    monkeypatch.setattr(tsv, "BLOCK_BYTES", 64 << 10)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**32, (20_000, 26))
    dense = rng.integers(0, 1000, (20_000, 13))
    text = "".join("\t".join(["1", *map(str, d), *(format(int(x), "08x") for x in s)]) + "\n"
                   for d, s in zip(dense, ids, strict=True))
    src = tmp_path / "day_0.tsv"
    src.write_text(text)
    del text, ids, dense
    tracemalloc.start()
    try:
        report = convert(src, tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report["rows"] == 20_000
    assert peak < 2 << 20, f"peak {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("text, message", [
    ("\t".join(["1", *["1"] * 13, "-1f", *["1"] * 25]) + "\n",
     r"line 2: malformed row: categorical id -0x1f is negative"),
    ("\t".join(["1", *["1"] * 13, "f" * 17, *["1"] * 25]) + "\n", r"line 2: .*does not fit in 63 bits"),
    ("1\t" * 5000 + "\n", r"line 2: malformed row: expected 40 tab-separated fields, got 5001"),
])
def test_errors_name_the_line(tmp_path, text, message):
    good = "\t".join(["0", *["3"] * 13, *["a"] * 26]) + "\n"
    src = tmp_path / "day_0.tsv"
    src.write_text(good + text + good)
    with pytest.raises(ValueError, match=rf"criteo: {src} {message}"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # nothing half-written


def test_an_endless_line_is_one_malformed_row(tmp_path, monkeypatch):
    monkeypatch.setattr(tsv, "MAX_LINE_BYTES", 10_000)
    monkeypatch.setattr(tsv, "BLOCK_BYTES", 4096)
    good = "\t".join(["0", *["3"] * 13, *["a"] * 26]) + "\n"
    src = tmp_path / "day_0.tsv"
    src.write_text(good + "x" * 50_000 + "\n" + good)
    with pytest.raises(ValueError, match=rf"criteo: {src} line 2: malformed row: longer than 10000 bytes"):
        convert(src, tmp_path / "out")
    assert convert(src, tmp_path / "out", on_malformed="skip")["malformed_rows"] == 1
    assert np.load(tmp_path / "out" / "day_0_labels.npy").shape == (2, 1)


def test_gzip_members_and_bounded_reads(golden, tmp_path):
    """Concatenated gzip members read as one file (as gzip reads them); a read never returns more than
    asked however well the data compresses."""
    raw = (golden / "day_0.tsv").read_bytes()
    cut = raw.rfind(b"\n", 0, len(raw) // 2) + 1
    two = tmp_path / "day_0.gz"
    two.write_bytes(gzip.compress(raw[:cut]) + gzip.compress(raw[cut:]))
    assert preprocess_main([str(two), "--out-dir", str(tmp_path / "out")]) == 0
    assert _hashes(tmp_path / "out") == GOLDEN["torchrec"]
    bomb = tmp_path / "bomb.gz"
    bomb.write_bytes(gzip.compress(b"0" * (64 << 20), compresslevel=9))  # 64 KiB on disk
    with tsv._open_binary(bomb) as f:
        assert len(f.read(1 << 20)) == 1 << 20
