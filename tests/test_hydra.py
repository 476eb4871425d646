"""The entry points under Hydra's runner (anyrec/_hydra.py): `--help` for each; one line and exit status 2
for what Hydra or `StartChecks` refuses, before the run folder is made; the job's own errors raised."""

from __future__ import annotations

import copy
import importlib
import logging
import os
import sys
import warnings

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from anyrec import _hydra, plan

ENTRY_POINTS = ["train", "plan", "calibrate", "parity", "export", "predict"]


@pytest.fixture(autouse=True)
def restored(monkeypatch):
    """Each test starts without HYDRA_FULL_ERROR and leaves logging and warnings as it found them."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # the entry point sets its own
    root, ours = logging.getLogger(), logging.getLogger("anyrec")
    saved = root.handlers[:], root.level, ours.level
    yield
    logging.captureWarnings(False)
    for h in root.handlers:
        if h not in saved[0]:
            h.close()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    ours.setLevel(saved[2])


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_prints_the_usage_and_exits_0(name, monkeypatch, capsys):
    module = importlib.import_module(f"anyrec.{name}")
    monkeypatch.setattr(sys, "argv", [f"anyrec-{name}", "--help"])
    with pytest.raises(SystemExit) as stop:
        module.cli()
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "== Configuration groups ==" in out and "model: dlrm, " in out and "_schema" not in out
    assert "trainer:\n" in out  # the config itself
    if name == "parity":  # and the check each model family runs when given no variants
        assert "== Default checks (no parity.variants given) ==\n" in out and "\ndlrmv4: " in out


REFUSED = [
    (["model=nonexistent"], "model=nonexistent: no such option; model takes one of: dlrm, "),
    (["--cfg", "job", "model=nonexistent"], "model=nonexistent: no such option; model takes one of: dlrm, "),
    (["trainer.steps=["], "trainer.steps=[: no viable alternative at input '['"),
    (["trainer.run_dir=${nope}"], "trainer.run_dir: Interpolation key 'nope' not found"),
    (["trainer.stepz=3"], "trainer.stepz: Key 'stepz' not in 'TrainerConfig'"),
    (["+trainer.stepz=3"], "unknown config key: trainer.stepz (did you mean trainer.steps?)"),
    (["trainer.steps=???"], "trainer.steps: a value is required; set it on the command line"),
]


@pytest.mark.parametrize(("argv", "line"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_refused_command_line_is_one_line_exit_2_before_the_run_folder(argv, line, tmp_path, capfd):
    run_dir = tmp_path / "run"
    root = logging.getLogger()
    before = root.handlers[:], root.level
    with pytest.raises(SystemExit) as stop:
        _hydra.launch("anyrec-plan", plan.main, [*argv, f"hydra.run.dir={run_dir}"])
    assert stop.value.code == 2
    out, err = capfd.readouterr()
    [said] = err.strip().splitlines()
    assert said.startswith(f"anyrec-plan: error: {line}") and "_schema" not in said, said
    assert out == "" and not run_dir.exists()
    assert (root.handlers, root.level) == before  # Hydra's own logging set-up undone
    assert "HYDRA_FULL_ERROR" not in os.environ


def test_a_sweep_into_an_unwritable_folder_is_one_line_exit_2(tmp_path, capfd):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stop:
        _hydra.launch("anyrec-plan", plan.main, ["-m", f"hydra.sweep.dir={tmp_path}/file/sweep",
                                                 "topology.world_size=1,2"])
    assert stop.value.code == 2
    [said] = capfd.readouterr().err.strip().splitlines()
    assert said.startswith("anyrec-plan: error: hydra.sweep.dir: Hydra's output folder"), said


def test_hydra_full_error_set_by_the_user_gives_hydras_own_exception(monkeypatch, tmp_path):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(MissingConfigException):
        _hydra.launch("anyrec-plan", plan.main, ["model=nonexistent", f"hydra.run.dir={tmp_path}/run"])
    assert os.environ["HYDRA_FULL_ERROR"] == "1"


def test_the_jobs_own_error_is_raised_as_it_is(tmp_path):
    """Even a Hydra exception, once the job has started, is the job's (a bug, with its traceback), and the
    job runs without the HYDRA_FULL_ERROR the runner is given (its children are entry points too)."""
    seen = {}

    def task(cfg):
        seen["env"], seen["steps"] = os.environ.get("HYDRA_FULL_ERROR"), cfg.trainer.steps
        raise ConfigCompositionException("a bug in the job")

    with pytest.raises(ConfigCompositionException, match="a bug in the job"):
        _hydra.launch("anyrec-x", task, [f"hydra.run.dir={tmp_path}/run", "trainer.steps=5"])
    assert seen == {"env": None, "steps": 5}
    assert (tmp_path / "run" / "test_hydra_rank0.log").is_file()  # the job named after the task's module


def test_the_run_folder_is_hydras_under_its_runner_and_none_for_a_config_composed_by_hand():
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from anyrec.config import config_dir

    _hydra.setup()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    run = copy.deepcopy(cfg)
    with open_dict(run):
        run.hydra.runtime.output_dir = "/runs/a"  # what the runner sets
    saved = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(cfg)  # what composing leaves: the folder unset
        assert _hydra.run_folder() is None
        HydraConfig.instance().set_config(run)
        assert _hydra.run_folder() == "/runs/a"
    finally:
        HydraConfig.instance().cfg = saved


JOB_REFUSED = [  # (entry point, arguments, what its one line names): refused by the job once it starts
    ("predict", ["predict.artifact={tmp}/bad.pt2"], "not a torch.export archive"),
    ("export", ["export.checkpoint={tmp}", "export.output={tmp}/x.pt2"], "no checkpoint"),
    ("export", ["export.precision=int4"], "export.precision"),
]


@pytest.mark.parametrize(("name", "args", "why"), JOB_REFUSED, ids=[f"{n} {a[0]}" for n, a, _ in JOB_REFUSED])
def test_export_and_predict_refuse_bad_input_in_one_line_exit_2(name, args, why, tmp_path, capfd):
    """As the console entry runs them (`cli`: Hydra's runner), nothing written where the export would go."""
    (tmp_path / "bad.pt2").write_text("not an archive")
    module = importlib.import_module(f"anyrec.{name}")
    with pytest.raises(SystemExit) as stop:
        _hydra.launch(f"anyrec-{name}", module.main,
                      [*(a.format(tmp=tmp_path) for a in args), f"hydra.run.dir={tmp_path}/run"])
    assert stop.value.code == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith(f"anyrec-{name}: error: ") and why in lines[-1], lines[-5:]
    assert not (tmp_path / "x.pt2").exists()
