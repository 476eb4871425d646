"""An artifact's program called as its graph: what `anyrec-predict` scores with.

`ExportedProgram.module()` checks every call's inputs in Python before its graph runs: a forward pre-hook
flattens them with pytree and matches the tree against the exported one, then a guards function checks
each input's shape against the export's ranges, per input tensor (dense, then an ids and a bags tensor per
feature: 53 for 26 features): about 0.2 ms a call on a 2-core host, a fifth of dlrm_small's scoring time at
batch 256 (benchmarks/predict.py). `ScoringProgram`
binds the program's weights once and calls its graph with the inputs flat, after O(F) checks of the same
facts (feature count, dense width, dtypes, one bag per sample); the graph and so the scores are the same.

Legend: B batch, I dense features, F sparse features.
"""

from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.export.passes import move_to_device_pass

from anyrec.config import IdLayout


class ScoringProgram:
    """`program(dense_BI, ids, bags) -> logits_B` as the `.module()` of an exported scoring program computes
    it, without torch.export's per-call pytree and guard checks; a mismatched input is a one-line
    ValueError. The same inputs as the artifact's module: see `anyrec.serving.artifact`."""

    def __init__(self, program: torch.export.ExportedProgram, num_features: int, num_dense: int,
                 id_layout: IdLayout) -> None:
        self.num_features, self.num_dense, self.id_layout = num_features, num_dense, IdLayout(id_layout)
        specs = program.graph_signature.input_specs
        users = [i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT]
        # the graph's placeholders: the weights (parameters, buffers, constants), then dense, ids, bags
        if users != list(range(len(specs) - 1 - 2 * num_features, len(specs))):
            raise ValueError(f"the program takes {len(users)} inputs after its weights, not dense and "
                             f"{num_features} ids and bags tensors: not an anyrec scoring program")
        outputs = program.graph_signature.output_specs
        if [s.kind for s in outputs] != [OutputKind.USER_OUTPUT]:
            raise ValueError("the program's outputs are not one logits tensor: not an anyrec scoring program")
        state = {**program.state_dict, **program.constants}
        self._state = [state[s.target] for s in specs[:users[0]]]
        self._graph = program.graph_module
        self._program = program
        self.device = self._state[0].device if self._state else torch.device("cpu")

    def to(self, device: torch.device) -> ScoringProgram:
        """This program on `device` (its weights moved and the devices its graph names rewritten)."""
        if torch.device(device) == self.device:
            return self
        return ScoringProgram(move_to_device_pass(self._program, device), self.num_features, self.num_dense,
                              self.id_layout)

    def check(self, dense_BI: torch.Tensor, ids: list[torch.Tensor], bags: list[torch.Tensor]) -> None:
        """ValueError in one line unless the inputs are the program's: a [B, I] float32 dense tensor, and
        per feature a 1-D int64 ids tensor and an int64 bags tensor of B + 1 offsets (or B lengths)."""
        f = self.num_features
        if len(ids) != f or len(bags) != f:
            raise ValueError(f"inputs: {len(ids)} ids and {len(bags)} bags tensors, the program has {f} "
                             "sparse features")
        if dense_BI.dim() != 2 or dense_BI.shape[1] != self.num_dense or dense_BI.dtype != torch.float32:
            raise ValueError(f"inputs: dense is {dense_BI.dtype} {list(dense_BI.shape)}, the program takes "
                             f"float32 [batch, {self.num_dense}]")
        bag_shape = (dense_BI.shape[0] + (self.id_layout == IdLayout.offsets),)
        for i, (ids_N, bags_X) in enumerate(zip(ids, bags, strict=True)):
            if ids_N.dtype != torch.int64 or ids_N.dim() != 1 or bags_X.dtype != torch.int64 \
                    or bags_X.shape != bag_shape:
                raise ValueError(f"inputs: feature {i}: ids {ids_N.dtype} {list(ids_N.shape)} and bags "
                                 f"{bags_X.dtype} {list(bags_X.shape)}; the program takes 1-D int64 ids and "
                                 f"int64 bags of {bag_shape[0]} {self.id_layout} for a batch of "
                                 f"{dense_BI.shape[0]}")

    def __call__(self, dense_BI: torch.Tensor, ids: list[torch.Tensor],
                 bags: list[torch.Tensor]) -> torch.Tensor:
        self.check(dense_BI, ids, bags)
        (logits_B,) = self._graph(*self._state, dense_BI, *ids, *bags)
        return logits_B
