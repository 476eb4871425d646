"""The calibration cache (anyrec.history.cache): found again by key, never used when damaged or
foreign."""

from __future__ import annotations

import dataclasses
import multiprocessing
from pathlib import Path

import pytest
import yaml

from anyrec.backends import get_backend
from anyrec.backends.threads import ThreadChoice
from anyrec.history import cache as calcache
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.signing import SigningKey

CAL = Path(__file__).parent / "data" / "calibration_cpu_2rank.yaml"


def _key(**changes) -> calcache.CacheKey:
    key = calcache.make_key("cpu", "CPU x86_64", 1, [[0], [1]], 1)
    return dataclasses.replace(key, **changes)


def _entry(tmp_path, key=None) -> Path:
    key = key or _key()
    return calcache.write_entry(tmp_path / key.file_name(), key, yaml.safe_load(CAL.read_text()))


def test_an_entry_is_found_again(tmp_path):
    path = _entry(tmp_path)
    found = calcache.lookup(_key(), tmp_path)
    assert found.hit and found.path == path and found.problem is None
    assert found.hardware.spec.step_fixed_s > 0 and "fbgemm" in found.hardware.profiles
    assert calcache.lookup(_key(), tmp_path / "empty").problem is None  # nothing there: a plain miss


@pytest.mark.parametrize("change", [
    {"local_world_size": 4, "cores_per_rank": ((0,), (1,), (2,), (3,))},
    {"versions": (("anyrec", "0.1.0"), ("fbgemm", "1.9.0"), ("torch", "2.14.0"), ("torchrec", "1.9.2"))},
    {"cores_per_rank": ((0, 1), ())},
    {"device_name": "another CPU"},
])
def test_what_changes_the_figures_changes_the_file(tmp_path, change):
    _entry(tmp_path)
    other = _key(**change)
    assert other.file_name() != _key().file_name()
    assert not calcache.lookup(other, tmp_path).hit


def test_an_entry_says_how_its_ranks_were_bound(tmp_path):
    """Bound or free is not in the key (auto decides it by the load at start): the entry records it."""
    data = yaml.safe_load(CAL.read_text())
    for bound in (True, False):
        data["measurements"]["bind_cores"] = bound
        calcache.write_entry(tmp_path / _key().file_name(), _key(), data)
        assert calcache.lookup(_key(), tmp_path).bound is bound


def test_the_key_holds_the_installed_versions():
    versions = dict(_key().versions)
    import torch
    import torchrec  # noqa: F401

    assert versions["torch"] == torch.__version__.split("+")[0] or versions["torch"] == torch.__version__
    assert versions["fbgemm"] != "none" and versions["torchrec"] != "none" and versions["anyrec"]


def _problem(tmp_path, edit) -> str:
    path = _entry(tmp_path)
    path.write_text(edit(path.read_text()))
    found = calcache.lookup(_key(), tmp_path)
    assert not found.hit and found.problem and "\n" not in found.problem
    return found.problem


def test_a_truncated_entry_is_not_used(tmp_path):
    for keep in (0.3, 0.9, 0.999):
        problem = _problem(tmp_path, lambda t, keep=keep: t[:int(len(t) * keep)])
        assert "cut short" in problem or "unreadable" in problem or "checksum" in problem


def test_a_hand_edited_entry_is_not_used(tmp_path):
    problem = _problem(tmp_path, lambda t: t.replace("step_fixed_s: ", "step_fixed_s: 1", 1))
    assert "checksum" in problem


def test_a_nan_entry_is_not_used(tmp_path):
    """A NaN written with a checksum to match (as a buggy measurement would): the whole-file check."""
    key = _key()
    data = yaml.safe_load(CAL.read_text())
    data["measurements"]["embedding"]["fbgemm"]["profile"]["per_row_s"] = float("nan")
    calcache.write_entry(tmp_path / key.file_name(), key, data)
    found = calcache.lookup(key, tmp_path)
    assert not found.hit and "per_row_s is not a finite number" in found.problem


