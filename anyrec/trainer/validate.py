"""Step checks without host stalls: input contracts of every batch and the finiteness of every loss.

Out-of-range or negative ids would index outside a table, labels outside {0, 1} or non-finite dense
values would train to garbage, a wrong number of features would fail far from its cause. Shapes, keys
and dtypes are host metadata: checked as each batch is drawn, raised at once. Values (ids, labels,
dense) are checked on the device with O(ids) vectorised ops and no host read; the findings wait on
the device until `flush_checks`, which the trainer calls at log, eval and checkpoint boundaries: one
small all-reduce tells every rank the first bad step, and every rank raises the same one-line error
naming the step, rank and feature. A bad batch is therefore reported up to one log interval late,
never lost, and never after a checkpoint that contains its update.

Non-finite losses: by default a device flag keeps the first bad step, checked at the same flushes
(NonFiniteLossError). `trainer.skip_nonfinite=true` must decide before the backward whether to skip
(the fused embedding update runs inside the backward, and every rank must skip the same step), so
that mode alone keeps one host sync (and all-reduce) per step.
Legend: B batch, I dense features, F sparse features, P pending steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from anyrec.runtime.distributed import DistInfo
from anyrec.runtime.errors import NonFiniteLossError

_NONE = 2**62  # "no bad step" in the min-reduced step codes
_REPORT = "_anyrec_value_report"  # a batch's precomputed value findings (InputValidator.prepare)


def check_metadata(batch: Batch, feature_names: list[str], num_dense: int) -> str | None:
    """What is wrong with the batch's shapes, keys or dtypes (host metadata only, no sync), or None."""
    dense_BI = batch.dense_features
    if dense_BI.dim() != 2 or dense_BI.shape[1] != num_dense:
        return (f"the data has {dense_BI.shape[-1] if dense_BI.dim() else 0} dense features per "
                f"sample, the model expects {num_dense}")
    if not dense_BI.is_floating_point():
        return f"dense features must be floating point, got {dense_BI.dtype}"
    kjt = batch.sparse_features
    keys = list(kjt.keys())
    if keys != feature_names:
        if len(keys) != len(feature_names):
            return (f"the data has {len(keys)} sparse features, the model has {len(feature_names)} "
                    f"tables (model.table_rows)")
        return f"the data's sparse features {keys} do not match the model's {feature_names}"
    if kjt.values().is_floating_point() or kjt.values().dtype == torch.bool:
        return f"ids must be integers, got {kjt.values().dtype}"
    B = dense_BI.shape[0]
    if tuple(batch.labels.shape) != (B,):
        return f"labels have shape {tuple(batch.labels.shape)}, expected ({B},) for a batch of {B}"
    if kjt.stride() != B:
        return f"the sparse features hold {kjt.stride()} samples, the dense features {B}"
    return None


def value_report(batch: Batch, table_rows: list[int]) -> torch.Tensor:
    """Per-batch findings on the device, no host read: [min id per feature, max id per feature,
    labels not in {0, 1}, non-finite dense values] as int64 [2F + 2]."""
    kjt = batch.sparse_features
    values = kjt.values()
    mins, maxs = [], []
    for ids in torch.split(values, kjt.length_per_key()):
        if ids.numel():
            lo, hi = torch.aminmax(ids)
        else:
            lo, hi = values.new_zeros(()), values.new_full((), -1)
        mins.append(lo)
        maxs.append(hi)
    labels = batch.labels
    bad_labels = ((labels != 0) & (labels != 1)).sum()
    bad_dense = (~torch.isfinite(batch.dense_features)).sum()
    return torch.stack([*mins, *maxs, bad_labels.to(values.dtype), bad_dense.to(values.dtype)]).long()


def describe(report: list[int], feature_names: list[str], table_rows: list[int]) -> str | None:
    """The first problem in a (host) value report, as one line, or None."""
    F = len(feature_names)
    for f, (name, rows) in enumerate(zip(feature_names, table_rows, strict=True)):
        lo, hi = report[f], report[F + f]
        if lo < 0:
            return f"feature {name}: negative id {lo} (ids must be in [0, {rows}))"
        if hi >= rows:
            return (f"feature {name}: id {hi} out of range for its table of {rows} rows "
                    f"(ids must be in [0, {rows}))")
    if report[2 * F]:
        return f"{report[2 * F]} labels are not 0 or 1"
    if report[2 * F + 1]:
        return f"{report[2 * F + 1]} dense values are NaN or infinite"
    return None


def _at(what: str, step: int, rank: int, info: DistInfo) -> str:
    """`step 7` (of 0-based `step` 6), or `step 7 (rank 1)` when the world has ranks."""
    return f"{what} {step + 1}" + (f" (rank {rank})" if info.world_size > 1 else "")


