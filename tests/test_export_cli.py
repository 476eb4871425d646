"""anyrec-export and anyrec-predict as users run them (the console entries' runner; the one-process
commands in the test's process, the two-rank training under torchrun): train with a checkpoint, export,
score the eval rows (the trainer's eval AUC), load the artifact where only torch imports, and export a
two-rank row-wise checkpoint (the same scores as a one-rank one)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from anyrec.config import IdLayout
from anyrec.models.dlrm_scoring import batch_inputs
from anyrec.models.family import resolve_family
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.serving.artifact import load_artifact
from anyrec.trainer.inputs import build_inputs
from tests.conftest import TORCH_ONLY_HEAD, compose_config, last_json_line, torchrun

pytestmark = pytest.mark.integration

TRAIN = ["model=dlrm_tiny", "trainer.steps=50", "trainer.progress=false", "trainer.tensorboard=false"]

# Run where anyrec, torchrec and fbgemm cannot be imported: the artifact must need torch alone.
TORCH_ONLY = TORCH_ONLY_HEAD + textwrap.dedent("""
    artifact, inputs, out = sys.argv[1:]
    from torch.export.graph_signature import InputKind
    files = {"manifest.json": ""}
    exported = torch.export.load(artifact, extra_files=files)
    program = exported.module()
    assert "anyrec-scoring" in files["manifest.json"]
    batches = torch.load(inputs, weights_only=True)
    probs = [torch.sigmoid(program(dense, ids, bags)) for dense, ids, bags in batches]
    torch.save(torch.cat(probs), out)
    # the graph called directly, as docs/export.md shows it: the same scores
    state = {**exported.state_dict, **exported.constants}
    specs = exported.graph_signature.input_specs
    weights = [state[s.target] for s in specs if s.kind != InputKind.USER_INPUT]
    for (dense, ids, bags), p in zip(batches, probs):
        (logits,) = exported.graph_module(*weights, dense, *ids, *bags)
        assert torch.equal(torch.sigmoid(logits), p)
    assert not any(m.split(".")[0] in ("anyrec", "torchrec") for m in sys.modules)
""")


def _ok(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json_line(proc.stdout)


def _eval_inputs(overrides: list[str], steps: int) -> list:
    """The eval rows a one-rank run reads, as the artifact's plain tensors."""
    _, cfg = compose_config(overrides)
    source = build_inputs(cfg, resolve_family(cfg.model), ONE_PROCESS, torch.device("cpu"), None).eval
    return [batch_inputs(b, IdLayout.offsets, torch.device("cpu")).args() for b in source.iter_from(0, steps)]


def test_export_then_predict_gives_the_trainers_eval_and_loads_with_torch_only(tmp_path, run_here):
    trained = _ok(run_here("train", [*TRAIN, f"trainer.checkpoint.dir={tmp_path}/ckpt"], tmp_path))
    artifact, scores = tmp_path / "tiny.pt2", tmp_path / "scores.npy"
    exported = _ok(run_here("export", ["model=dlrm_tiny", f"export.checkpoint={tmp_path}/ckpt",
                                          f"export.output={artifact}"], tmp_path))
    assert exported["checkpoint"]["step"] == 50 and exported["precision"] == "fp32"
    predicted = _ok(run_here("predict", [f"predict.artifact={artifact}", "predict.split=eval",
                                            "predict.steps=20", f"predict.output={scores}"], tmp_path))
    assert predicted["samples"] == 20 * 256 and predicted["steps"] == 20 and predicted["samples_per_s"] > 0
    assert abs(predicted["auc"] - trained["eval_auc"]) <= 1e-6
    for key in ("ne", "logloss", "accuracy"):
        assert abs(predicted[key] - trained[f"eval_{key}"]) <= 1e-6, key
    probs = np.load(scores)
    assert probs.shape == (20 * 256,) and probs.dtype == np.float32

    inputs, out = tmp_path / "inputs.pt", tmp_path / "torch_only.pt"
    torch.save(_eval_inputs(["model=dlrm_tiny"], 20), inputs)
    script = tmp_path / "score.py"
    script.write_text(TORCH_ONLY)
    proc = subprocess.run([sys.executable, str(script), str(artifact), str(inputs), str(out)], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(torch.load(out, weights_only=True).numpy(), probs, rtol=0, atol=1e-6)


def test_a_two_rank_row_wise_checkpoint_exports_as_a_one_rank_one(tmp_path, run_here):
    same = [*TRAIN, "data.global_batch_size=512"]
    two = torchrun(["-m", "anyrec.train", *same, "planner.sharding=row_wise",
                    f"trainer.checkpoint.dir={tmp_path}/two",
                    f"hydra.run.dir={tmp_path}/run2"], nproc=2, timeout=400, cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    two_eval = last_json_line(two.stdout)["eval_auc"]
    _ok(run_here("train", [*same, f"trainer.checkpoint.dir={tmp_path}/one"], tmp_path))
    probs = {}
    for name in ("two", "one"):
        out = tmp_path / f"{name}.pt2"
        _ok(run_here("export", ["model=dlrm_tiny", f"export.checkpoint={tmp_path}/{name}",
                                   f"export.output={out}"], tmp_path))
        program = load_artifact(out).program
        with torch.no_grad():
            probs[name] = torch.cat([program(*args) for args in _eval_inputs(["model=dlrm_tiny"], 4)])
    assert probs["one"].std() > 0.1
    torch.testing.assert_close(probs["two"], probs["one"], rtol=0, atol=1e-5)
    # the rows the two ranks evaluated on: the two-rank run's eval AUC
    predicted = _ok(run_here("predict", [f"predict.artifact={tmp_path}/two.pt2", "predict.world_size=2",
                                            "data.global_batch_size=512", "trainer.progress=false"],
                         tmp_path))
    assert abs(predicted["auc"] - two_eval) <= 1e-6
