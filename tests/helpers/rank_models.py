"""User models that fail on one rank of a distributed trial (tests/test_distributed.py): the rank
is the launcher's `RANK`, the failure comes at the model's `at_call`-th forward (inside the timed
window for the tiny trials of the tests)."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn


class FailingOnRank(nn.Module):
    """A small MLP whose rank `fail_rank` fails at its `at_call`-th forward, the way `how` says:
    raise (a bug), oom (a real allocation the host cannot make), kill (SIGKILL to itself, after a
    line on stderr), hang (sleeps: the other ranks' collectives time out)."""

    def __init__(self, features: int, classes: int, fail_rank: int, how: str, at_call: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))
        self.fail_rank, self.how, self.at_call = fail_rank, how, at_call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call and int(os.environ.get("RANK", "-1")) == self.fail_rank:
            self.fail()
        return self.net(x)

    def fail(self) -> None:
        rank = os.environ["RANK"]
        if self.how == "raise":
            raise ValueError(f"a bug on rank {rank}")
        if self.how == "oom":
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the CPU allocator fails
        if self.how == "kill":
            print(f"rank {rank} is about to be killed", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "hang":
            time.sleep(3600)
