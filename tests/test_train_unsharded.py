"""One device with anyrec's own TBE (`backend.embedding_kernel=torch|triton`): the tables stay
unsharded, no FBGEMM op runs in a training step, and checkpoints resume exactly."""

from __future__ import annotations

import pytest
import torch

from anyrec.kernels.ebc import TritonEmbeddingBagCollection

from .conftest import OpRecorder, compose_config, last_json_line

TINY = ["model=dlrm_tiny", "trainer.progress=false", "trainer.tensorboard=false", "data.batch_size=64"]


def test_single_device_torch_kernel_trains_without_fbgemm_ops(tmp_path, monkeypatch):
    from anyrec.trainer.trainer import Trainer

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    # The Trainer sets these for its group of one; set-then-delete makes monkeypatch remove them after.
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    _, cfg = compose_config([*TINY, "backend.embedding_kernel=torch", "trainer.steps=40",
                             "trainer.eval_steps=2",
                             f"trainer.run_dir={tmp_path}", "trainer.validate_inputs=false"])
    trainer = Trainer(cfg)
    try:
        assert trainer.unsharded and trainer.planned is None
        assert isinstance(trainer.model.model.sparse_arch, TritonEmbeddingBagCollection)
        batches = [trainer.train_data.batch(i) for i in range(3)]
        before = trainer.model.model.sparse_arch.embedding_bags["t_cat_0"].weight.detach().clone()
        losses = []
        with OpRecorder() as rec:
            for b in batches:
                trainer.run_steps(1, iter([b]))
                losses.append(float(trainer.last_loss))
        fbgemm = sorted({op for op in rec.ops if op.startswith("fbgemm")})
        assert not fbgemm, fbgemm
        assert "aten.index_add_.default" in rec.ops  # the fused embedding update ran under the recorder
        after = trainer.model.model.sparse_arch.embedding_bags["t_cat_0"].weight
        assert not torch.equal(before, after)  # rows moved in backward, with no optimizer step of theirs
        assert all(torch.isfinite(torch.tensor(losses)))
        # The learning-rate schedule reaches the fused kernel through the KeyedOptimizer.
        trainer.optimizers.set_lr(trainer.schedule.factor(0))
        trainer.fused_optimizer.step()
        assert trainer.model.model.sparse_arch.optimizer.lr == cfg.optim.embedding_lr
        summary = trainer.train()
        assert summary["embedding_kernel"] == "torch" and summary["world_size"] == 1
        assert summary["train_loss"] < 0.69 and summary["eval_auc"] > 0.6
    finally:
        trainer.close()


@pytest.mark.integration  # three runs
def test_single_device_resume_is_exact(tmp_path, train_here):
    """16 steps straight, and 8 resumed to 16 by a second run, end bit-identical: each run of
    `python -m anyrec.train` run in this process, after the one before (what a run leaves in the process
    must not reach the next)."""
    base = [*TINY, "backend.embedding_kernel=torch", "trainer.eval_steps=2",
            "trainer.fingerprint_weights=true", f"hydra.run.dir={tmp_path}/h", "optim=adam"]
    a = train_here([*base, "trainer.steps=16"], tmp_path)
    b = train_here([*base, "trainer.steps=8", f"trainer.checkpoint.dir={tmp_path}/ck"], tmp_path)
    c = train_here([*base, "trainer.steps=16", f"trainer.checkpoint.dir={tmp_path}/ck"], tmp_path)
    for p in (a, b, c):
        assert p.returncode == 0, p.stderr[-3000:]
    sa, sc = last_json_line(a.stdout), last_json_line(c.stdout)
    assert sc["resumed_from_step"] == 8 and sc["steps"] == 16
    assert sc["final_loss"] == sa["final_loss"]
    assert sc["weights_sha256"] == sa["weights_sha256"]
