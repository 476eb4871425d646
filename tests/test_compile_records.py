"""The compile records (anyrec/history/compile_records.py): written whole, read back only when whole and
for the same key, never written through a link."""

from __future__ import annotations

import logging
import os

from anyrec.history.compile_records import CompileRecord, read_record, record_path, write_record


def test_record_round_trips_and_a_damaged_or_foreign_one_is_ignored(tmp_path, caplog):
    path = record_path("abc", tmp_path)
    rec = CompileRecord("abc", 12.5, 0.004, 0.003)
    write_record(path, rec)
    assert read_record(path, "abc") == rec
    assert read_record(path, "other") is None  # another job's shape
    path.write_text(path.read_text()[:20])  # cut short
    with caplog.at_level(logging.WARNING):
        assert read_record(path, "abc") is None
    assert "compile record ignored" in caplog.text
    assert read_record(tmp_path / "missing.json", "abc") is None


def test_record_write_replaces_a_link_never_writes_through_it(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("keep")
    path = record_path("abc", tmp_path)
    path.parent.mkdir(parents=True)
    os.symlink(target, path)
    write_record(path, CompileRecord("abc", 1.0, 2.0, 3.0))
    assert target.read_text() == "keep" and not path.is_symlink()
