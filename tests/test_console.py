"""The console policy (anyrec/console.py, configs/hydra/job_logging/anyrec.yaml): anyrec's INFO and
everyone's warnings on the console, each once; libraries' INFO and anyrec's detail in the log file; the
default job's whole console within a screenful; --help lists the real options only."""

from __future__ import annotations

import ast
import io
import logging
import sys
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import configure_log
from omegaconf import open_dict

from anyrec import _hydra, console
from anyrec.config import config_dir

from .conftest import ROOT, default_job


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_the_console_passes_our_info_and_everyones_warnings_once(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    f = console.ConsoleFilter()
    assert f.filter(_record("anyrec.trainer", logging.INFO, "step loop"))
    assert not f.filter(_record("anyrec.trainer", logging.DEBUG, "sharding plan"))
    assert not f.filter(_record("root", logging.INFO, "SplitTableBatchedEmbeddingBagsCodegen Arguments"))
    assert not f.filter(_record("torchrec.distributed", logging.INFO, "building"))
    assert not f.filter(_record("anyrecx", logging.INFO, "not ours"))
    assert f.filter(_record("torchrec.distributed.utils", logging.WARNING, "caching params ignored"))
    assert not f.filter(_record("torchrec.distributed.utils", logging.WARNING, "caching params ignored"))
    assert f.filter(_record("torchrec.distributed.utils", logging.WARNING, "another"))


def test_other_ranks_show_their_own_warnings_and_everyones_errors(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    f = console.ConsoleFilter()
    assert not f.filter(_record("anyrec.trainer", logging.INFO, "step loop"))
    assert f.filter(_record("anyrec.data", logging.WARNING, "bad rows"))
    # a library warns alike on every rank: rank 0 shows it, this rank's log file keeps it
    assert not f.filter(_record("torchrec.distributed.utils", logging.WARNING, "caching params ignored"))
    assert not f.filter(_record("py.warnings", logging.WARNING, "FutureWarning: broadcast_buffers"))
    assert f.filter(_record("torch.distributed", logging.ERROR, "connection lost"))


def test_torch_log_records_follow_the_policy():
    """torch prints its log records through a stderr handler of its own (`[rank1]:W1205 ...`), past the
    console filter and the log file: capture_warnings hands them to the root logger."""
    lib = logging.getLogger("torch")
    saved = lib.handlers[:], lib.propagate
    try:
        lib.handlers[:] = [logging.StreamHandler(io.StringIO())]
        lib.propagate = False
        console.capture_warnings()
        assert lib.handlers == [] and lib.propagate
    finally:
        lib.handlers[:], lib.propagate = saved
        logging.captureWarnings(False)


@pytest.fixture
def job_logging(tmp_path, monkeypatch):
    """The job's logging configured as a run configures it: (its console, its log file), restored after."""
    monkeypatch.delenv("RANK", raising=False)
    root, ours = logging.getLogger(), logging.getLogger("anyrec")
    saved = root.handlers[:], root.level, ours.level, warnings.formatwarning
    _hydra.setup()
    with initialize_config_dir(str(config_dir()), job_name="train", version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    with open_dict(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = str(tmp_path)
    configure_log(cfg.hydra.job_logging)
    console.capture_warnings()
    screen = io.StringIO()
    [shown] = [h for h in root.handlers if any(isinstance(f, console.ConsoleFilter) for f in h.filters)]
    shown.setStream(screen)
    try:
        yield screen, tmp_path / "train_rank0.log"
    finally:
        logging.captureWarnings(False)
        for h in root.handlers:
            h.close()
        root.handlers[:], _, _, warnings.formatwarning = saved
        root.setLevel(saved[1])
        ours.setLevel(saved[2])


def test_libraries_info_goes_to_the_log_file_only(job_logging):
    screen, log_file = job_logging
    logging.getLogger("anyrec.trainer").info("backend: cpu")
    logging.getLogger("anyrec.trainer").debug("torchrec sharding plan: a table")
    logging.getLogger().info("[TBE=1] SplitTableBatchedEmbeddingBagsCodegen Arguments: {...}")
    logging.getLogger("torchrec.distributed.utils").warning("caching params will be ignored")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for _ in range(2):
            warnings.warn("`broadcast_buffers` is deprecated", FutureWarning, stacklevel=1)
    shown = screen.getvalue().splitlines()
    assert [ln.split(" - ", 1)[1] for ln in shown[:2]] == ["backend: cpu", "caching params will be ignored"]
    assert len(shown) == 3 and "FutureWarning: `broadcast_buffers` is deprecated" in shown[2]  # one line
    log = log_file.read_text()
    assert "torchrec sharding plan" in log and "SplitTableBatchedEmbeddingBagsCodegen" in log
    assert log.count("FutureWarning") == 2


def test_a_nested_job_logs_its_info_to_the_file_only(job_logging):
    """A job inside another (log_file_only) keeps its INFO off the console, not out of the log file; its
    warnings show; outside the block, INFO shows again."""
    screen, log_file = job_logging
    trainer = logging.getLogger("anyrec.trainer.trainer")
    with console.log_file_only():
        trainer.info("backend: cpu (a calibration point)")
        trainer.warning("a setting ignored")
        logging.getLogger("torchrec.distributed").warning("a library warning")
    trainer.info("backend: cpu (the job)")
    shown = [ln.split(" - ", 1)[1] for ln in screen.getvalue().splitlines()]
    assert shown == ["a setting ignored", "a library warning", "backend: cpu (the job)"]
    assert "backend: cpu (a calibration point)" in log_file.read_text()


def logging_problems(root: Path) -> dict[str, list[str]]:
    """Per module under `root`/anyrec: each anyrec logger it takes under another name than its own (a
    module's `logger` is `logging.getLogger(__name__)`; one run as `python -m`, whose `__name__` is
    `__main__` there, may spell its own name out), and each place it changes a logger's level or switches
    logging off."""
    found: dict[str, list[str]] = {}
    for path in sorted((root / "anyrec").rglob("*.py")):
        rel = path.relative_to(root)
        own = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        text = path.read_text()
        ok = {"__name__"} | ({repr(own)} if 'if __name__ == "__main__":' in text else set())
        problems = []
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and node.args
                    and ast.unparse(node.func) == "logging.getLogger"):
                continue
            arg = node.args[0]
            ours = isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] == "anyrec"
            if ours and ast.unparse(arg) not in ok:
                problems.append(f"{rel}:{node.lineno}: logger {ast.unparse(arg)}")
        for node in ast.parse(text).body:  # the module's own logger
            if (isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "logger"
                    and ast.unparse(node.value) not in {f"logging.getLogger({n})" for n in ok}):
                problems.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        for i, line in enumerate(text.splitlines(), 1):
            if (".setLevel(" in line or "logging.disable(" in line) and \
                    (str(rel), line.strip()) not in RESTORED_LEVELS:
                problems.append(f"{rel}:{i}: {line.strip()}")
        if problems:
            found[str(rel)] = sorted(set(problems))
    return found


# Level calls that put back a level another library set, not changes to keep quiet: a command line
# Hydra refused leaves the root logger as it found it (anyrec._hydra.launch, for in-process callers).
RESTORED_LEVELS = {("anyrec/_hydra.py", "root.setLevel(level)")}


def test_every_module_logs_under_its_own_name_and_changes_no_level():
    assert logging_problems(ROOT) == {}


def test_the_logging_check_finds_borrowed_names_and_level_changes(tmp_path):
    pkg = tmp_path / "anyrec" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "ok.py").write_text("import logging\nlogger = logging.getLogger(__name__)\n"
                               'logging.getLogger("torch").handlers.clear()\n')
    (pkg / "main.py").write_text('import logging\nlogger = logging.getLogger("anyrec.sub.main")\n'
                                 'if __name__ == "__main__":\n    pass\n')
    (pkg / "borrow.py").write_text('import logging\nlogger = logging.getLogger("anyrec.other")\n')
    (pkg / "quiet.py").write_text('import logging\nlogging.getLogger("lib").setLevel(logging.WARNING)\n'
                                  'def f():\n    logging.getLogger("anyrec.trainer").info("x")\n')
    assert logging_problems(tmp_path) == {
        "anyrec/sub/borrow.py": ["anyrec/sub/borrow.py:2: logger 'anyrec.other'",
                                 "anyrec/sub/borrow.py:2: logger = logging.getLogger('anyrec.other')"],
        "anyrec/sub/quiet.py": ['anyrec/sub/quiet.py:2: logging.getLogger("lib").setLevel(logging.WARNING)',
                                "anyrec/sub/quiet.py:4: logger 'anyrec.trainer'"]}


class Recorder:
    """A `hydra.callbacks` entry that notes the events it sees."""

    events: list[str] = []

    def on_run_start(self, config, **kwargs) -> None:
        Recorder.events.append("run_start")

    def on_job_start(self, config, **kwargs) -> None:
        Recorder.events.append("job_start")

    def on_job_end(self, config, job_return, **kwargs) -> None:
        Recorder.events.append("job_end")

    def on_run_end(self, config, **kwargs) -> None:
        Recorder.events.append("run_end")


def test_a_command_line_runs_as_hydra_main_runs_it(tmp_path, monkeypatch, job_logging):
    """The run path (composed once, then Hydra's run_job): the run folder and its .hydra/, the rank's
    log file, the job's config and Hydra's runtime for the task, the configured callbacks around it."""
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    seen = {}

    def task(cfg):
        seen["steps"], seen["dir"] = cfg.trainer.steps, HydraConfig.get().runtime.output_dir
        logging.getLogger("anyrec.x").info("the task ran")

    Recorder.events = []
    _hydra.launch("anyrec-x", task, [f"hydra.run.dir={tmp_path}/run", "trainer.steps=7",
                                     f"+hydra.callbacks.rec._target_={__name__}.Recorder"])
    run = tmp_path / "run"
    assert seen == {"steps": 7, "dir": str(run)}
    assert (run / ".hydra" / "config.yaml").is_file()
    assert "trainer.steps=7" in (run / ".hydra" / "overrides.yaml").read_text()
    assert "the task ran" in (run / "test_console_rank0.log").read_text()
    assert Recorder.events == ["run_start", "job_start", "job_end", "run_end"]


def test_help_lists_the_real_options_only(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["anyrec.calibrate"])
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # the entry point's, for the job
    from anyrec.calibrate import cli

    with pytest.raises(SystemExit) as stop:
        cli(["--help"])
    logging.captureWarnings(False)
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "model: dlrm, dlrm_small, dlrm_tiny, dlrmv2, dlrmv2_small" in text
    assert "backend: auto, cpu, cuda, rocm" in text and "_schema" not in text


def test_no_entry_point_leans_on_hydras_internals():
    users = [p for p in (ROOT / "anyrec").rglob("*.py") if "hydra._internal" in p.read_text()]
    assert users == []


@pytest.mark.integration
def test_the_default_job_fits_a_screen_cold_and_warm(cold_default_job, tmp_path):
    """Cold: the run's one cold calibration (the `cold_default_job` fixture), whose console has the
    calibration's lines too; warm: the same job again on a copy of the cache it filled."""
    warm = default_job(tmp_path, cold_default_job.calibrated_cache(tmp_path / "cache"))
    for name, limit, (code, out) in [("cold", 40, (cold_default_job.returncode, cold_default_job.console)),
                                     ("warm", 25, warm)]:
        assert code == 0, out[-3000:]
        lines = out.count("\n")
        assert 0 < lines <= limit, f"{name} cache: {lines} console lines\n{out}"
        assert out.rstrip().splitlines()[-1].startswith('{"steps": 300')
        assert "model_parallel.py" not in out  # our DDP wrapper's `broadcast_buffers` warning
        assert ("calibration: cache miss" in out) == (name == "cold")


def test_warnings_are_captured_even_after_a_block_undid_an_earlier_capture():
    """A warnings.catch_warnings() block that began before a capture restores the original showwarning on
    exit while logging still counts itself capturing: capture_warnings installs it again all the same."""
    original = warnings.showwarning
    try:
        with warnings.catch_warnings():
            logging.captureWarnings(True)
        assert warnings.showwarning is original  # undone, though logging still counts it on
        console.capture_warnings()
        assert warnings.showwarning is not original
    finally:
        logging.captureWarnings(False)
        warnings.showwarning = original
