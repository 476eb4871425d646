"""optim=adam with FBGEMM on the CPU replicates every table: anyrec says why once, and torch's warning
about the dense TBE that runs replicated tables (benign: its gradient is exact, checked here) is quiet."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

from anyrec.backends.dispatch import get_impl
from anyrec.backends.hardware import EmbeddingCost
from anyrec.config import PlannerConfig
from anyrec.planner import job
from anyrec.planner.types import ShardingType


def _dense_tbe_backward() -> tuple[list[str], bool]:
    """(warnings, gradient exact) of one forward/backward of FBGEMM's CPU dense TBE, as torchrec runs a
    replicated table."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

    torch.manual_seed(0)
    rows, dim, bags, ids_per_bag = (50, 30), 8, 5, 4
    tbe = DenseTableBatchedEmbeddingBagsCodegen([(r, dim) for r in rows], use_cpu=True)
    ids = torch.randint(0, min(rows), (len(rows) * bags * ids_per_bag,))
    offsets = torch.arange(0, len(ids) + 1, ids_per_bag)
    with warnings.catch_warnings(record=True) as seen:
        out = tbe(ids, offsets)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    expected = torch.zeros_like(tbe.weights)
    start = 0
    for t, r in enumerate(rows):
        for b in range(bags):
            k = (t * bags + b) * ids_per_bag
            for i in ids[k:k + ids_per_bag].tolist():
                expected[start + i * dim:start + (i + 1) * dim] += grad_out[b, t * dim:(t + 1) * dim]
        start += r * dim
    return [str(w.message) for w in seen], bool(torch.equal(tbe.weights.grad, expected))


def test_adam_on_the_cpu_replicates_says_why_once_and_the_warning_is_quiet(caplog):
    fbgemm = EmbeddingCost.builtin(get_impl("embedding", "fbgemm"))
    job._said.clear()
    with caplog.at_level(logging.INFO, logger="anyrec.planner.job"):
        for _ in range(2):
            opts = job.plan_options(PlannerConfig(), fbgemm, "adam", "cpu")
    assert opts["allowed_shardings"] == (ShardingType.DATA_PARALLEL,)
    lines = [r.getMessage() for r in caplog.records if "every table is replicated" in r.getMessage()]
    assert len(lines) == 1 and "no fused adam on the CPU" in lines[0], lines
    seen, exact = _dense_tbe_backward()
    assert exact, "the dense TBE's gradient is wrong: its warning is not benign"
    assert not [w for w in seen if "dense_embedding_codegen_lookup_function" in w], seen


def test_the_warning_is_shown_where_anyrec_did_not_replicate_for_this_reason():
    pytest.importorskip("fbgemm_gpu")
    fbgemm = EmbeddingCost.builtin(get_impl("embedding", "fbgemm"))
    job.plan_options(PlannerConfig(), fbgemm, "adagrad", "cpu")
    seen, exact = _dense_tbe_backward()
    assert exact and [w for w in seen if "dense_embedding_codegen_lookup_function" in w]


def test_every_rank_that_trains_replicated_tables_quiets_it():
    """Only rank 0 plans; the others accept the plan in check_embedding_optimizer, which quiets it too."""
    from anyrec.backends.dispatch import FBGEMM_EMBEDDING
    from anyrec.config import OptimConfig
    from anyrec.trainer.optim import check_embedding_optimizer

    replicated = SimpleNamespace(plan={"model.ebc": {"t0": SimpleNamespace(sharding_type="data_parallel")}})
    check_embedding_optimizer(OptimConfig(name="adam"), FBGEMM_EMBEDDING, "cpu", replicated)
    seen, exact = _dense_tbe_backward()
    assert exact and not [w for w in seen if "dense_embedding_codegen_lookup_function" in w], seen
