"""Run under torchrun: a sharded DLRM must match an unsharded copy (forward and SGD updates).

Writes {"rank": r, "max_logit_diff": x, "max_weight_diff": {name: x}, "shardings": {...}} per rank
to OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from anyrec.backends import get_backend
from anyrec.config import DataConfig, ModelConfig
from anyrec.data.synthetic import SyntheticCriteo
from anyrec.models.dlrm import build_model
from anyrec.planner.simple import to_sharding_plan
from anyrec.runtime.distributed import destroy_distributed, init_distributed
from anyrec.trainer.trainer import EBC_PATH, DLRMTrain

LR, STEPS = 0.1, 3


def shard_slices(value):
    """(local tensor, slices into the full tensor) for a ShardedTensor or a plain tensor."""
    if isinstance(value, ShardedTensor):
        for shard in value.local_shards():
            md = shard.metadata
            yield shard.tensor, tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes))
    else:
        yield value, tuple(slice(None) for _ in value.shape)


def main(out_dir: Path) -> None:
    info = init_distributed(get_backend("cpu"))
    world = info.world_size
    model_cfg = ModelConfig(
        name="check", embedding_dim=8, table_rows=[50, 7, 300, 1, 64, 129], multi_hot=[1, 3, 2, 1, 5, 2],
        bottom_mlp=[16, 8], top_mlp=[16, 1],
    )
    data_cfg = DataConfig(batch_size=16)
    torch.manual_seed(0)
    ref = DLRMTrain(build_model(model_cfg, torch.device("cpu")))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    torch.manual_seed(0)
    model = build_model(model_cfg, torch.device("cpu"), ebc_device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": LR})
    kinds = ["table_wise", "row_wise", "table_wise", "row_wise", "table_wise", "row_wise"]
    shardings = {
        f"t_cat_{i}": (kind, [i % world] if kind == "table_wise" else list(range(world)))
        for i, kind in enumerate(kinds)
    }
    plan = to_sharding_plan(model.sparse_arch, shardings, EBC_PATH, world, info.local_world_size, "cpu")
    dmp = DistributedModelParallel(DLRMTrain(model), device=torch.device("cpu"), plan=plan)
    ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            for local, idx in shard_slices(value):
                local.copy_(ref_state[key][idx])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: torch.optim.SGD(ps, lr=LR))
    opt = CombinedOptimizer([("dense", dense), ("sparse", dmp.fused_optimizer)])

    sources = [SyntheticCriteo(model_cfg, data_cfg, seed=3, rank=r, world_size=world) for r in range(world)]
    max_logit_diff = 0.0
    for step in range(STEPS):
        batches = [s.batch(step) for s in sources]
        opt.zero_grad()
        loss, (logits, _) = dmp(batches[info.rank])
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_losses = []
        for r, b in enumerate(batches):
            ref_loss, (ref_logits, _) = ref(b)
            ref_losses.append(ref_loss)
            if r == info.rank:
                max_logit_diff = max(max_logit_diff, float((ref_logits - logits).abs().max()))
        (torch.stack(ref_losses).mean()).backward()
        ref_opt.step()

    init_state = ref_state
    ref_state = ref.state_dict()
    moved = {k: float((ref_state[k] - init_state[k]).abs().max()) for k in ref_state}
    diffs = {}
    for key, value in dmp.state_dict().items():
        for local, idx in shard_slices(value):
            d = float((local - ref_state[key][idx]).abs().max()) if local.numel() else 0.0
            diffs[key] = max(diffs.get(key, 0.0), d)
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(
        {"rank": info.rank, "max_logit_diff": max_logit_diff, "max_weight_diff": diffs, "max_update": moved,
         "shardings": {k: v[0] for k, v in shardings.items()}}))
    del dmp, opt, dense, model
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