def test_a_foreign_version_entry_is_not_used(tmp_path):
    """A file at this key's name made with another torch (copied, or renamed by hand) is named as such."""
    old = (("anyrec", "0.1.0"), ("fbgemm", "1.8.0"), ("torch", "2.12.0"), ("torchrec", "1.8.0"))
    other = _key(versions=old)
    calcache.write_entry(tmp_path / _key().file_name(), other, yaml.safe_load(CAL.read_text()))
    problem = calcache.lookup(_key(), tmp_path).problem
    assert "another machine or software" in problem and "torch 2.12.0 (this is" in problem


def _writer(directory: str, started, stop) -> None:
    _entry(Path(directory))
    started.set()
    while not stop.is_set():
        _entry(Path(directory))


READS_WHILE_BOTH_WRITE = 50


@pytest.mark.integration
def test_concurrent_writers_leave_one_whole_file(tmp_path):
    """Two jobs measuring at once on a cold cache: each write is a rename, so a reader while both write
    (they write until it has found the file whole READS_WHILE_BOTH_WRITE times) and after them finds a
    whole, valid file, and no temporary file is left."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    started = [ctx.Event() for _ in range(2)]
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s, stop)) for s in started]
    for p in procs:
        p.start()
    try:
        assert all(s.wait(timeout=120) for s in started)  # both have written once and go on writing
        seen = 0
        while seen < READS_WHILE_BOTH_WRITE:
            found = calcache.lookup(_key(), tmp_path)
            assert found.problem is None, found.problem
            assert found.hit and all(p.is_alive() for p in procs)  # the overlap: both still writing
            seen += 1
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert calcache.lookup(_key(), tmp_path).hit
    assert [f.name for f in tmp_path.iterdir()] == [_key().file_name()]


def test_local_key_without_a_process_group():
    key = calcache.local_key(get_backend("cpu"), ONE_PROCESS)
    assert key.backend == "cpu" and key.local_world_size == 1 and key.threads_per_rank >= 1
    assert key.file_name().startswith("calibration-cpu-") and key.file_name().endswith(".yaml")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(calcache.CACHE_DIR_ENV, str(tmp_path))
    assert calcache.cache_dir() == tmp_path
    monkeypatch.delenv(calcache.CACHE_DIR_ENV)
    assert calcache.cache_dir() == Path("~/.cache/anyrec").expanduser()


KEY = SigningKey(b"0123456789abcdef0123", "test key")


def _forged(tmp_path, key: SigningKey | None) -> Path:
    """An entry edited by someone who can write the cache folder: figures changed, checksum recomputed."""
    path = calcache.write_entry(tmp_path / _key().file_name(), _key(), yaml.safe_load(CAL.read_text()),
                                signing_key=key)
    data = yaml.safe_load(path.read_text())
    data["spec"]["step_fixed_s"] = 1.0
    data["cache"]["sha256"] = calcache._content_digest(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_forged_entry_with_a_matching_checksum(tmp_path):
    """Without a key the checksum detects damage, not forgery (documented); with one it is refused."""
    _forged(tmp_path, None)
    assert calcache.lookup(_key(), tmp_path).hit  # what the docs say a key is for
    _forged(tmp_path, KEY)
    found = calcache.lookup(_key(), tmp_path, KEY)
    assert not found.hit and "signature does not match" in found.problem and "\n" not in found.problem


def test_signed_entries_are_hits_and_unsigned_ones_refused_with_a_key(tmp_path):
    calcache.write_entry(tmp_path / _key().file_name(), _key(), yaml.safe_load(CAL.read_text()),
                         signing_key=KEY)
    assert calcache.lookup(_key(), tmp_path, KEY).hit
    assert calcache.lookup(_key(), tmp_path).hit  # a key is needed to check, not to read
    _entry(tmp_path)
    found = calcache.lookup(_key(), tmp_path, KEY)
    assert not found.hit and "is not signed" in found.problem


def test_a_small_entry_that_expands_without_bound_is_not_used(tmp_path):
    """1 KB of aliases under `measurements:` used to grow past 1.2 GB in the checksum's json.dumps."""
    bomb = "  lol: &a [" + ",".join(['"lol"'] * 9) + "]\n" + "".join(
        f"  l{c}: &{c} [{','.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    problem = _problem(tmp_path, lambda t: t.replace("measurements:\n", "measurements:\n" + bomb, 1))
    assert "expands to more than" in problem


def test_an_entry_measured_on_a_busy_host_says_so(tmp_path):
    from anyrec.backends.core_load import CoreLoad
    from anyrec.calibration.first_contact import remeasure_untrusted

    data = yaml.safe_load(CAL.read_text())
    assert calcache.lookup(_key(), tmp_path).distrust is None  # nothing there
    _entry(tmp_path)
    assert calcache.lookup(_key(), tmp_path).distrust is None  # written before the verdict: trusted
    reason = "host busy: other processes used 1.4 of 2 cores during calibration"
    data["measurements"]["trust"] = {"trusted": False, "reasons": [reason]}
    calcache.write_entry(tmp_path / _key().file_name(), _key(), data)
    found = calcache.lookup(_key(), tmp_path)
    assert found.hit and found.distrust == reason
    # Measured again once the host is quiet; planned with while it is still busy.
    quiet, busy = CoreLoad(1.1, 1.0, 0.25), CoreLoad(2.0, 0.5, 0.25)
    assert "host is quiet now" in remeasure_untrusted(found.distrust, quiet)
    assert remeasure_untrusted(found.distrust, busy) is None


def test_the_key_holds_the_share_of_cores_not_what_a_busy_host_left(monkeypatch):
    """Two jobs that started beside different loads (auto took 1 thread in one, 2 in the other) share an
    entry: the key holds auto's share; a forced count is the machine's setting and stays in the key."""
    backend = get_backend("cpu")
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)
    auto = ThreadChoice(intra_op=1, share_cores=2, setting=None)
    assert calcache.local_key(backend, ONE_PROCESS, threads=auto).threads_per_rank == 2
    forced = ThreadChoice(intra_op=1, share_cores=2, setting=1)
    assert calcache.local_key(backend, ONE_PROCESS, threads=forced).threads_per_rank == 1


