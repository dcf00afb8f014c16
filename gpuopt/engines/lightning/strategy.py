"""The distributed group under Lightning (`engine=lightning distributed=ddp | fsdp2`): which
Lightning strategy one rank's Trainer gets.

The ranks are gpuopt's, not Lightning's (gpuopt.trial.distributed starts them, as for the native
engine). Lightning detects the launcher's `TorchElasticEnvironment`, whose
`creates_processes_externally` keeps it from launching processes of its own (its DDP launcher
re-executes `sys.argv`, which under a Hydra multirun starts a new sweep per rank: Lightning
#11617, #18175, Hydra #2070), and leaves the group gpuopt set up as it is.

- `ddp` -> `DDPStrategy` with the DDP knobs as DistributedDataParallel's own arguments.
- `fsdp2` -> `ModelParallelStrategy` on a 1-D data-parallel mesh (its `FSDPStrategy` is FSDP1's
  wrapper class, another implementation). The sharding is the LightningModule's
  `configure_model` (`BuiltinModule` applies `_distributed.shard`); a user's LightningModule
  shards itself, so gpuopt's FSDP2 knobs cannot reach it. Lightning 2.6 reduces the gradients of
  every micro-batch under this strategy (its `block_backward_sync` skips only DDP's): what a
  Lightning FSDP2 job with accumulation costs.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from gpuopt.core.spec import TrialSpec
from gpuopt.engines._distributed import ddp_kwargs

# The data-parallel dimension of ModelParallelStrategy's device mesh.
DATA_PARALLEL = "data_parallel"


def lightning_strategy(spec: TrialSpec) -> str | Strategy:
    """The Trainer's `strategy`: `engine.strategy` for one process, else the distributed kind's."""
    conf = spec.distributed
    if conf.kind == "none":
        return spec.engine.strategy
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    backend = str(torch.distributed.get_backend()) if initialized else None
    timeout = datetime.timedelta(seconds=conf.timeout_s)
    if conf.kind == "ddp":
        return DDPStrategy(process_group_backend=backend, timeout=timeout, **ddp_kwargs(conf))
    return ModelParallelStrategy(
        data_parallel_size=conf.world_size,
        tensor_parallel_size=1,
        process_group_backend=backend,
        timeout=timeout,
    )


def trainer_devices(spec: TrialSpec, device: torch.device) -> dict[str, Any]:
    """The Trainer's accelerator, devices and num_nodes: the trial's one device, or for a
    distributed trial every rank's devices of this node (Lightning picks LOCAL_RANK's) over
    `nnodes` nodes, in the launcher's environment, named (inside a SLURM job too: not a guess)."""
    conf = spec.distributed
    if conf.kind != "none":
        return {
            "accelerator": device.type,
            "devices": conf.nproc_per_node,
            "num_nodes": conf.nnodes,
            "plugins": [TorchElasticEnvironment()],
        }
    if device.type == "cuda":
        return {"accelerator": "cuda", "devices": [device.index or 0]}
    return {"accelerator": device.type, "devices": 1}
