"""Multi-layer perceptrons for the dense towers."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Linear layers with ReLU between them; `final_activation` after the last one."""

    def __init__(self, in_features: int, widths: list[int], final_activation: bool = True) -> None:
        super().__init__()
        if not widths:
            raise ValueError("MLP needs at least one layer width")
        layers: list[nn.Module] = []
        for i, width in enumerate(widths):
            layers.append(nn.Linear(in_features, width))
            if i < len(widths) - 1 or final_activation:
                layers.append(nn.ReLU())
            in_features = width
        self.layers = nn.Sequential(*layers)
        self.out_features = widths[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
