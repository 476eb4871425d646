"""Integrity by default: without a configured key anyrec signs with a per-user key it creates in its
private cache folder, refuses what a forger re-sealed with recomputed checksums, and says once when it
has no key at all."""

from __future__ import annotations

import json
import logging
import stat

import pytest
import torch
import torch.distributed.checkpoint as dcp

from anyrec import signing
from anyrec.signing import CACHE_DIR_ENV, KEY_ENV, USER_KEY_FILE, resolve_key

from .test_checkpoint_trust import _manager, _recompute, _saved


def _env(tmp_path) -> dict[str, str]:
    return {CACHE_DIR_ENV: str(tmp_path / "cache")}


def test_without_a_configured_key_a_private_per_user_key_is_created_once(tmp_path):
    key = resolve_key(None, _env(tmp_path))
    path = tmp_path / "cache" / USER_KEY_FILE
    assert key is not None and str(path) in key.source
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(key.secret) >= signing.MIN_KEY_BYTES
    assert resolve_key(None, _env(tmp_path)).secret == key.secret  # found again, not replaced
    assert [p.name for p in path.parent.iterdir()] == [USER_KEY_FILE]  # no temporary left behind
    assert resolve_key(None, {**_env(tmp_path), KEY_ENV: "x" * 20}).source == KEY_ENV  # configured first


def test_a_key_file_that_is_a_link_or_open_to_others_is_refused(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    planted = tmp_path / "planted"
    planted.write_text("a-key-the-forger-knows-0123456789\n")
    planted.chmod(0o600)
    (cache / USER_KEY_FILE).symlink_to(planted)
    with pytest.raises(ValueError, match="symbolic link") as e:
        resolve_key(None, _env(tmp_path))
    assert "\n" not in str(e.value)
    (cache / USER_KEY_FILE).unlink()
    resolve_key(None, _env(tmp_path))
    (cache / USER_KEY_FILE).chmod(0o644)
    with pytest.raises(ValueError, match="others may read or write it") as e:
        resolve_key(None, _env(tmp_path))


def test_no_key_when_the_cache_folder_cannot_be_made(tmp_path):
    (tmp_path / "file").write_text("")  # a folder cannot be created under a file (nor, for root, elsewhere)
    assert resolve_key(None, {CACHE_DIR_ENV: str(tmp_path / "file" / "cache")}) is None


def test_checking_without_a_key_says_once_that_checksums_catch_damage_only(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(signing, "_warned_unkeyed", False)
    path = _saved(tmp_path)
    with caplog.at_level(logging.WARNING, logger="anyrec.signing"):
        for _ in range(2):
            m = _manager(tmp_path / "ck")
            m.read_meta(path)
            m.close()
    said = [r.getMessage() for r in caplog.records if "without a signing key" in r.getMessage()]
    assert len(said) == 1 and "damage only" in said[0] and str(path) in said[0], said


def test_a_forged_checkpoint_is_refused_with_the_per_user_key(tmp_path):
    """What a forger does without the key file: weights changed and re-saved with DCP, meta.json's
    checksums recomputed (and its signature dropped or left stale)."""
    key = resolve_key(None, _env(tmp_path))
    path = _saved(tmp_path, key)
    meta = json.loads((path / "meta.json").read_text())
    assert signing.FIELD in meta
    dcp.save({"w": torch.full((3,), 7.0), "groups": [{"lr": 0.1, "name": "dense"}]},
             checkpoint_id=str(tmp_path / "forged"))
    for f in (tmp_path / "forged").iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    for stale in (True, False):
        _recompute(path)  # the checksums made to match; the signature left as it was (stale)
        if not stale:  # or removed
            meta = json.loads((path / "meta.json").read_text())
            (path / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != signing.FIELD}))
        m = _manager(tmp_path / "ck", key)
        with pytest.raises(ValueError, match="signature does not match" if stale else "is not signed") as e:
            m.read_meta(path)
        m.close()
        assert "\n" not in str(e.value) and str(path) in str(e.value)