def test_an_entry_a_run_measured_ten_times_off_is_named_and_not_used_again(tmp_path, monkeypatch, caplog):
    """A cache entry whose prediction misses the measured step by more than 10x (forged with a right
    checksum, say): the summary's warning names the file, the next lookup misses (measured again), and the
    entry measured again is used."""
    from anyrec.trainer.summary import _reject_far_miss

    monkeypatch.setenv(calcache.CACHE_DIR_ENV, str(tmp_path))
    path = _entry(tmp_path)
    _reject_far_miss(str(path), 7.0, 7.5)  # 7 s predicted, 7.5 ms measured
    (line,) = [r.getMessage() for r in caplog.records if "not used again" in r.getMessage()]
    assert str(path) in line and "7000.00 ms per step" in line and "7.50 ms" in line
    found = calcache.lookup(_key(), tmp_path)
    assert not found.hit and "rejected by an earlier run" in found.problem and "\n" not in found.problem
    # the next run measures again and writes a new entry: the mark names the old content, not this one
    data = yaml.safe_load(CAL.read_text())
    data["spec"]["step_fixed_s"] = 0.002
    calcache.write_entry(path, _key(), data)
    assert calcache.lookup(_key(), tmp_path).hit


def test_a_near_miss_or_a_users_own_file_is_not_rejected(tmp_path, monkeypatch, caplog):
    from anyrec.trainer.summary import _reject_far_miss

    monkeypatch.setenv(calcache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    path = _entry(tmp_path / "cache")
    _reject_far_miss(str(path), 0.070, 7.5)  # 9.3x: a poor prediction, not a foreign entry
    assert calcache.lookup(_key(), tmp_path / "cache").hit
    own = _entry(tmp_path)  # a hardware file outside the cache folder: the user's to mend
    _reject_far_miss(str(own), 7.0, 7.5)
    assert not list(tmp_path.glob("*.rejected")) and "not used again" not in caplog.text
