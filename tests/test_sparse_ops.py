"""Portable sparse ops: each against FBGEMM's CPU kernel through the dispatcher, their registration
rules, and 2-rank sharded training bit-identical to FBGEMM's with every FBGEMM call served by them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from anyrec.backends import sparse_ops
from anyrec.backends.cpu import CPUBackend
from anyrec.backends.sparse_ops import SPARSE_OPS

from .conftest import (
    ROOT,
    compose_config,
    free_port,
    last_json_line,
    reset_probes,
    single_process_env,
    torchrun,
)
from .portable_calls import counted_ops
from .test_plugin import plugin_path  # noqa: F401 - the fake accelerator, pip-installed once

fbgemm = pytest.importorskip("fbgemm_gpu")
OPS = torch.ops.fbgemm
SHARDINGS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


CALLS: Counter[str] = Counter()  # calls served by the portable kernels, by op name


@pytest.fixture(autouse=True)
def count_portable_calls(monkeypatch):
    """Every portable kernel registered during a test counts its calls in CALLS."""
    for name, op in counted_ops(CALLS).items():
        monkeypatch.setitem(SPARSE_OPS, name, op)


@pytest.fixture
def portable_cpu():
    """Portable kernels serve every inventory op on CPU for the test, FBGEMM's again afterwards."""
    sparse_ops.register("CPU", list(SPARSE_OPS))
    yield
    sparse_ops.unregister("CPU")


def compare(op: str, cases: list[tuple]) -> None:
    """`fbgemm::op` on every argument tuple: FBGEMM's CPU kernel, then the portable one registered in
    its place (both through the dispatcher); the results must be equal in dtype, shape and bits."""
    assert not sparse_ops.installed("CPU")
    before = CALLS[f"fbgemm::{op}"]
    refs = [getattr(OPS, op)(*args) for args in cases]
    assert CALLS[f"fbgemm::{op}"] == before, "FBGEMM's kernel should have served the reference"
    sparse_ops.register("CPU", [f"fbgemm::{op}"])
    try:
        outs = [getattr(OPS, op)(*args) for args in cases]
    finally:
        sparse_ops.unregister("CPU")
    assert CALLS[f"fbgemm::{op}"] == before + len(cases), "the portable kernel did not serve every call"
    for args, ref, out in zip(cases, refs, outs, strict=True):
        assert_same(ref, out, args)


