"""benchmarks/gpu_suite.py at toy size on CPU (torch execution), with and without torchrec/fbgemm.

A GPU machine may have torch + triton only, so the suite must run its torch/triton sections with
torchrec and fbgemm_gpu unimportable and skip the torchrec section with a reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"


def _run(tmp_path: Path, args: list[str], block: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    prelude = "sys.modules['torchrec'] = None; sys.modules['fbgemm_gpu'] = None; " if block else ""
    code = (f"{prelude}import runpy; sys.argv = [{str(SUITE)!r}] + {args!r}; "
            f"runpy.run_path({str(SUITE)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", "import sys; " + code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    return proc, report


@pytest.mark.cpu_only  # expects "GPU: not run"
def test_gpu_suite_small_on_cpu(tmp_path):
    proc, rep = _run(tmp_path, ["--small", "--execution", "torch"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    s = rep["sections"]
    assert {k: v["status"] for k, v in s.items()} == {k: "ok" for k in
                                                      ("env", "correctness", "tbe", "interaction",
                                                       "attention", "dlrm_tbe", "dlrm_ebc",
                                                       "dlrm_sharded", "data", "parity", "loop",
                                                       "compile", "dlrmv4", "calibrate", "memory")}
    assert all(c["ok"] for k, c in s["correctness"].items() if isinstance(c, dict))
    assert s["dlrm_tbe"]["samples_per_s"] > 0 and s["dlrm_ebc"]["fbgemm_ops_called"] == []
    # The sharded world-size-1 path: its fbgemm:: calls (KJT permute, offsets) all on portable kernels.
    assert s["dlrm_sharded"]["served_by_portable"] and s["dlrm_sharded"]["samples_per_s"] > 0
    assert "fbgemm::permute_2D_sparse_data" in s["dlrm_sharded"]["fbgemm_ops_called"]
    assert (tmp_path / "tbe.json").exists() and "GPU: not run" in proc.stdout
    assert {r["contender"] for r in s["interaction"]["rows"]} == {"torch gather", "anyrec torch"}
    assert (tmp_path / "interaction.json").exists()
    rows = s["attention"]["rows"]
    assert {(r["contender"], r["mode"]) for r in rows} == {("torch", "fwd"), ("torch", "fwd+bwd")}
    assert all(r["tflop_per_s"] > 0 and r["tokens"] > 0 for r in rows)
    assert "not run" in s["attention"]["triton"]
    assert json.loads((tmp_path / "hstu_attention.json").read_text())["rows"]
    # Issue checks a GPU run answers: device-made synthetic batches, CPU-vs-device parity, calibration.
    assert s["data"]["identical_to_cpu"] and s["data"]["samples_per_s"] > 0
    # One optimizer at --small; CPU against CPU: the same bits.
    (opt, row), = ((k, v) for k, v in s["parity"].items() if isinstance(v, dict))
    assert row["exit"] == 0 and row["loss_rel"] == 0.0 and row["weight_abs"] == 0.0, row
    assert len(json.loads((tmp_path / f"parity_{opt}.json").read_text())["runs"]) == 2
    assert "measured_fields" in (tmp_path / "calibration.yaml").read_text()
    assert s["loop"]["embedding_kernel"] == "torch" and s["loop"]["loop_vs_step"] > 0
    # the trainer's step eager and with the dense model compiled by inductor (a C++ compile on a CPU)
    c = s["compile"]
    assert not c["eager"]["compiled"] and c["compiled"]["compiled"], c
    assert c["eager"]["samples_per_s"] > 0 and c["compiled"]["samples_per_s"] > 0
    # the same first batches, compiled or not: the same losses up to the parity tolerance
    assert len(c["eager"]["first_losses"]) == 3
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(c["eager"]["first_losses"],
                                                           c["compiled"]["first_losses"], strict=True))
    # DLRMv4's step through the trainer (dlrmv4_small at --small): the sequence tables on the torch TBE
    v4 = s["dlrmv4"]
    assert v4["model"] == "dlrmv4_small" and v4["embedding_kernel"] == "torch" and v4["samples_per_s"] > 0
    assert v4["attention_kernel"] and v4["predicted_step_ms"] > 0 and v4["final_loss"] > 0
    # The trainer's memory check: predicted per term; the CPU measures no device memory (null)
    assert s["memory"]["predicted_peak_memory_bytes_per_rank"][0] > 0
    assert s["memory"]["predicted_memory_terms"]["embedding_weights_bytes"] > 0
    assert s["memory"]["measured_peak_memory_bytes_per_rank"] == [None]
    m = s["memory"]
    assert m["memory_prediction_error"] is None and m["measured_peak_reserved_bytes"] is None
    assert json.loads((tmp_path / "train_step.json").read_text())["samples_per_s"]["anyrec loop"] > 0


def test_gpu_suite_without_torchrec_or_fbgemm(tmp_path):
    only = ("correctness,interaction,attention,dlrm_tbe,dlrm_ebc,dlrm_sharded,data,parity,loop,compile,"
            "dlrmv4,calibrate,memory")
    proc, rep = _run(tmp_path, ["--small", "--only", only], block=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    s = rep["sections"]
    assert s["correctness"]["status"] == "ok" and s["dlrm_tbe"]["status"] == "ok"
    assert s["interaction"]["status"] == s["attention"]["status"] == "ok"  # torch + triton only
    for name in ("dlrm_ebc", "dlrm_sharded", "data", "parity", "loop", "compile", "dlrmv4", "calibrate",
                 "memory"):
        assert s[name]["status"] == "skipped" and "torchrec does not import" in s[name]["skipped"]
    assert "does not import" in s["env"]["torchrec"]
    assert "dlrm_ebc: SKIPPED" in proc.stdout
