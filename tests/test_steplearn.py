"""Each run's measured step corrects the next run's prediction of the same workload on the same machine
(anyrec.history.steplearn): one ratio per run, the median of the last few shrunk toward the model's
own figure by n / (n + 1), under a lock."""

from __future__ import annotations

import multiprocessing
import shutil
from pathlib import Path

import pytest

from anyrec.backends import resolve_hardware
from anyrec.config import Precision
from anyrec.history import steplearn

from .conftest import compose_config, last_json_line, torchrun

CAL = Path(__file__).parent / "data" / "calibration_cpu_2rank.yaml"
FP32 = Precision.fp32


def test_the_next_run_predicts_with_the_median_ratio_of_the_last_runs_shrunk(tmp_path):
    store = steplearn.ObservedSteps(tmp_path)
    assert store.correction("k/busy") == steplearn.Correction(1.0, 0)  # nothing learnt yet
    store.record("k/busy", measured_s=0.0144, model_s=0.0100)
    # One run moves the prediction half way (geometrically): sqrt(1.44) = 1.2.
    assert store.correction("k/busy").factor == pytest.approx(1.2) and store.correction("k/busy").runs == 1
    store.record("k/busy", measured_s=0.81, model_s=1.0)  # below the model: median 1.125
    assert store.correction("k/busy").factor == pytest.approx(((1.44 + 0.81) / 2) ** (2 / 3))
    for ratio in (1.2, 5.0, 1.3, 1.25, 1.35):  # one disturbed run (5x) does not swing the median
        store.record("k/busy", measured_s=ratio, model_s=1.0)
    c = store.correction("k/busy")
    assert c.runs == steplearn.KEEP and c.factor == pytest.approx(1.3 ** (5 / 6))
    assert store.correction("k/quiet").runs == 0  # another load: its own ratios


def test_a_damaged_file_is_ignored_and_replaced(tmp_path):
    store = steplearn.ObservedSteps(tmp_path)
    store.path.write_text('{"k/busy": [{"ratio": "NaN"}]')
    assert store.correction("k/busy").runs == 0
    store.record("k/busy", 4.0, 1.0)
    assert store.correction("k/busy").factor == pytest.approx(2.0)


def test_only_runs_planned_with_a_calibrated_file_learn(tmp_path):
    shutil.copy(CAL, tmp_path / "cal.yaml")
    cfg = compose_config([f"hardware.sku={tmp_path / 'cal.yaml'}"])[1]
    hw = resolve_hardware(cfg.hardware.sku)
    key = steplearn.run_key(cfg, hw, 256, "fbgemm", FP32, 2, 2, other_cores=1.4)
    quiet = steplearn.run_key(cfg, hw, 256, "fbgemm", FP32, 2, 2, 0.1)
    assert key.endswith("/busy") and quiet.endswith("/quiet")
    assert steplearn.run_key(cfg, hw, 512, "fbgemm", FP32, 2, 2, 1.4) != key  # another workload shape
    assert steplearn.run_key(cfg, hw, 256, "fbgemm", FP32, 4, 4, 1.4) != key  # another world size
    assert steplearn.run_key(cfg, hw, 256, "fbgemm", Precision.bf16, 2, 2, 1.4) != key  # another precision
    assert steplearn.run_key(cfg, hw, 256, "fbgemm", FP32, 2, 2, 1.4, sharding_group_size=2) == key  # 1D
    assert steplearn.run_key(cfg, hw, 256, "fbgemm", FP32, 2, 2, 1.4, sharding_group_size=1) != key  # 2D
    datasheet = compose_config(["hardware.sku=cpu"])[1]
    assert steplearn.run_key(datasheet, resolve_hardware("cpu"), 256, "fbgemm", FP32, 2, 2, 1.4) is None
    # A hardware=auto job handed the same calibrated file (first contact) learns under the same key: the
    # key follows the hardware the job planned with, not the config's `hardware.sku`.
    auto = compose_config(["hardware.sku=auto"])[1]
    assert steplearn.run_key(auto, hw, 256, "fbgemm", FP32, 2, 2, 1.4) == key


def _record_many(directory: str, writer: int) -> None:
    store = steplearn.ObservedSteps(Path(directory))
    for i in range(25):
        store.record(f"w{writer}-{i}/quiet", 1.0 + writer, 1.0)


@pytest.mark.integration
def test_concurrent_jobs_lose_no_observation(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(str(tmp_path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    data = steplearn.ObservedSteps(tmp_path)._read()
    assert len(data) == 75  # every writer's every record: the lock serialises read-modify-write


@pytest.mark.integration
@pytest.mark.cpu_only  # two ranks on one host
def test_a_second_run_predicts_what_the_first_measured(tmp_path):
    cal = tmp_path / "cal.yaml"
    shutil.copy(CAL, cal)
    env = {"ANYREC_CACHE_DIR": str(tmp_path / "cache")}
    args = ["-m", "anyrec.train", "model=dlrm_tiny", f"hardware.sku={cal}", "trainer.steps=40",
            "trainer.eval_steps=0", "trainer.progress=false", "trainer.tensorboard=false"]
    runs = []
    for name in ("a", "b"):
        proc = torchrun([*args, f"hydra.run.dir={tmp_path / name}"], env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((last_json_line(proc.stdout), proc.stdout + proc.stderr))
        if name == "a":
            # The first run recorded one ratio under its workload and the host's load at its start. The
            # second run's load class is sampled again (a test beside this one may start between them),
            # so the ratio is copied to every load class of that workload: the second run reads it
            # whatever its own class.
            store = steplearn.ObservedSteps(tmp_path / "cache")
            (key, observed), = store._read().items()
            digest = key.rsplit("/", 1)[0]
            for load in ("quiet", "busy", "unknown"):
                if f"{digest}/{load}" != key:
                    store.record(f"{digest}/{load}", observed[0]["measured_ms"], observed[0]["model_ms"])
    (first, _), (second, log) = runs
    assert first["step_correction_runs"] == 0 and first["predicted_step_ms"] == first["model_step_ms"]
    # The second run's prediction is the model's times the first run's measured / model ratio, one run
    # weighted 1/2 against the model (geometrically).
    ratio = first["measured_step_ms"] / first["model_step_ms"]
    assert second["step_correction_runs"] == 1 and second["step_correction"] == pytest.approx(ratio ** 0.5)
    assert second["predicted_step_ms"] == pytest.approx(second["model_step_ms"] * ratio ** 0.5)
    assert "earlier run(s) of this workload on this machine" in log
