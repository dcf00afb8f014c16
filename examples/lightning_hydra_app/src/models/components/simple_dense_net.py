"""The network, apart from its training logic (as in lightning-hydra-template)."""

from __future__ import annotations

import torch
from torch import nn


class SimpleDenseNet(nn.Module):
    def __init__(self, input_size: int = 64, hidden: int = 128, output_size: int = 10) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)
