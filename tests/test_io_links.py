"""No writer follows a symbolic link planted at its path: each one either refuses it in one line, leaving
the link's target (the victim) untouched, or writes a fresh file in its place."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest

from anyrec._hydra import _linked_outputs
from anyrec.data.preprocess import main as preprocess_main
from anyrec.io_checks import LinkError, NoFollowFileHandler, atomic_write, open_nofollow
from anyrec.planner.report import plot_plan
from anyrec.runtime.errors import CheckpointError, write_error_file
from anyrec.trainer.lineage import LOCK, DirLock
from anyrec.trainer.summary import MetricWriter

from .conftest import ROOT
from .test_data import write_tsv

SECRET = "the victim's contents\n"


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "victim"
    v.write_text(SECRET)
    return v


def plant(link, target):
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "symbolic link" in text, text
    return text


@pytest.mark.parametrize("mode", ["x", "a", "a+", "w", "ab", "wb"])
def test_open_nofollow_refuses_a_link_in_every_mode(tmp_path, victim, mode):
    link = plant(tmp_path / "out", victim)
    with pytest.raises(LinkError) as e:
        open_nofollow(link, mode)
    assert str(link) in one_line(e.value)
    assert victim.read_text() == SECRET


def test_open_nofollow_refuses_a_fifo_and_writes_regular_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    errors: list[Exception] = []

    def attempt() -> None:
        try:
            open_nofollow(fifo, "a")
        except LinkError as e:
            errors.append(e)

    for with_reader in (False, True):
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK) if with_reader else None
        opener = threading.Thread(target=attempt, daemon=True)  # a blocking open would hang the test
        opener.start()
        opener.join(timeout=10)
        assert not opener.is_alive(), "opening a FIFO with no reader blocked"
        if reader is not None:
            os.close(reader)
    assert len(errors) == 2 and all("not a regular file" in str(e) for e in errors)
    with open_nofollow(tmp_path / "f", "w") as f:
        f.write("a")
    with open_nofollow(tmp_path / "f", "a") as f:
        f.write("b")
    with open_nofollow(tmp_path / "f", "w") as f:
        f.write("c")
    assert (tmp_path / "f").read_text() == "c"


def test_atomic_write_replaces_the_link_itself(tmp_path, victim):
    link = plant(tmp_path / "out.json", victim)
    with atomic_write(link) as f:
        f.write("{}")
    assert not link.is_symlink() and link.read_text() == "{}" and victim.read_text() == SECRET


def test_directory_lock(tmp_path, victim):
    plant(tmp_path / "ckpt" / LOCK, victim)
    with pytest.raises(CheckpointError) as e:
        DirLock(tmp_path / "ckpt", "run")
    assert "trainer.checkpoint.dir" in one_line(e.value)
    assert victim.read_text() == SECRET


def test_metrics_jsonl(tmp_path, victim):
    plant(tmp_path / "run" / "metrics.jsonl", victim)
    with pytest.raises(LinkError) as e:
        MetricWriter(str(tmp_path / "run"), enabled=True, tensorboard=False)
    one_line(e.value)
    assert victim.read_text() == SECRET


def test_tensorboard_folder_and_file_name(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plant(tmp_path / "run" / "tb", elsewhere)
    with pytest.raises(LinkError) as e:
        MetricWriter(str(tmp_path / "run"), enabled=True)
    one_line(e.value)
    assert list(elsewhere.iterdir()) == []
    # the event file's name ends in a random token, so no link can be planted at it in advance
    names = []
    for run in ("a", "b"):
        w = MetricWriter(str(tmp_path / run), enabled=True)
        w.close()
        names += [p.name.rsplit(".", 1)[-1] for p in (tmp_path / run / "tb").iterdir()]
    assert len(names) == 2 and names[0] != names[1] and all(len(n) == 16 for n in names)


def test_plan_plot(tmp_path, victim):
    from .test_planner import _plan

    link = plant(tmp_path / "plan.png", victim)
    plot_plan(_plan("h100", 2), str(link))
    assert not link.is_symlink() and link.read_bytes()[:4] == b"\x89PNG"
    assert victim.read_text() == SECRET


def test_torchrun_error_file(tmp_path, victim, monkeypatch):
    link = plant(tmp_path / "error.json", victim)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(link))
    write_error_file("anyrec-train: error: x")
    assert victim.read_text() == SECRET
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "fresh.json"))
    write_error_file("anyrec-train: error: x")
    assert "error: x" in (tmp_path / "fresh.json").read_text()


def test_log_file_handler(tmp_path, victim):
    link = plant(tmp_path / "train_rank0.log", victim)
    with pytest.raises(LinkError):
        NoFollowFileHandler(str(link))
    handler = NoFollowFileHandler(str(tmp_path / "ok.log"))
    handler.emit(logging.makeLogRecord({"msg": "hello"}))
    handler.close()
    assert (tmp_path / "ok.log").read_text() == "hello\n" and victim.read_text() == SECRET


@pytest.mark.parametrize("name", ["log", ".hydra", ".hydra/config.yaml", ".hydra/overrides.yaml"])
def test_hydra_files_in_the_run_folder_are_checked_at_start(tmp_path, victim, name):
    from hydra import compose, initialize_config_dir

    from anyrec import _hydra
    from anyrec.config import config_dir

    _hydra.setup()
    run = tmp_path / "run"
    with initialize_config_dir(str(config_dir()), version_base="1.3", job_name="train"):
        cfg = compose("config", [f"hydra.run.dir={run}"], return_hydra_config=True)
    assert _linked_outputs(cfg) is None
    target = victim if name != ".hydra" else tmp_path
    link = plant(run / ("train_rank0.log" if name == "log" else name), target)
    problem = _linked_outputs(cfg)
    assert problem is not None and str(link) in problem and "\n" not in problem
    assert victim.read_text() == SECRET
    # and the log file is opened without following a link, should one appear after the check
    assert cfg.hydra.job_logging.handlers.file["class"] == "anyrec.io_checks.NoFollowFileHandler"


def test_preprocess_outputs(tmp_path, victim):
    src = write_tsv(tmp_path / "day_0", 8)
    link = plant(tmp_path / "out" / "day_0_dense.npy", victim)
    assert preprocess_main([str(src), "--out-dir", str(tmp_path / "out")]) == 0
    assert not link.is_symlink() and victim.read_text() == SECRET


@pytest.mark.integration
def test_train_refuses_a_linked_log_in_one_line(tmp_path, victim):
    run = tmp_path / "run"
    plant(run / "train_rank0.log", victim)
    proc = subprocess.run([sys.executable, "-m", "anyrec.train", f"hydra.run.dir={run}", "trainer.steps=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train_rank0.log is a symbolic link" in lines[0], proc.stderr
    assert victim.read_text() == SECRET


def test_plan_output_and_calibration_files(tmp_path, victim):
    """plan.output (JSON), calibrate.output and the calibration cache's entries (YAML) are renamed into
    place, replacing a link rather than writing through it."""
    from anyrec.io_checks import write_yaml
    from anyrec.planner.report import write_json_atomic

    for name, write in (("plan.json", lambda p: write_json_atomic(str(p), {"a": 1})),
                        ("cal.yaml", lambda p: write_yaml(p, {"a": 1}))):
        link = plant(tmp_path / name, victim)
        write(link)
        assert not link.is_symlink() and "a" in link.read_text() and victim.read_text() == SECRET


def test_multihot_npz(tmp_path, victim):
    import numpy as np

    from anyrec.data.multihot import write_npz_members

    link = plant(tmp_path / "day_0_sparse_multi_hot.npz", victim)
    write_npz_members(link, [((2, 1), np.int32, [np.zeros((2, 1), np.int32)])])
    assert not link.is_symlink() and np.load(link)["0"].shape == (2, 1) and victim.read_text() == SECRET


def test_a_sweep_into_a_folder_with_linked_hydra_files_is_refused(tmp_path, victim):
    from anyrec._hydra import cli_problem

    sweep = tmp_path / "sweep"
    args = ["-m", f"hydra.sweep.dir={sweep}", "trainer.steps=3"]
    assert cli_problem(args) is None
    link = plant(sweep / "1" / ".hydra" / "config.yaml", victim)
    problem = cli_problem(args)
    assert problem is not None and str(link) in problem and "hydra.sweep.dir" in problem
