"""A workload whose speed is fixed by construction, for tests that assert an ordering of timings.

`FixedSpeedNet`'s forward sleeps `step_ms` plus `sample_us` per sample of its batch, then runs one
tiny linear layer (so the optimizer has weights to step). A training step of batch B then takes

    step_ms + B x sample_us  (+ what little CPU work the step and the loader add)

and its throughput B / step time rises with B by construction: a larger batch is faster, by a
margin (with the defaults: 32 -> ~960, 64 -> ~1,760, 256 -> ~4,600 samples/s) far wider than any
timing noise, and two configurations of the same batch read the same. The sleeping step leaves the
CPU idle, so other processes on the cores (a CPU burner, the other tests) hardly move it: pair it
with `data.sample_cost=0`, so the loader's CPU work stays a small share of the step.

Use it with `--config-dir tests/helpers/conf model=fixed_speed trust=[tests.helpers.fixed_speed.*]`
(FIXED_SPEED below), from the repository root (trial processes import `tests.helpers`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

CONF = Path(__file__).resolve().parent / "conf"
FIXED_SPEED = [
    "--config-dir",
    str(CONF),
    "model=fixed_speed",
    f"trust=[{__name__}.*]",
    "data.sample_cost=0",
]


def step_seconds(batch: int, step_ms: float = 30.0, sample_us: float = 100.0) -> float:
    """What one step of `batch` samples sleeps (conf/model/fixed_speed.yaml's defaults)."""
    return step_ms / 1e3 + batch * sample_us / 1e6


class FixedSpeedNet(nn.Module):
    """Sleeps a set time per step plus per sample in its forward; one linear layer."""

    def __init__(self, features: int, classes: int, step_ms: float, sample_us: float) -> None:
        super().__init__()
        self.linear = nn.Linear(features, classes)
        self.step_ms, self.sample_us = step_ms, sample_us

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(step_seconds(x.shape[0], self.step_ms, self.sample_us))
        return self.linear(x)
