"""The distributed group under Lightning (`engine=lightning distributed=ddp | fsdp2`): which
Lightning strategy one rank's Trainer gets, and how gpuopt's knobs map onto it.

The ranks are gpuopt's, not Lightning's: the trial's process starts them with torch.distributed's
elastic launcher and each joins the process group before the engine runs
(gpuopt.trial.distributed, the same start as the native engine's). In each rank Lightning detects
its `TorchElasticEnvironment` (the launcher's RANK / WORLD_SIZE / LOCAL_RANK / TORCHELASTIC_RUN_ID),
whose `creates_processes_externally` keeps Lightning from launching processes of its own (its DDP
launcher re-executes `sys.argv`, which under a Hydra multirun starts a new sweep per rank:
Lightning #11617, #18175, Hydra #2070), and `_init_dist_connection` leaves the group gpuopt set up
(its short timeout, its backend) as it is. The Trainer gets `devices=nproc_per_node` and
`num_nodes=nnodes`, which Lightning checks against the launcher's world size.

- `ddp` -> `DDPStrategy` with the DDP knobs as DistributedDataParallel's own arguments
  (bucket_cap_mb, gradient_as_bucket_view, static_graph, find_unused_parameters); Lightning skips
  the all-reduce of the micro-batches that only accumulate (`no_sync`), as the native engine does.
- `fsdp2` -> `ModelParallelStrategy` with a 1-D data-parallel mesh of the world size
  (tensor_parallel_size=1): Lightning's strategy for FSDP2's `fully_shard` (its `FSDPStrategy`
  is FSDP1's wrapper class, another implementation: not called fsdp2 here). The sharding itself is
  the LightningModule's `configure_model`: for a plain `nn.Module` gpuopt's `BuiltinModule` applies
  `gpuopt.engines._distributed.shard` on the mesh's DATA_PARALLEL dimension (the native
  engine's one mapping of shard_modules, reshard_after_forward, param_dtype / reduce_dtype); a
  user's LightningModule shards itself in its own configure_model, so gpuopt's FSDP2
  knobs cannot reach it (one-line errors: gpuopt.core.checks). Lightning 2.6 reduces
  the gradients of every micro-batch under this strategy (its `block_backward_sync` skips only
  DDP's): what a Lightning FSDP2 job with accumulation costs.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from gpuopt.core.spec import DistributedConf, TrialSpec

# The data-parallel dimension of ModelParallelStrategy's device mesh.
DATA_PARALLEL = "data_parallel"


def ddp_kwargs(conf: DistributedConf) -> dict[str, Any]:
    """The DDP knobs as DistributedDataParallel's keyword arguments (DDPStrategy passes them on)."""
    return {
        "bucket_cap_mb": conf.bucket_cap_mb,
        "gradient_as_bucket_view": conf.gradient_as_bucket_view,
        "static_graph": conf.static_graph,
        "find_unused_parameters": conf.find_unused_parameters,
    }


def lightning_strategy(spec: TrialSpec) -> str | Strategy:
    """The Trainer's `strategy`: `engine.strategy` for one process, else the distributed kind's,
    on the backend of the process group the rank's start initialized."""
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
    """The Trainer's accelerator, devices and num_nodes: one device for one process (the trial's);
    for a distributed trial every rank's devices of this node (Lightning picks LOCAL_RANK's, the
    device gpuopt's rank start set) over `nnodes` nodes, in the launcher's environment, named
    (Lightning would pick it first too, also inside a SLURM job; named, it is not a guess)."""
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
