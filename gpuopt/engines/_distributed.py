"""The engines' side of a distributed trial, inside one rank (the process group is already up:
gpuopt.trial.distributed started the rank and joined it): `Ranks.wrap` (DDP or FSDP2, before the
optimizer is built: FSDP2 replaces the parameters with sharded DTensors), `Ranks.no_sync`
(gradients reduced once per optimizer step), `Ranks.align` (every rank's window stops after the
same step: a rank that stopped one step early would leave the others waiting in a collective;
rank 0's verdict goes over a gloo group, so no device sync inside the window, also under NCCL),
and `Ranks.barrier` (the window's and the profiled window's steps start together).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpuopt.core.checks import check_module_patterns, matches_any
from gpuopt.core.spec import DistributedConf, TrialSpec
from gpuopt.trial.measure import StopRule

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The stop rule's verdicts, as the broadcast carries them.
VERDICTS = (None, "stable", "budget", "max_steps")


@dataclass
class Ranks:
    """This rank in a distributed trial."""

    conf: DistributedConf
    rank: int
    world: int
    device: torch.device
    host_group: Any  # gloo group for host-side agreement (the default one under gloo)
    model: torch.nn.Module | None = None  # the wrapped model, once built

    @classmethod
    def current(cls, spec: TrialSpec, device: torch.device) -> Ranks | None:
        if spec.distributed.kind == "none" or not dist.is_initialized():
            return None
        return cls.joined(spec.distributed, device)

    @classmethod
    def joined(cls, conf: DistributedConf, device: torch.device) -> Ranks:
        """This rank of the initialized group; host-side agreement over a gloo group."""
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(conf, dist.get_rank(), dist.get_world_size(), device, group)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model (on the device already) under DDP or FSDP2, as `distributed.kind` says."""
        from torch.distributed.device_mesh import init_device_mesh

        checkpoint(model, self.conf)
        if self.conf.kind == "ddp":
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=ids, **ddp_kwargs(self.conf)
            )
        else:
            shard(model, self.conf, init_device_mesh(self.device.type, (self.world,)))
        self.model = model
        return model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A micro-batch that only accumulates: its gradients are not reduced yet."""
        model = self.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            with model.no_sync():
                yield
            return
        setter = getattr(model, "set_requires_gradient_sync", None)
        if setter is None:
            yield
            return
        setter(False)
        try:
            yield
        finally:
            setter(True)

    def mean(self, values: list[float]) -> list[float]:
        """Each value averaged over the ranks (one all-reduce on the job's own backend)."""
        summed = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        return [float(v) / self.world for v in summed.tolist()]

    def barrier(self) -> None:
        """Every rank here before any goes on (host-side, over the gloo group)."""
        dist.barrier(group=self.host_group)

    def align(self, rule: StopRule) -> AgreedStop:
        """The rule every rank obeys alike."""
        return AgreedStop(rule, self)

    def verdict(self, mine: str | None) -> str | None:
        """Rank 0's verdict, on every rank (a host-side broadcast)."""
        code = torch.tensor([VERDICTS.index(mine) if self.leader else 0], dtype=torch.int64)
        dist.broadcast(code, src=0, group=self.host_group)
        return VERDICTS[int(code.item())]


def shard(model: torch.nn.Module, conf: DistributedConf, mesh: Any) -> None:
    """FSDP2 on `model` over a 1-D data-parallel device mesh: the children `shard_modules` selects
    one by one, bottom-up (a nested match before the block holding it), then the root. The one
    mapping of the FSDP2 knobs, for both engines."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param = DTYPES[conf.param_dtype] if conf.param_dtype else None
    reduce = DTYPES[conf.reduce_dtype] if conf.reduce_dtype else None
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": conf.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce),
    }
    for child in reversed(_named_children(model, conf.shard_modules, "distributed.shard_modules")):
        fully_shard(child, **options)
    fully_shard(model, **options)


def ddp_kwargs(conf: DistributedConf) -> dict[str, Any]:
    """The DDP knobs as DistributedDataParallel's keyword arguments (both engines)."""
    return {
        "bucket_cap_mb": conf.bucket_cap_mb,
        "gradient_as_bucket_view": conf.gradient_as_bucket_view,
        "static_graph": conf.static_graph,
        "find_unused_parameters": conf.find_unused_parameters,
    }


def checkpoint(model: torch.nn.Module, conf: DistributedConf) -> None:
    """`checkpoint_modules`: each named child recomputes its forward in the backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    names = list(conf.checkpoint_modules)
    if not _named_children(model, names, "distributed.checkpoint_modules"):
        return
    apply_activation_checkpointing(model, check_fn=lambda m: matches_any(type(m).__name__, names))


def _named_children(model: torch.nn.Module, names: list[str], key: str) -> list[torch.nn.Module]:
    """The submodules whose class matches a pattern of `names`; a pattern matching none is one
    ConfigError naming the classes there are."""
    if not names:
        return []
    children = [m for m in model.modules() if m is not model]
    check_module_patterns(key, names, [type(m).__name__ for m in children])
    return [m for m in children if matches_any(type(m).__name__, names)]


class AgreedStop:
    """The stop rule as every rank applies it: checked at the same step counts on every rank (the
    window meter's schedule, never a clock's: the clocks differ), rank 0's verdict broadcast."""

    def __init__(self, rule: StopRule, ranks: Ranks) -> None:
        self.rule, self.ranks = rule, ranks
        self.min_steps = 1  # the meter's first check: every step until its schedule spreads
        self.max_steps = rule.max_steps
        self.time_budget_s = math.inf  # never a clock-driven check (the ranks' clocks differ)

    def check(
        self, step_times: Sequence[float], elapsed_s: float, steps: int | None = None
    ) -> str | None:
        mine = self.rule.check(step_times, elapsed_s, steps) if self.ranks.leader else None
        return self.ranks.verdict(mine)
