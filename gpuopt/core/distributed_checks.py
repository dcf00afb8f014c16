"""The checks of the distributed group (`distributed=ddp | fsdp2`, docs/distributed.md), torch-free,
each raising one `ConfigError`: its values (`check_distributed_values`, from
gpuopt.core.checks.check_values), and what it needs from the device, against torch's answers
(`check_distributed_device`, from gpuopt.trial.devices.trial_device) or against facts
(`check_distributed_facts`, from gpuopt.core.checks.check_device_facts); what a user's own
LightningModule allows under `fsdp2` (`check_lightning_module_sharding`, from
gpuopt.engines.registry.load_spec once the model's class is imported); and, once a model exists,
the module patterns of `shard_modules` / `checkpoint_modules` against its submodules' classes
(`check_module_patterns`).
"""

from __future__ import annotations

import fnmatch
import re

from omegaconf import DictConfig, OmegaConf

from gpuopt.core.errors import ConfigError, check_choice, check_min
from gpuopt.core.spec import (
    DISTRIBUTED_BACKENDS,
    DISTRIBUTED_KINDS,
    SHARD_DTYPES,
    DistributedConf,
    EngineConf,
)


def check_distributed_values(dist: DistributedConf, engine: EngineConf) -> None:
    """The distributed group's values (what needs the device: `check_device_facts`)."""
    check_choice("distributed.kind", dist.kind, DISTRIBUTED_KINDS)
    check_choice("distributed.backend", dist.backend, DISTRIBUTED_BACKENDS)
    check_min("distributed.nproc_per_node", dist.nproc_per_node, 1, "an integer >= 1")
    check_min("distributed.nnodes", dist.nnodes, 1, "an integer >= 1")
    if dist.kind == "none":
        return
    if engine.name == "lightning" and engine.strategy != "auto":  # the kind picks the strategy
        raise ConfigError(
            "engine.strategy",
            engine.strategy,
            f"auto with distributed={dist.kind} (the distributed group sets Lightning's strategy)",
        )
    if not dist.timeout_s > 0:
        raise ConfigError("distributed.timeout_s", dist.timeout_s, "seconds > 0")
    if not dist.bucket_cap_mb > 0:
        raise ConfigError("distributed.bucket_cap_mb", dist.bucket_cap_mb, "megabytes > 0")
    for key in ("param_dtype", "reduce_dtype"):
        value = getattr(dist, key)
        if value is not None:
            check_choice(f"distributed.{key}", value, SHARD_DTYPES)
    if dist.nnodes > 1:  # each node's trial would merge only its own ranks' results
        raise ConfigError(
            "distributed.nnodes", dist.nnodes, "1 (several nodes per trial: not supported yet)"
        )
    if dist.rdzv_endpoint is not None and not ENDPOINT_PATTERN.match(dist.rdzv_endpoint):
        raise ConfigError("distributed.rdzv_endpoint", dist.rdzv_endpoint, "null or host:port")


ENDPOINT_PATTERN = re.compile(r"^[\w.\-]+:\d{1,5}$")
# The FSDP2 knobs gpuopt applies in its own configure_model (gpuopt.engines.lightning.strategy),
# which a user's LightningModule replaces with its own.
LIGHTNING_MODULE_FSDP2_KEYS = (
    "reshard_after_forward",
    "param_dtype",
    "reduce_dtype",
    "shard_modules",
    "checkpoint_modules",
)


def check_lightning_module_sharding(
    dist: DistributedConf, module: str, own_configure_model: bool
) -> None:
    """`distributed=fsdp2` under engine=lightning for the user's own LightningModule `module`
    (Lightning's ModelParallelStrategy): the module shards itself in its configure_model, so it
    must have one, and gpuopt's FSDP2 knobs, which only gpuopt's configure_model applies, must keep
    their defaults."""
    if dist.kind != "fsdp2":
        return
    if not own_configure_model:
        raise ConfigError(
            "distributed.kind",
            dist.kind,
            f"none | ddp for {module} (fsdp2 under engine=lightning: a LightningModule applies "
            "fully_shard in its own configure_model, or a plain nn.Module that gpuopt shards)",
        )
    defaults = DistributedConf()
    for key in LIGHTNING_MODULE_FSDP2_KEYS:
        value = getattr(dist, key)
        if value != getattr(defaults, key):
            raise ConfigError(
                f"distributed.{key}",
                value,
                f"{getattr(defaults, key)} for {module} (its own configure_model shards it)",
            )


def check_distributed_device(
    dist: DistributedConf, device_type: str, cuda_devices: int, bf16: bool
) -> None:
    """What the distributed group needs from the device (the trial's `trial_device` with torch,
    `check_device_facts` with facts): NCCL only on CUDA, no more ranks per node than GPUs, no bf16
    shards where the device has no bf16."""
    if dist.kind == "none":
        return
    if dist.backend == "nccl" and device_type != "cuda":
        raise ConfigError(
            "distributed.backend", "nccl", f"auto | gloo on {device_type} (NCCL needs CUDA GPUs)"
        )
    if device_type == "cuda" and dist.nproc_per_node > cuda_devices:
        raise ConfigError(
            "distributed.nproc_per_node",
            dist.nproc_per_node,
            f"1 to {cuda_devices} here (one rank per visible GPU)",
        )
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(dist, key) == "bf16" and not bf16:
            raise ConfigError(
                f"distributed.{key}", "bf16", f"fp32 | fp16 | null on this {device_type} (no bf16)"
            )


def check_distributed_facts(cfg: DictConfig, resolved: str, cuda: int, sm80: bool) -> None:
    """`check_distributed_device` from facts (bf16 on CUDA: compute capability >= 8.0; a CPU's
    emulated bf16 runs, only slowly: the search trims it)."""
    node = OmegaConf.select(cfg, "distributed", default=None)
    if node is None:
        return
    dist = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DistributedConf), node))
    assert isinstance(dist, DistributedConf)
    device_type = resolved.split(":")[0]
    check_distributed_device(dist, device_type, cuda, sm80 or device_type != "cuda")


# The most class names a "no submodule matches" error lists (a Hugging Face model has dozens).
MAX_NAMED_CLASSES = 24


def check_module_patterns(key: str, patterns: list[str], classes: list[str]) -> None:
    """`distributed.shard_modules` / `checkpoint_modules` against the class names of the model's
    submodules (the root excluded): each pattern (a class name or an fnmatch pattern such as
    `*Block`) must match one, else one ConfigError naming the key, the patterns matching nothing and
    the classes there are. It needs the built model, so it runs where the model exists (in each
    rank; before the ranks for gpuopt's built-in models: gpuopt.trial.distributed)."""
    names = sorted(set(classes))
    unmatched = [p for p in patterns if not any(matches_any(n, [p]) for n in names)]
    if not unmatched:
        return
    shown = names[:MAX_NAMED_CLASSES] + (["..."] if len(names) > MAX_NAMED_CLASSES else [])
    raise ConfigError(
        key,
        unmatched,
        "class names or fnmatch patterns of the model's submodules: "
        + (", ".join(shown) or "none (the model has no submodules)"),
    )


def matches_any(name: str, patterns: list[str]) -> bool:
    """Whether a submodule's class name is one `check_module_patterns` accepted patterns select."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
