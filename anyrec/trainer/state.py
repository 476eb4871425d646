"""Where training stands between two steps, as one `Stateful` object (torch.distributed.checkpoint's
`state_dict` / `load_state_dict` shape) that the checkpoint saves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepState:
    """Steps done (also the data position), batches skipped for a non-finite loss, and (in the
    state_dict) the RNG of rank `rank`."""

    rank: int
    step: int = 0
    skipped_batches: int = 0

    def state_dict(self) -> dict[str, Any]:
        # The data position is the step: every source's batch(step) is a pure function of it.
        return {"progress": torch.tensor([self.step, self.step, self.skipped_batches], dtype=torch.int64),
                "rng": {f"rank{self.rank}": torch.get_rng_state()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved; a state without this rank's RNG keeps the current one."""
        step, data_step, skipped = (int(x) for x in state["progress"])
        assert step == data_step, "the data position is the step"
        self.step, self.skipped_batches = step, skipped
        rng = state.get("rng", {}).get(f"rank{self.rank}")
        if rng is not None:
            torch.set_rng_state(rng)
