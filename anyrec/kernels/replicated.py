"""The fused embedding update rule for a replicated (data-parallel) table that gets a dense gradient.

A data-parallel table is a plain parameter on every rank; DDP all-reduces its gradient (averaged over
ranks, as torchrec averages sharded-table gradients) and this optimizer applies the rule, state layout
and learning rate a sharded copy would get inside the TBE backward, with the torch TBE path's own
arithmetic (`torch_tbe.apply_rows`): one implementation of each rule.

"Lazy" as in the fused kernels: only rows with a non-zero gradient move (their state included). A row
looked up whose summed gradient is exactly zero counts as not looked up; the fused kernels would still
decay Adam's moments for it, the one case where the two differ.
Legend: R rows, D dim, U rows updated this step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from anyrec.kernels.optimizers import OptimizerConfig, zero_state
from anyrec.kernels.torch_tbe import apply_rows


class ReplicatedTableOptimizer(torch.optim.Optimizer):
    """`opt`'s fused rule for dense-gradient tables [R, D]; `lr` lives in the param group (schedules)."""

    def __init__(self, params: Iterable[torch.Tensor], opt: OptimizerConfig) -> None:
        super().__init__(list(params), {"lr": opt.lr})
        self.rule = opt
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"a replicated table must be [rows, dim], got shape {tuple(p.shape)}")
                # state exists from the start: a checkpoint can load into it before the first step
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                self.state[p].update(zero_state(opt.kind, p.shape[0], p.numel(), p.device))

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ARG002 - torch.optim signature
        for group in self.param_groups:
            rule = dataclasses.replace(self.rule, lr=float(group["lr"]))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                g_RD = p.grad.to_dense() if p.grad.is_sparse else p.grad
                rows_U = (g_RD != 0).any(dim=1).nonzero().squeeze(1)
                if rows_U.numel() == 0:
                    continue
                dim = p.shape[1]
                addr_UD = rows_U[:, None] * dim + torch.arange(dim, device=p.device)
                placeholder = state["step"].new_zeros(0)
                apply_rows(p.data.view(-1), state.get("momentum1", placeholder),
                           state.get("momentum2", placeholder), state["step"], rows_U, addr_UD,
                           g_RD[rows_U].float(), rule, False)
