"""DLRMv4's default CPU job, as the docs give it: `torchrun --standalone --nproc_per_node=2 -m anyrec.train
model=dlrmv4_small` (default backend, planner and calibration on first contact, a cache of its own) trains
on the synthetic stream, names the model and its attention implementation, predicts its step from its
kernels measured at its own shapes, and its last next-window evaluation reaches the generator's own
hidden-model AUC on that window (>= 0.70, within 0.03)."""

from __future__ import annotations

import pytest

from .conftest import last_json_line, torchrun

pytestmark = pytest.mark.integration

# |predicted / measured step - 1| of the default job with its HSTU kernels measured on first contact. On a
# busy 2-core host it ranged from 0.03 (a steady load of 10-14) to 0.43 (the load moved between the
# calibration and the steps); without them (the attention at an assumed efficiency) it was 0.28-0.44 under.
# The bound is held where the calibration was trusted (a quiet host), at twice the 15 % until a
# quiet host has measured the job.
PREDICTION_BOUND = 0.3
BUSY = "not cached as trusted"  # the calibration's line on a busy host


def test_dlrmv4_small_default_job_reaches_the_hidden_auc(tmp_path):
    env = {"ANYREC_CACHE_DIR": str(tmp_path / "cache"), "ANYREC_CALIBRATE": "auto"}
    proc = torchrun(["-m", "anyrec.train", "model=dlrmv4_small"], nproc=2, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert (summary["model"], summary["model_family"]) == ("dlrmv4_small", "dlrmv4")
    assert summary["attention_kernel"] in ("torch", "triton")
    console = proc.stdout + proc.stderr
    assert "HSTU kernels measured at this job's shapes" in console, console[-3000:]
    assert summary["prediction_error"] is not None
    print(f"dlrmv4_small: predicted {summary['predicted_step_ms']:.1f} ms, measured "
          f"{summary['measured_step_ms']:.1f} ms ({summary['prediction_error']:+.0%})")
    if BUSY not in console:
        assert abs(summary["prediction_error"]) <= PREDICTION_BOUND, (summary["predicted_step_ms"],
                                                                     summary["measured_step_ms"])
    evals = summary["window_eval"]
    assert [e["window"] for e in evals] == list(range(1, len(evals) + 1)) and len(evals) >= 2
    last = evals[-1]
    hidden = summary["hidden_auc_by_window"][str(last["window"])]
    print(f"dlrmv4_small: window {last['window']} AUC {last['auc']:.4f}, hidden-model AUC {hidden:.4f}, "
          f"{summary['steps']} steps, training {summary['elapsed_s']:.0f} s")  # shown under pytest -s
    assert last["auc"] == pytest.approx(summary["eval_auc"])
    assert last["auc"] >= 0.70, (last, hidden)
    assert abs(last["auc"] - hidden) <= 0.03, (last, hidden)
