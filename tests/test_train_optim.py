"""The embedding optimizer settings reach every embedding kernel the same way."""

from __future__ import annotations

import pytest
import torch

from .conftest import compose_config

LR, WD = 0.5, 0.1


def _one_step(kernel: str, weight_decay: float, tmp_path) -> tuple[torch.Tensor, torch.Tensor]:
    """t_cat_0's weights before and after one SGD step."""
    from anyrec.trainer.trainer import Trainer

    _, cfg = compose_config(["model=dlrm_tiny", "trainer.progress=false", "trainer.tensorboard=false",
                             "trainer.steps=1", "trainer.eval_steps=0", "data.batch_size=32", "optim=sgd",
                             f"optim.embedding_lr={LR}", f"optim.weight_decay={weight_decay}",
                             f"backend.embedding_kernel={kernel}", f"trainer.run_dir={tmp_path}"])
    trainer = Trainer(cfg)

    def table() -> torch.Tensor:
        w = trainer.model.state_dict()["model.sparse_arch.embedding_bags.t_cat_0.weight"]
        w = w.local_shards()[0].tensor if hasattr(w, "local_shards") else w
        return w.detach().clone().float()

    try:
        before = table()
        trainer.run_steps(1)
        return before, table()
    finally:
        trainer.close()


def test_fbgemm_refuses_weight_decay_it_would_ignore():
    from anyrec.backends.dispatch import FBGEMM_EMBEDDING, TORCH_EMBEDDING
    from anyrec.config import OptimConfig
    from anyrec.trainer.optim import check_embedding_weight_decay

    with pytest.raises(ValueError, match="not applied by the fbgemm embedding implementation's fused "
                                         "update; use backend.embedding_kernel= one of triton, torch"):
        check_embedding_weight_decay(OptimConfig(weight_decay=0.1), FBGEMM_EMBEDDING)
    check_embedding_weight_decay(OptimConfig(weight_decay=0.0), FBGEMM_EMBEDDING)
    check_embedding_weight_decay(OptimConfig(weight_decay=0.1), TORCH_EMBEDDING)


@pytest.mark.parametrize("kernel", ["torch"])
def test_embedding_weight_decay_is_l2(kernel, tmp_path, monkeypatch):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    w0, plain = _one_step(kernel, 0.0, tmp_path)
    w0_again, decayed = _one_step(kernel, WD, tmp_path)
    assert torch.equal(w0, w0_again)
    # First step: same weights, same batch, so the same gradient; L2 decay adds lr * wd * w0 to the
    # update of exactly the rows the batch touched (sparse, lazy decay as FBGEMM does it).
    touched = (plain != w0).any(dim=1)
    assert touched.any()
    torch.testing.assert_close(decayed[touched], plain[touched] - LR * WD * w0[touched], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(decayed[~touched], w0[~touched])


def test_fbgemm_on_the_cpu_refuses_adam_unless_every_table_is_replicated():
    """FBGEMM's CPU TBE has no Adam: one line naming the way out, not its assertion inside sharding."""
    from types import SimpleNamespace

    from anyrec.backends.dispatch import FBGEMM_EMBEDDING as FBGEMM
    from anyrec.backends.dispatch import TORCH_EMBEDDING
    from anyrec.config import OptimConfig
    from anyrec.trainer.optim import check_embedding_optimizer

    def plan(*types):
        return SimpleNamespace(plan={"model.ebc": {f"t{i}": SimpleNamespace(sharding_type=t)
                                                   for i, t in enumerate(types)}})

    adam = OptimConfig(name="adam")
    want = (r"^optim=adam: the fbgemm embedding implementation has no fused adam on the CPU \(the plan "
            r"shards tables as row_wise, table_wise\); use backend.embedding_kernel= one of triton, torch")
    with pytest.raises(ValueError, match=want):
        check_embedding_optimizer(adam, FBGEMM, "cpu", plan("table_wise", "data_parallel", "row_wise"))
    check_embedding_optimizer(adam, FBGEMM, "cpu", plan("data_parallel", "data_parallel"))
    check_embedding_optimizer(adam, FBGEMM, "cuda", plan("table_wise"))
    check_embedding_optimizer(adam, TORCH_EMBEDDING, "cpu", plan("table_wise"))
    check_embedding_optimizer(OptimConfig(name="adagrad"), FBGEMM, "cpu", plan("table_wise"))


def test_adam_betas_reach_the_sharded_tbe_by_their_fbgemm_names():
    """torchrec passes the in-backward optimizer's kwargs to the TBE as fused params: `betas` was a
    TypeError in FBGEMM and silently replaced by the defaults in anyrec's TBE."""
    from anyrec.config import OptimConfig
    from anyrec.kernels.torchrec_kernel import optimizer_from_fused_params
    from anyrec.trainer.optim import apply_embedding_optimizer

    tables = [torch.nn.Parameter(torch.zeros(4, 2)) for _ in range(2)]
    apply_embedding_optimizer(tables, OptimConfig(name="adam", embedding_lr=0.02, betas=[0.5, 0.6]))
    for p in tables:
        (stored,) = p._optimizer_kwargs
        assert "betas" not in stored and (stored["beta1"], stored["beta2"]) == (0.5, 0.6)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    opt = optimizer_from_fused_params({**tables[0]._optimizer_kwargs[0], "optimizer": EmbOptimType.ADAM,
                                       "learning_rate": 0.02})
    assert (opt.beta1, opt.beta2) == (0.5, 0.6)