class InputValidator:
    """Checks each batch as it is drawn; value findings stay on the device until `flush_checks`.
    `skip_nonfinite`: non-finite dense values of training batches are left to the loss guard, which
    skips their step (its loss is non-finite); evaluation batches stay strict."""

    def __init__(self, feature_names: list[str], table_rows: list[int], num_dense: int,
                 device: torch.device, info: DistInfo, skip_nonfinite: bool = False) -> None:
        self.feature_names, self.table_rows, self.num_dense = feature_names, table_rows, num_dense
        self.device, self.info, self.skip_nonfinite = device, info, skip_nonfinite
        self._rows_F = torch.tensor(table_rows, dtype=torch.int64, device=device)
        self._pending: list[tuple[int, str, torch.Tensor]] = []

    def prepare(self, batch: Batch) -> None:
        """The batch's value findings, computed now and kept with it (a prefetch worker calls this as
        it makes the batch, so the step's thread only queues them); bad metadata is left to `__call__`."""
        if check_metadata(batch, self.feature_names, self.num_dense) is None:
            batch.__dict__[_REPORT] = value_report(batch, self.table_rows)

    def __call__(self, batch: Batch, step: int, what: str = "step") -> None:
        problem = check_metadata(batch, self.feature_names, self.num_dense)
        if problem is not None:
            raise ValueError(f"bad input at {_at(what, step, self.info.rank, self.info)}: {problem}")
        report = batch.__dict__.pop(_REPORT, None)
        if report is None:
            report = value_report(batch, self.table_rows)
        if self.skip_nonfinite and what == "step":
            report = torch.cat([report[:-1], report.new_zeros(1)])  # the loss guard skips the step
        self._pending.append((step, what, report))

    def wrap(self, batches: Iterable[Batch], first_step: int, what: str = "step") -> Iterator[Batch]:
        """The batches, each checked as it is drawn (so before it enters the pipeline)."""
        for i, batch in enumerate(batches):
            self(batch, first_step + i, what)
            yield batch

    def pending_code(self) -> torch.Tensor:
        """[1] int64: (index of the first bad pending batch) * world + rank, or _NONE (no sync)."""
        if not self._pending:
            return torch.full((1,), _NONE, dtype=torch.int64, device=self.device)
        reports_PR = torch.stack([r for _, _, r in self._pending]).to(self.device)
        F = len(self.table_rows)
        bad_P = ((reports_PR[:, :F] < 0).any(1) | (reports_PR[:, F:2 * F] >= self._rows_F).any(1)
                 | (reports_PR[:, 2 * F:] != 0).any(1))
        order_P = torch.arange(len(self._pending), device=self.device)
        local = torch.where(bad_P, order_P, len(self._pending)).min()
        # Steps are ranked by their index in `pending` (the same on every rank: same loop).
        code = local * self.info.world_size + self.info.rank
        return torch.where(local < len(self._pending), code, _NONE).reshape(1)

    def raise_found(self, code: int) -> None:
        """Consume the pending findings; raise the bad batch `code` (all ranks' minimum) names. Every
        rank calls it with the same code: naming the problem is a broadcast from its rank."""
        pending, self._pending = self._pending, []
        if code >= _NONE:
            return
        index, rank = divmod(code, self.info.world_size)
        mine = rank == self.info.rank
        problem = describe(pending[index][2].tolist(), self.feature_names, self.table_rows) if mine else None
        if self.info.world_size > 1:
            box: list[str | None] = [problem]
            dist.broadcast_object_list(box, src=rank)
            problem = box[0]
        step, what = pending[index][0], pending[index][1]
        raise ValueError(f"bad input at {_at(what, step, rank, self.info)}: {problem}")


class NonFiniteGuard:
    """Watches every loss; default: a device flag checked at `flush_checks`, skip mode: a check per step."""

    def __init__(self, skip: bool, device: torch.device, info: DistInfo) -> None:
        self.skip, self.device, self.info = skip, device, info
        self._first_bad = torch.full((), _NONE, dtype=torch.int64, device=device)

    def observe(self, loss: torch.Tensor, step: int) -> bool:
        """Whether to run this step's backward. Only skip mode reads the loss (sync + all-reduce)."""
        bad = ~torch.isfinite(loss.detach())
        if not self.skip:
            code = torch.where(bad, step * self.info.world_size + self.info.rank, _NONE)
            self._first_bad = torch.minimum(self._first_bad, code)
            return True
        flag = bad.to(torch.int32).reshape(1)
        if self.info.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not bool(flag)

    def pending_code(self) -> torch.Tensor:
        """[1] int64: the first non-finite step * world + rank seen here, or _NONE (no sync)."""
        if self.skip:
            return torch.full((1,), _NONE, dtype=torch.int64, device=self.device)
        return self._first_bad.reshape(1).clone()

    def raise_found(self, code: int) -> None:
        """Raise NonFiniteLossError for `code` (all ranks' minimum), unless it is _NONE."""
        if code < _NONE:
            step, rank = divmod(code, self.info.world_size)
            raise NonFiniteLossError(f"non-finite loss at {_at('step', step, rank, self.info)}; "
                                     "set trainer.skip_nonfinite=true to skip such batches (and batches "
                                     "with non-finite dense inputs, from any source)")


def flush_checks(validator: InputValidator | None, guard: NonFiniteGuard | None) -> None:
    """Raise what the deferred checks found since the last flush: a bad input first (it may be what
    made a loss non-finite), then a non-finite loss. Both checks' codes travel in one all-reduce and
    come back in one host read (a collective: every rank calls it at the same point)."""
    checks = [c for c in (validator, guard) if c is not None]
    if not checks:
        return
    codes = torch.cat([c.pending_code() for c in checks])
    if checks[0].info.world_size > 1:
        dist.all_reduce(codes, op=dist.ReduceOp.MIN)
    for check, code in zip(checks, codes.tolist(), strict=True):
        check.raise_found(code)
