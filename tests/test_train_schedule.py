"""The fused (TBE) embedding optimizer follows learning-rate changes made at run time."""

from __future__ import annotations

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from anyrec.trainer.optim import WarmupPolyDecay

from .conftest import compose_config, free_port


def _tables(trainer):
    out = {}
    for k, v in trainer.model.state_dict().items():
        if "sparse_arch" in k and isinstance(v, ShardedTensor):
            out[k] = torch.cat([s.tensor.flatten() for s in v.local_shards()]).clone()
    assert out
    return out


def test_fused_embedding_lr_changes_at_run_time(monkeypatch):
    from anyrec.trainer.trainer import Trainer

    # A process group of one inside pytest; monkeypatch restores the environment afterwards.
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(var, value)
    _, cfg = compose_config(["model=dlrm_tiny", "backend=cpu", "trainer.progress=false",
                             "trainer.eval_steps=0", "trainer.tensorboard=false", "data.batch_size=32"])
    trainer = Trainer(cfg)
    try:
        # Full rate at step 0, zero from step 1 on (a decay over one step to 0).
        trainer.schedule = WarmupPolyDecay(decay_start_step=0, decay_steps=1, end_lr_factor=0.0)
        w0 = _tables(trainer)
        batches = trainer.train_data.iter_from(0, 3)
        trainer.run_steps(1, batches)
        w1 = _tables(trainer)
        assert all(not torch.equal(w0[k], w1[k]) for k in w0)  # lr 0.05: rows moved
        trainer.run_steps(1, batches)
        assert trainer.model.fused_optimizer.param_groups[0]["lr"] == 0.0
        w2 = _tables(trainer)
        assert all(torch.equal(w1[k], w2[k]) for k in w1)  # lr 0: TBE took the new rate
        trainer.schedule = WarmupPolyDecay()  # back to constant 1.0
        trainer.run_steps(1, batches)
        w3 = _tables(trainer)
        assert any(not torch.equal(w2[k], w3[k]) for k in w2)
    finally:
        trainer.close()
