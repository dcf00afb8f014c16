"""User models for the numerics guard's tests (trusted with `trust=[tests.*]`); they take the
built-in MLP's constructor arguments, so `model._target_=...` swaps them into conf/model/mlp.yaml."""

from __future__ import annotations

import torch
from torch import nn


class LossyHalfNet(nn.Module):
    """A user model with a broken low-precision path: under autocast (fp16/bf16) its forward
    drops the input, so it can learn only the label marginal while fp32 learns the teacher."""

    def __init__(self, in_features: int, out_features: int, width: int = 32, **_: object) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, out_features)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = torch.zeros_like(x)  # the half-precision path loses the signal
        return self.net(x)


class LoudNet(nn.Module):
    """Logits scaled up a lot: under fp16 loss scaling the first steps overflow and are skipped."""

    def __init__(self, in_features: int, out_features: int, gain: float = 1e4, **_: object) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.gain


class SampleStream(torch.utils.data.IterableDataset):
    """The synthetic dataset as a stream (an IterableDataset): it trains, but it has no first
    samples to draw fixed batches from, so the numerics guard cannot run on it."""

    def __init__(self, **kwargs: object) -> None:
        from gpuopt.workload.data import SyntheticDataset

        self.samples = SyntheticDataset(**kwargs)

    def __iter__(self):
        return (self.samples[i] for i in range(len(self.samples)))
