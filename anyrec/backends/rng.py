"""The random generators a random op on a device draws from, read and set for a replay (recomputing a
dropout in the backward draws the forward's mask again): the host's and, off the CPU, the device's own,
through its device module (CUDA, ROCm's under the same name, a plugin's registered one)."""

from __future__ import annotations

import torch

# (device, generator state): the host generator's, and the tensors' device's where it has its own
RngStates = list[tuple[torch.device, torch.Tensor]]


def rng_states(device: torch.device) -> RngStates:
    """The generators a random op on `device` may draw from: the host's and, off the CPU, the device's
    (its device module's, as torch.utils.checkpoint reads it)."""
    states = [(torch.device("cpu"), torch.get_rng_state())]
    if device.type != "cpu":
        states.append((device, torch.get_device_module(device).get_rng_state(device)))
    return states


def set_rng_states(states: RngStates) -> None:
    """Set each generator of `states` (as rng_states read them)."""
    for device, state in states:
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.get_device_module(device).set_rng_state(state, device)
