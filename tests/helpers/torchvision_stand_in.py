"""A stand-in for the torchvision names the third-party apps in tests import (`datasets.MNIST`,
`transforms.Compose`, `ToTensor`, `Normalize`): `install()` puts them in `sys.modules` as
`torchvision`, `torchvision.datasets`, `torchvision.transforms` and
`torchvision.transforms.transforms`. The only torchvision wheel reachable here is a CUDA build
whose C ops do not load against the CPU torch. The images are 28x28 uint8, a deterministic
function of their index and split, labels 0-9; nothing is downloaded. Install it after Lightning
is imported where Lightning is used (its torchmetrics would take it for the real torchvision).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset


class MNIST(Dataset):
    """`MNIST(root, train, transform, download)`: 60,000 train / 10,000 test synthetic digits."""

    def __init__(
        self, root: str, train: bool = True, transform: Any = None, download: bool = False
    ) -> None:
        self.train, self.transform = train, transform
        self.size = 60_000 if train else 10_000

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, int]:
        seed = index * 2 + (0 if self.train else 1)
        generator = torch.Generator().manual_seed(seed)
        image = torch.randint(0, 256, (28, 28), dtype=torch.uint8, generator=generator)
        return (self.transform(image) if self.transform else image), seed % 10


class Compose:
    def __init__(self, steps: Sequence[Callable[[Any], Any]]) -> None:
        self.steps = list(steps)

    def __call__(self, image: Any) -> Any:
        for step in self.steps:
            image = step(image)
        return image


class ToTensor:
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.to(torch.float32).div(255).unsqueeze(0)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std


def _module(name: str, **names: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(names)
    return module


def install() -> None:
    names = {"Compose": Compose, "ToTensor": ToTensor, "Normalize": Normalize}
    inner = _module("torchvision.transforms.transforms", **names)
    transforms = _module("torchvision.transforms", transforms=inner, **names)
    datasets = _module("torchvision.datasets", MNIST=MNIST)
    top = _module("torchvision", datasets=datasets, transforms=transforms)
    for module in (top, datasets, transforms, inner):
        sys.modules.setdefault(module.__name__, module)