def assert_same(ref, out, args=()):
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    out = out if isinstance(out, (tuple, list)) else (out,)
    assert len(ref) == len(out)
    for i, (a, b) in enumerate(zip(ref, out, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, f"output {i}: {a} vs {b} for {args}"
            continue
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"output {i}: {a.dtype, a.shape}, {b.dtype, b.shape}"
        assert torch.equal(a, b), f"output {i}:\n{a}\n{b}\nfor {args}"


def jagged(g, T, B, dtype, max_len=4, zero_features=()):
    """[T, B] lengths (some bags empty, `zero_features` rows all empty) and their ids."""
    lengths = torch.randint(0, max_len, (T, B), generator=g)
    for t in zero_features:
        lengths[t] = 0
    ids = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
    return lengths.to(dtype), ids.to(dtype)


CASES = [(T, B) for T in (0, 1, 3, 6) for B in (0, 1, 5)]


@pytest.mark.parametrize("ldtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True])
def test_permute_2d_and_1d_match_fbgemm(ldtype, weighted):
    g = torch.Generator().manual_seed(1)
    cases_2d, cases_1d = [], []
    for T, B in CASES:
        lengths, ids = jagged(g, T, B, ldtype, zero_features=(0,) if T > 2 else ())
        w = torch.rand(ids.numel(), generator=g) if weighted else None
        perms = [torch.randperm(T, generator=g)]
        if T:
            perms.append(torch.randint(0, T, (T + 2,), generator=g))  # repeats and a longer output
            perms.append(torch.tensor([T - 1]))  # a subset
        for perm in perms:
            perm = perm.to(torch.int32)
            cases_2d.append((perm, lengths, ids, w, None))
            cases_2d.append((perm, lengths, ids, w, int(lengths[perm.long()].sum())))
        perm_1d = torch.randperm(T * B, generator=g).to(torch.int32)
        cases_1d.append((perm_1d, lengths.reshape(-1), ids, w, None))
    compare("permute_2D_sparse_data", cases_2d)
    compare("permute_1D_sparse_data", cases_1d)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_complete_cumsum_matches_fbgemm(dtype):
    g = torch.Generator().manual_seed(2)
    shapes = [(0,), (1,), (7,), (3, 0), (3, 5), (0, 4)]
    compare("asynchronous_complete_cumsum", [(torch.randint(0, 100, s, generator=g).to(dtype),)
                                             for s in shapes])


@pytest.mark.parametrize("idtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True])
def test_block_bucketize_matches_fbgemm(idtype, weighted):
    g = torch.Generator().manual_seed(3)
    cases = []
    for (T, B) in CASES:
        if T == 0:
            continue
        lengths, ids = jagged(g, T, B, idtype, zero_features=(1,) if T > 2 else ())
        # Out-of-range and negative ids (FBGEMM reads them unsigned), including the extremes.
        extremes = [-1, -7, 2**31 - 1] + ([-(2**63), 2**63 - 1] if idtype == torch.int64 else [-(2**31)])
        if ids.numel() >= len(extremes):
            ids[: len(extremes)] = torch.tensor(extremes, dtype=idtype)
            scale = torch.randint(1, 30, (ids.numel() - len(extremes),), generator=g)
            ids[len(extremes):] *= scale.to(idtype)
        w = torch.rand(ids.numel(), generator=g) if weighted else None
        for my_size in (1, 2, 3):
            block_sizes = torch.randint(1, 40, (T,), generator=g).to(idtype)
            total_blocks = [None, (torch.randint(1, 3, (T,), generator=g) * my_size).to(idtype)]
            for total in total_blocks:
                # (bucketize_pos, sequence, keep_orig_idx): each flag on and off, in pairs
                for pos, sequence, keep in [(False, False, False), (True, True, False), (False, True, True),
                                            (True, False, True)]:
                    cases.append((lengths.reshape(-1), ids, pos, sequence, block_sizes, my_size, w, None, -1,
                                  None, keep, total))
    compare("block_bucketize_sparse_features", cases)


def test_block_bucketize_variable_batch_and_per_feature_keep_match_fbgemm():
    g = torch.Generator().manual_seed(4)
    batch_sizes = torch.tensor([2, 0, 3, 1])
    lengths = torch.randint(0, 4, (int(batch_sizes.sum()),), generator=g)
    ids = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
    keep = torch.tensor([True, False, False, True])
    block_sizes = torch.tensor([10, 20, 7, 50])
    compare("block_bucketize_sparse_features", [
        (lengths, ids, True, True, block_sizes, my_size, torch.rand(ids.numel(), generator=g), batch_sizes, 3,
         None, False, None, keep) for my_size in (2, 4)])


def pooled_case(g, B, dims):
    offsets = torch.tensor([0, *torch.tensor(dims).cumsum(0).tolist()], dtype=torch.int64)
    perm = torch.randperm(len(dims), generator=g)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(len(dims))
    inv_offsets = torch.tensor([0, *torch.tensor(dims)[perm].cumsum(0).tolist()], dtype=torch.int64)
    return torch.randn(B, sum(dims), generator=g), offsets, perm, inv_offsets, inv


@pytest.mark.parametrize("op", ["permute_pooled_embs", "permute_pooled_embs_split"])
def test_pooled_permute_matches_fbgemm(op):
    g = torch.Generator().manual_seed(5)
    shapes = [(4, [3, 5, 2]), (1, [8]), (0, [2, 2]), (6, [4, 1, 7, 2, 3])]
    compare(op, [pooled_case(g, B, dims) for B, dims in shapes])


@pytest.mark.parametrize("op", ["permute_pooled_embs_auto_grad", "permute_pooled_embs_auto_grad_split"])
def test_pooled_permute_gradient_matches_fbgemm(op, portable_cpu):
    g = torch.Generator().manual_seed(6)
    embs, *lists = pooled_case(g, 5, [4, 1, 7, 2, 3])
    grad = torch.randn(embs.shape, generator=g)
    results = []
    for portable in (False, True):
        if not portable:
            sparse_ops.unregister("CPU")
        else:
            sparse_ops.register("CPU", list(SPARSE_OPS))
        x = embs.clone().requires_grad_(True)
        before = CALLS[f"fbgemm::{op}"]
        out = getattr(OPS, op)(x, *lists)
        out.backward(grad)
        assert CALLS[f"fbgemm::{op}"] - before == int(portable)
        results.append((out.detach(), x.grad))
    assert_same(results[0], results[1])
    assert not torch.equal(results[0][0], embs)  # the permute moved columns


def test_register_and_unregister_switch_the_kernel_back_to_fbgemm():
    lengths = torch.tensor([1, 0, 2], dtype=torch.int64)
    sparse_ops.register("CPU", ["fbgemm::asynchronous_complete_cumsum"])
    before = CALLS["fbgemm::asynchronous_complete_cumsum"]
    OPS.asynchronous_complete_cumsum(lengths)
    assert CALLS["fbgemm::asynchronous_complete_cumsum"] == before + 1
    sparse_ops.unregister("CPU")
    assert OPS.asynchronous_complete_cumsum(lengths).tolist() == [0, 1, 1, 3]
    assert CALLS["fbgemm::asynchronous_complete_cumsum"] == before + 1  # FBGEMM served it


class NoFbgemmDevice(CPUBackend):
    """A backend on a device FBGEMM has no kernels for (CUDA here: this torch is CPU-only, fbgemm too)."""

    name = "nofbgemm"
    device_type = "cuda"


@pytest.fixture
def fresh_probes():
    reset_probes()
    yield
    reset_probes()
    for key in ("CPU", "CUDA"):
        sparse_ops.unregister(key)


def test_auto_never_overrides_fbgemm_and_fills_only_missing_kernels(fresh_probes, caplog):
    assert sparse_ops.install(CPUBackend(), "auto").portable == ()  # FBGEMM has every CPU kernel
    assert sparse_ops.installed("CPU") == ()
    # A device FBGEMM has one kernel for: auto keeps it and fills in the rest.
    native = torch.library.Library("fbgemm", "IMPL")
    native.impl("asynchronous_complete_cumsum", lambda t: t, "CUDA")
    try:
        with caplog.at_level("INFO"):
            choice = sparse_ops.install(NoFbgemmDevice(), "auto")
        assert choice.impl == "portable" and choice.dispatch_key == "CUDA"
        assert set(choice.portable) == set(SPARSE_OPS) - {"fbgemm::asynchronous_complete_cumsum"}
        for op in choice.portable:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
        assert "op sparse_ops -> portable" in caplog.text
        assert "sparse ops on CUDA: portable kernels" in caplog.text
        # Forcing portable overrides the native one too; going back to auto restores it.
        assert set(sparse_ops.install(NoFbgemmDevice(), "portable").portable) == set(SPARSE_OPS)
        again = sparse_ops.install(NoFbgemmDevice(), "auto")
        assert "fbgemm::asynchronous_complete_cumsum" not in again.portable
    finally:
        sparse_ops.unregister("CUDA")
        native._destroy()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::permute_2D_sparse_data", "CUDA")


def test_forced_fbgemm_without_kernels_and_bad_mode_fail_clearly(fresh_probes):
    with pytest.raises(ValueError, match=r"backend.sparse_ops=fbgemm is not available on nofbgemm: "
                                         r"fbgemm_gpu has no (TBE kernels for cuda|CUDA kernel)"):
        sparse_ops.install(NoFbgemmDevice(), "fbgemm")
    with pytest.raises(ValueError, match="sparse_ops must be one of auto, fbgemm, portable, got 'fast'"):
        sparse_ops.install(CPUBackend(), "fast")


def test_portable_mode_serves_every_recorded_op_in_one_process(fresh_probes, portable_cpu):
    """A one-rank KJT permute + bucketize + offsets: the profiler's fbgemm:: calls are all ours."""
    from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], torch.tensor([5, 1, 7, 2, 9, 0]),
                                              torch.tensor([2, 0, 1, 1, 1, 1]))
    before = Counter(CALLS)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = kjt.permute([2, 0, 1])
        out.offsets()
        bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4, 4, 4]))
    recorded = Counter(ev.name for ev in prof.events() if ev.name.startswith("fbgemm::"))
    served = Counter(CALLS)
    served.subtract(before)
    assert sum(recorded.values()) >= 3
    assert recorded == +served
    assert out.keys() == ["c", "a", "b"] and out.values().tolist() == [9, 0, 5, 1, 7, 2]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """2-rank gloo: every sharding type trained with FBGEMM's sparse ops and with the portable ones."""
    out = tmp_path_factory.mktemp("sparse_ops")
    proc = torchrun([str(ROOT / "tests" / "dist" / "sparse_ops_check.py"), str(out), ",".join(SHARDINGS)],
                    nproc=2, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.integration
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_two_rank_training_is_bit_identical_with_portable_sparse_ops(two_rank_results, sharding):
    for res in two_rank_results:
        fb, po = res[sharding]["fbgemm"], res[sharding]["portable"]
        assert len(fb["losses"]) == 3 and fb["losses"] == po["losses"]
        assert fb["final_loss"] == po["final_loss"]
        assert fb["weights"] == po["weights"] and fb["weights"] != fb["initial_weights"]
        assert fb["initial_weights"] == po["initial_weights"]


EXPECTED = {  # the recorded inventory per sharding type (docs/porting.md)
    "table_wise": {"asynchronous_complete_cumsum", "permute_2D_sparse_data"},
    "row_wise": {"asynchronous_complete_cumsum", "permute_2D_sparse_data", "block_bucketize_sparse_features"},
    "column_wise": {"asynchronous_complete_cumsum", "permute_2D_sparse_data",
                    "permute_pooled_embs_auto_grad_split"},
    "table_row_wise": {"asynchronous_complete_cumsum", "permute_2D_sparse_data",
                       "block_bucketize_sparse_features"},
    "data_parallel": {"asynchronous_complete_cumsum"},
}
# DP's FBGEMM dense TBE: the `embedding` op's kernel, not a sparse op
EMBEDDING_OPS = {"fbgemm::dense_embedding_codegen_lookup_function"}


@pytest.mark.integration
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_recorded_fbgemm_calls_are_all_served_by_portable_kernels(two_rank_results, sharding):
    for res in two_rank_results:
        fb, po = res[sharding]["fbgemm"], res[sharding]["portable"]
        sparse = {op: n for op, n in po["recorded"].items() if op not in EMBEDDING_OPS}
        assert {op.split("::")[1] for op in sparse} == EXPECTED[sharding]
        assert sparse == po["served"]  # every call, each served once by a portable kernel
        assert set(po["recorded"]) - set(sparse) <= EMBEDDING_OPS
        assert fb["served"] == {} and sum(fb["recorded"].values()) > 0  # the FBGEMM run used FBGEMM


def test_world_size_one_takes_the_sharded_path_when_sparse_ops_are_named(tmp_path, monkeypatch, fresh_probes):
    """`auto` keeps one device unsharded; naming the sparse ops shards through DMP, bit-identically."""
    from anyrec.trainer.fingerprint import weights_fingerprint
    from anyrec.trainer.trainer import Trainer

    # A group of one on a free port; monkeypatch restores every variable, so none leaks to later tests.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    results = {}
    for mode in ("auto", "fbgemm", "portable"):
        _, cfg = compose_config(["model=dlrm_tiny", "backend.name=cpu", "backend.embedding_kernel=torch",
                                 f"backend.sparse_ops={mode}", "trainer.steps=3", "trainer.eval_steps=0",
                                 "trainer.progress=false", "trainer.tensorboard=false", "data.batch_size=32",
                                 f"trainer.run_dir={tmp_path / mode}"])
        trainer = Trainer(cfg)
        try:
            before = Counter(CALLS)
            summary = trainer.train()
            served = sum((Counter(CALLS) - before).values())
            results[mode] = (trainer.unsharded, type(trainer.pipeline).__name__, summary["final_loss"],
                             weights_fingerprint(trainer.model, trainer.dist), served)
        finally:
            trainer.close()
    assert results["auto"][:2] == (True, "EagerLoop")
    assert results["fbgemm"][:2] == (False, "SparseDistPipeline") and results["fbgemm"][4] == 0
    assert results["portable"][:2] == (False, "SparseDistPipeline") and results["portable"][4] > 0
    assert results["portable"][2:4] == results["fbgemm"][2:4]


@pytest.mark.integration
def test_plugin_backend_trains_sharded_on_portable_sparse_ops(request, tmp_path):
    plugin = request.getfixturevalue("plugin_path")
    env = single_process_env(plugin)
    proc = subprocess.run(
        [sys.executable, "-m", "anyrec.train", "backend.name=fakeaccel", "backend.embedding_kernel=torch",
         "backend.sparse_ops=portable", "model=dlrm_tiny", "trainer.steps=2", "trainer.eval_steps=0",
         "trainer.progress=false", f"hydra.run.dir={tmp_path}/r"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert (summary["backend"], summary["steps"], summary["embedding_kernel"]) == ("fakeaccel", 2, "torch")
    log = (tmp_path / "r" / "train_rank0.log").read_text()
    assert "op sparse_ops -> portable (forced by backend.sparse_ops)" in log
    assert "sparse ops on CPU: portable kernels for fbgemm::asynchronous_complete_cumsum" in log
    assert "torchrec sharding plan" in log and "SparseDistPipeline" in log
