"""A family's export signature: what a scoring artifact of its trained model holds, the tensors a scoring
call takes, and how a batch of its data becomes that call. `anyrec-export` and `anyrec-predict`
(anyrec.serving) read everything family-specific from this value (`ModelFamily.export`).

A scoring module is plain torch (traced by `torch.export` to aten ops), built from the trained module's
scoring part and a `TableStage`: the serving layer's lookups at a table precision, which the family asks
for pooled (a sum per bag, DLRM) or one row per id (sequence features, DLRMv4).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from anyrec.config import IdLayout, ModelConfig

# A scoring call's arguments, as the module's forward takes them: tensors and lists of tensors
ScoringArgs = tuple[Any, ...]


class TableStage(Protocol):
    """Lookups in a trained model's tables at the artifact's precision (anyrec.serving.model builds it);
    `id_layout`: how the scoring call gives its bags (offsets or lengths)."""

    id_layout: IdLayout

    def pooled(self, weights: list[torch.Tensor]) -> nn.Module:
        """`forward(ids, bags) -> [B, F, D]`: each feature's bags summed in its own table."""
        ...

    def rows(self, weights: list[torch.Tensor]) -> nn.Module:
        """`forward(ids) -> [ids_0 rows [N_0, D], ...]`: each feature's ids looked up in its own table."""
        ...


@dataclass(frozen=True)
class ExportSignature:
    """How a family's trained model becomes a scoring program and what that program takes.

    `part`: the trained training module's scoring part (no loss); `build(part, tables)`: the plain-torch
    scoring module. `example(cfg, id_layout)`: a small batch of arguments to trace; `dynamic_shapes`:
    their dynamic dims (torch.export's); `check(cfg, id_layout)`: a function of a call's arguments that
    raises ValueError in one line for arguments the program cannot take (before its graph runs);
    `batch_args(batch, id_layout, device)`: a batch of the family's data as (arguments, labels);
    `describe(cfg, id_layout)`: the manifest's `inputs`, `output` and `features`; `load_kernels`: op ->
    implementation name the trained module is rebuilt with to read a checkpoint (the portable ones; the
    scoring module replaces what does not trace)."""

    part: Callable[[nn.Module], nn.Module]
    build: Callable[[nn.Module, TableStage], nn.Module]
    example: Callable[[ModelConfig, IdLayout], ScoringArgs]
    dynamic_shapes: Callable[[ModelConfig, IdLayout], tuple[Any, ...]]
    check: Callable[[ModelConfig, IdLayout], Callable[[ScoringArgs], None]]
    batch_args: Callable[[Any, IdLayout, torch.device], tuple[ScoringArgs, torch.Tensor]]
    describe: Callable[[ModelConfig, IdLayout], dict[str, Any]]
    load_kernels: Mapping[str, str]


def flat_inputs(args: ScoringArgs) -> list[torch.Tensor]:
    """The call's tensors in the order the exported graph takes them (lists unpacked in place)."""
    return [t for a in args for t in (a if isinstance(a, list | tuple) else (a,))]
