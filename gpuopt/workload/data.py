"""Synthetic datasets shaped for the built-in models, with real per-sample CPU work.

Each sample is generated deterministically from (seed, index), so every worker process, every run
and every machine sees the same data. `__getitem__` also does real numpy work proportional to
`sample_cost` (a stand-in for decoding and augmentation): without it an input pipeline would cost
nothing and DataLoader workers could not matter.

Calibration (2-core AMD EPYC VM, numpy 2.4, one core, 2026-11-30): the work processes
WORK_ELEMENTS_PER_COST float32 elements per unit of cost at ~6-8 ns/element. sample_cost=1.0 measured
0.10 ms per sample on a quiet machine (mean of 3000 calls) and 0.14 ms (best of 15 x 200 calls) with
other jobs on the cores. Generating the sample itself costs, at sample_cost=0 (best of 15 x 200):
vectors (256,) 0.11 ms, images (3,32,32) 0.33 ms, tokens (128,) 0.07 ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

KINDS = ("vectors", "images", "tokens")
# float32 elements of "decode" work per unit of sample_cost: ~0.1 ms on one core of the dev machine.
WORK_ELEMENTS_PER_COST = 16384
# Padding around an image before the random crop (as in the classic CIFAR augmentation).
CROP_PADDING = 4


def _cpu_work(rng: np.random.Generator, sample_cost: float) -> float:
    """Real CPU work: fill a buffer, a transcendental pass, a scale, a reduction."""
    n = int(sample_cost * WORK_ELEMENTS_PER_COST)
    if n <= 0:
        return 0.0
    buf = rng.random(n, dtype=np.float32)
    np.tanh(buf, out=buf)
    np.multiply(buf, 0.5, out=buf)
    return float(buf.sum())


class SyntheticDataset(Dataset):
    """`size` samples of one kind:

    - vectors: float32 (D,) inputs, an int64 class target in [0, num_classes)
    - images: float32 (C, H, W) inputs after a random crop (from a padded image) and random
      horizontal flip, an int64 class target
    - tokens: int64 (T,) token ids in [0, num_classes) and the (T,) next-token targets
    """

    def __init__(
        self,
        kind: str,
        shape: Sequence[int] | int,
        num_classes: int,
        size: int = 262144,
        sample_cost: float = 1.0,
        seed: int = 0,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"data.kind={kind!r}; allowed: {' | '.join(KINDS)}")
        self.kind = kind
        self.shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        expected_rank = {"vectors": 1, "images": 3, "tokens": 1}[kind]
        if len(self.shape) != expected_rank:
            raise ValueError(
                f"data.shape={list(self.shape)!r}: {kind} need {expected_rank} dimension(s)"
            )
        if num_classes < 1 or size < 1 or sample_cost < 0:
            raise ValueError(
                f"num_classes ({num_classes}) and size ({size}) must be >= 1, sample_cost "
                f"({sample_cost}) >= 0"
            )
        self.num_classes = int(num_classes)
        self.size = int(size)
        self.sample_cost = float(sample_cost)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        rng = np.random.default_rng((self.seed, index))
        _cpu_work(rng, self.sample_cost)
        if self.kind == "tokens":
            (length,) = self.shape
            sequence = rng.integers(0, self.num_classes, length + 1, dtype=np.int64)
            return torch.from_numpy(sequence[:-1].copy()), torch.from_numpy(sequence[1:].copy())
        target = torch.tensor(int(rng.integers(0, self.num_classes)), dtype=torch.int64)
        if self.kind == "vectors":
            return torch.from_numpy(rng.standard_normal(self.shape, dtype=np.float32)), target
        channels, height, width = self.shape
        padded = rng.standard_normal(
            (channels, height + 2 * CROP_PADDING, width + 2 * CROP_PADDING), dtype=np.float32
        )
        top, left = rng.integers(0, 2 * CROP_PADDING + 1, size=2)
        image = padded[:, top : top + height, left : left + width]
        if rng.random() < 0.5:
            image = image[:, :, ::-1]
        return torch.from_numpy(np.ascontiguousarray(image)), target
