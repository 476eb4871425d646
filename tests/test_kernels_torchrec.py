"""The Triton TBE compute kernel inside torchrec's DistributedModelParallel: 2 ranks, gloo, CPU.

Each test launches two worker processes running this file as a script. Every rank builds the same
unsharded tables and batches from one seed, shards an EmbeddingBagCollection with
`TritonEmbeddingBagCollectionSharder` (torch execution on CPU) under a hand-made plan, copies the
reference weights into its shards, trains a few steps and checks its pooled outputs, its weight
shards and its optimizer-state shards against the reference on the global batch. torchrec averages
sharded-embedding gradients over ranks, so the reference uses grad_out / world_size.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # every test here starts processes

WORLD = 2
B_LOCAL = 2
STEPS = 3
TABLES = {"t0": (8, 8, ["f0", "f2"]), "t1": (10, 8, ["f1"])}  # rows, dim, features
FEATURES = ["f0", "f1", "f2"]
FEATURE_TABLE = {"f0": "t0", "f1": "t1", "f2": "t0"}
# shards of weights (and as many of optimizer state) each rank holds: one table each under table-wise,
# a piece of both tables otherwise
SHARDS_PER_RANK = {"table_wise": 1, "row_wise": 2, "column_wise": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(sharding: str, optimizer: str) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), sharding, optimizer],
                              cwd=root, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{sharding} ranks timed out")
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and "RANK OK" in out, f"rank {r} ({sharding}):\n{out[-5000:]}"


@pytest.mark.parametrize(("sharding", "optimizer"), [
    ("table_wise", "rowwise_adagrad"),
    ("row_wise", "rowwise_adagrad"),
    # row-wise Adagrad keeps one accumulator per column shard (as FBGEMM does), so an element-wise
    # optimizer is what a column-wise plan can match against the unsharded reference
    ("column_wise", "adagrad"),
])
def test_dmp_matches_unsharded_reference(sharding, optimizer):
    pytest.importorskip("torchrec")
    _run_ranks(sharding, optimizer)


# ---- worker ----------------------------------------------------------------------------------------


def _worker(sharding: str, optimizer: str) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    from anyrec.kernels import reference as R
    from anyrec.kernels.optimizers import OptimizerConfig
    from anyrec.kernels.torchrec_kernel import TRITON_COMPUTE_KERNEL, TritonEmbeddingBagCollectionSharder

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    opt = OptimizerConfig(optimizer, lr=0.1, eps=1e-6)
    g = torch.Generator().manual_seed(0)
    tables = {n: torch.rand(r, d, generator=g) - 0.5 for n, (r, d, _) in TABLES.items()}

    # per step: per (rank, feature, sample) ids; grad of every rank's pooled output
    def batch(step):
        gen = torch.Generator().manual_seed(100 + step)
        data = {}
        for r in range(WORLD):
            for f in FEATURES:
                rows = TABLES[FEATURE_TABLE[f]][0]
                for b in range(B_LOCAL):
                    n = [0, 1, 3, 2][(r + b + FEATURES.index(f) + step) % 4]
                    data[r, f, b] = torch.randint(rows - 4, rows, (n,), generator=gen)  # dups + last row
        grads = {(r, f): torch.randn(B_LOCAL, TABLES[FEATURE_TABLE[f]][1], generator=gen)
                 for r in range(WORLD) for f in FEATURES}
        return data, grads

    def kjt(data, ranks, f_list):
        vals, lens = [], []
        for f in f_list:
            for r in ranks:
                for b in range(B_LOCAL):
                    vals.append(data[r, f, b])
                    lens.append(len(data[r, f, b]))
        return torch.cat(vals), torch.tensor(lens)

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=fs)
                for n, (r, d, fs) in TABLES.items()],
        device=torch.device("meta"),
    )
    sharder = TritonEmbeddingBagCollectionSharder(opt, execution="torch")
    gen_for = {
        "table_wise": lambda i: table_wise(rank=i % WORLD, compute_kernel=TRITON_COMPUTE_KERNEL),
        "row_wise": lambda i: row_wise(compute_kernel=TRITON_COMPUTE_KERNEL),
        "column_wise": lambda i: column_wise(ranks=[0, 1], compute_kernel=TRITON_COMPUTE_KERNEL),
    }[sharding]
    mod_plan = construct_module_sharding_plan(
        ebc, {n: gen_for(i) for i, n in enumerate(TABLES)}, sharder=sharder, local_size=WORLD,
        world_size=WORLD, device_type="cpu")
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder],
                                     plan=ShardingPlan({"": mod_plan}))

    def local_shards(sd_value):
        for shard in sd_value.local_shards():
            o, s = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            yield shard.tensor, tuple(slice(a, a + b) for a, b in zip(o, s, strict=True))

    sd = model.state_dict()
    with torch.no_grad():
        for n in TABLES:
            for t, sl in local_shards(sd[f"embedding_bags.{n}.weight"]):
                t.copy_(tables[n][sl])

    # reference on the unsharded global batch (feature-major KJT; features of one table kept apart)
    names = list(TABLES)
    ref_w = [tables[n].clone() for n in names]
    ref_state = [R.init_state_ref(opt.kind, *w.shape) for w in ref_w]
    ftm = [names.index(FEATURE_TABLE[f]) for f in FEATURES]
    for step in range(STEPS):
        data, grads = batch(step)
        ids, lens = kjt(data, [rank], FEATURES)
        out = model(KeyedJaggedTensor(keys=FEATURES, values=ids, lengths=lens)).to_dict()
        gids, glens = kjt(data, range(WORLD), FEATURES)
        goff = torch.zeros(len(glens) + 1, dtype=torch.int64)
        goff[1:] = glens.cumsum(0)
        ref_out = R.pooled_forward_ref(ref_w, ftm, gids, goff)
        col = 0
        for f in FEATURES:
            d = TABLES[FEATURE_TABLE[f]][1]
            want = ref_out[rank * B_LOCAL:(rank + 1) * B_LOCAL, col:col + d]
            torch.testing.assert_close(out[f], want, rtol=1e-5, atol=1e-6, msg=f"step {step} {f}")
            col += d
        loss = sum((out[f] * grads[rank, f]).sum() for f in FEATURES)
        loss.backward()
        g_out = torch.cat([torch.cat([grads[r, f] for r in range(WORLD)]) for f in FEATURES], dim=1) / WORLD
        row_g, touched = R.row_gradients_ref(ref_w, ftm, gids, goff, g_out)
        ref_w = [R.apply_optimizer_ref(w, s, gr, tc, opt, step + 1)
                 for w, s, gr, tc in zip(ref_w, ref_state, row_g, touched, strict=True)]

    sd = model.state_dict()
    weight_shards = 0
    for i, n in enumerate(names):
        for t, sl in local_shards(sd[f"embedding_bags.{n}.weight"]):
            torch.testing.assert_close(t, ref_w[i][sl], rtol=1e-5, atol=1e-6, msg=f"{n} weights {sl}")
            weight_shards += 1
    assert weight_shards == SHARDS_PER_RANK[sharding], weight_shards
    osd = model.fused_optimizer.state_dict()["state"]
    checked = 0
    for i, n in enumerate(names):
        key = f"embedding_bags.{n}.weight"
        if key not in osd:  # table-wise: the table lives on the other rank
            continue
        st = osd[key][f"{n}.momentum1"]
        for t, sl in local_shards(st):
            want = ref_state[i]["sum"]
            if want.dim() == 1 and sharding == "column_wise":  # 1-D state of column shards is row-stacked
                continue
            torch.testing.assert_close(t, want[sl[: want.dim()]], rtol=1e-5, atol=1e-7, msg=f"{n} state")
            checked += 1
    assert checked == SHARDS_PER_RANK[sharding], f"{checked} state shards checked"
    print(f"rank {rank}: {sharding} ok, {checked} state shards checked", flush=True)
    print("RANK OK", flush=True)
    del model, out, loss, sd, osd
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
