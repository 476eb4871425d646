"""An artifact's program called as its graph: what `anyrec-predict` scores with.

`ExportedProgram.module()` checks every call's inputs in Python before its graph runs: a forward pre-hook
flattens them with pytree and matches the tree against the exported one, then a guards function checks
each input's shape against the export's ranges, per input tensor (dense, then an ids and a bags tensor per
feature: 53 for 26 features): about 0.2 ms a call on a 2-core host, a fifth of dlrm_small's scoring time at
batch 256 (benchmarks/predict.py). `ScoringProgram`
binds the program's weights once and calls its graph with the inputs flat, after the family's checks of
the same facts (DLRM: feature count, dense width, dtypes, one bag per sample, O(F); DLRMv4 its jagged
inputs' shapes and values); the graph and so the scores are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.export.passes import move_to_device_pass

from anyrec.models.scoring import ScoringArgs, flat_inputs


class ScoringProgram:
    """`program(*args) -> logits` as the `.module()` of an exported scoring program computes it, without
    torch.export's per-call pytree and guard checks: `check(args)` (the family's, `ExportSignature.check`)
    refuses a mismatched call in one ValueError line first. The same arguments as the artifact's module:
    see `anyrec.serving.artifact` and the family's export signature."""

    def __init__(self, program: torch.export.ExportedProgram, num_inputs: int,
                 check: Callable[[ScoringArgs], None]) -> None:
        self.num_inputs, self.check = num_inputs, check
        specs = program.graph_signature.input_specs
        users = [i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT]
        # the graph's placeholders: the weights (parameters, buffers, constants), then the call's tensors
        if users != list(range(len(specs) - num_inputs, len(specs))):
            raise ValueError(f"the program takes {len(users)} inputs after its weights, not the {num_inputs} "
                             "of its model's scoring call: not an anyrec scoring program")
        outputs = program.graph_signature.output_specs
        if [s.kind for s in outputs] != [OutputKind.USER_OUTPUT]:
            raise ValueError("the program's outputs are not one logits tensor: not an anyrec scoring program")
        state = {**program.state_dict, **program.constants}
        self._state = [state[s.target] for s in specs[:users[0]]] if users else []
        self._graph = program.graph_module
        self._program = program
        self.device = self._state[0].device if self._state else torch.device("cpu")

    def to(self, device: torch.device) -> ScoringProgram:
        """This program on `device` (its weights moved and the devices its graph names rewritten)."""
        if torch.device(device) == self.device:
            return self
        return ScoringProgram(move_to_device_pass(self._program, device), self.num_inputs, self.check)

    def __call__(self, *args: Any) -> torch.Tensor:
        self.check(args)
        (logits,) = self._graph(*self._state, *flat_inputs(args))
        return logits
