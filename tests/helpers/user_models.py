"""User-side workload code for tests: a model and datasets defined outside gpuopt, reached through
`model._target_` / `data._target_` and trusted with `trust=[tests.*]`."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, get_worker_info


class TinyNet(nn.Module):
    """A user model with its own constructor arguments (not gpuopt's names)."""

    def __init__(self, features: int, classes: int, hidden: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        self.hidden = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NaNNet(nn.Module):
    """Returns NaN outputs from the first step: the loss diverges immediately."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * float("nan")


class BrokenNet(nn.Module):
    """Raises in forward: an ordinary bug in user code."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("user model bug: shapes do not line up")


class PidRecordingDataset(Dataset):
    """Vectors whose __getitem__ records which process produced it (a file per pid in `pid_dir`),
    so a test can see that DataLoader worker processes really ran."""

    def __init__(self, pid_dir: str, features: int = 8, classes: int = 3, size: int = 64) -> None:
        self.pid_dir = Path(pid_dir)
        self.features, self.classes, self.size = features, classes, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        info = get_worker_info()
        worker = info.id if info is not None else "main"
        (self.pid_dir / f"{os.getpid()}-{worker}").touch()
        generator = torch.Generator().manual_seed(index)
        return torch.randn(self.features, generator=generator), torch.tensor(index % self.classes)
