"""Input validation: every batch is checked on every rank before it reaches the model.

Out-of-range or negative ids would index outside a table (garbage or a crash deep inside a kernel),
and a wrong number of features would fail far from its cause. The check is collective: each rank
checks its own batch, one all-reduce says whether any rank found a problem, and then every rank
raises the same ValueError at the same step, so no rank is left waiting in a collective.
Legend: B batch, I dense features.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch


def check_batch(batch: Batch, feature_names: list[str], table_rows: list[int],
                num_dense: int) -> str | None:
    """What is wrong with this batch for this model, or None."""
    dense_BI = batch.dense_features
    if dense_BI.dim() != 2 or dense_BI.shape[1] != num_dense:
        return (f"the data has {dense_BI.shape[-1] if dense_BI.dim() else 0} dense features per "
                f"sample, the model expects {num_dense}")
    kjt = batch.sparse_features
    keys = list(kjt.keys())
    if keys != feature_names:
        if len(keys) != len(feature_names):
            return (f"the data has {len(keys)} sparse features, the model has {len(feature_names)} "
                    f"tables (model.table_rows)")
        return f"the data's sparse features {keys} do not match the model's {feature_names}"
    values = kjt.values()
    if values.numel() == 0:
        return None
    for name, rows, ids in zip(keys, table_rows, torch.split(values, kjt.length_per_key()), strict=True):
        if ids.numel() == 0:
            continue
        lo, hi = torch.aminmax(ids)
        if int(lo) < 0:
            return f"feature {name}: negative id {int(lo)} (ids must be in [0, {rows}))"
        if int(hi) >= rows:
            return (f"feature {name}: id {int(hi)} out of range for its table of {rows} rows "
                    f"(ids must be in [0, {rows}))")
    return None


class InputValidator:
    """Checks each batch on every rank and raises the same ValueError everywhere on a problem."""

    def __init__(self, feature_names: list[str], table_rows: list[int], num_dense: int,
                 device: torch.device) -> None:
        self.feature_names, self.table_rows, self.num_dense = feature_names, table_rows, num_dense
        self.device = device

    def __call__(self, batch: Batch, step: int, what: str = "step") -> None:
        problem = check_batch(batch, self.feature_names, self.table_rows, self.num_dense)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag)
            if int(flag) == 0:
                return
            problems: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
            rank, problem = next((r, p) for r, p in enumerate(problems) if p is not None)
            raise ValueError(f"bad input at {what} {step + 1} (rank {rank}): {problem}")
        if problem is not None:
            raise ValueError(f"bad input at {what} {step + 1}: {problem}")

    def wrap(self, batches: Iterable[Batch], first_step: int, what: str = "step") -> Iterator[Batch]:
        """The batches, each validated as it is drawn (so before it enters the pipeline)."""
        for i, batch in enumerate(batches):
            self(batch, first_step + i, what)
            yield batch
