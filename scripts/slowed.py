"""A model whose training step is made a set share slower on purpose: the true difference of
scripts/bench_aa.py's power measurement (how often a real 10% is confirmed).

    model._target_=slowed.build +model.inner=gpuopt.workload.models.MLP +model.slowdown=0.1
    trust=[slowed.*]   (with scripts/ on PYTHONPATH)

Each forward sleeps `slowdown` x the work since the previous forward started (the whole previous
step: its backward, optimizer step and next batch), so a step takes (1 + slowdown) x its work:
throughput / (1 + slowdown). Sleeping leaves the cores to the other side of a pair.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from hydra.utils import get_class


class Slowed(torch.nn.Module):
    """`inner`, each step `slowdown` x its work slower."""

    def __init__(self, inner: torch.nn.Module, slowdown: float) -> None:
        super().__init__()
        self.inner, self.slowdown = inner, slowdown
        self._last: float | None = None
        self._slept = 0.0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        now = time.perf_counter()
        if self._last is not None:
            work = max(0.0, now - self._last - self._slept)
            self._slept = self.slowdown * work
            time.sleep(self._slept)
        self._last = now
        return self.inner(*args, **kwargs)


def build(inner: str, slowdown: float, **kwargs: Any) -> Slowed:
    """gpuopt's model `inner` (a class path) built from `kwargs`, made `slowdown` slower."""
    return Slowed(get_class(inner)(**kwargs), slowdown)
