"""The values of a typed config (`check_values`): ranges and allowed names of every group, and what
types cannot say across groups; and the measuring API's settings (`measure_conf`).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

from omegaconf import OmegaConf

from gpuopt.core.errors import (
    ConfigError,
    check_choice,
    check_min,
    check_per_cpu,
    to_schema,
)
from gpuopt.core.spec import (
    COMPILE_MODES,
    DEVICE_PATTERN,
    DISTRIBUTED_BACKENDS,
    DISTRIBUTED_KINDS,
    EMPTY_CACHE_POLICIES,
    ENGINES,
    LIGHTNING_INSTALL_HINT,
    LIGHTNING_PRECISIONS,
    LR_SCALING_RULES,
    OPTIMIZERS,
    PRECISIONS,
    SHARD_DTYPES,
    DistributedConf,
    EngineConf,
    GpuoptConf,
    MeasureConf,
    OptimizerConf,
    ProfileConf,
)

ALLOC_CONF_PATTERN = re.compile(r"^\w+:[^,:]+(,\w+:[^,:]+)*$")
ENDPOINT_PATTERN = re.compile(r"^[\w.\-]+:\d{1,5}$")


def _positive(key: str, value: float, allowed: str) -> None:
    if not value > 0:  # NaN too
        raise ConfigError(key, value, allowed)


def check_values(typed: GpuoptConf, cpus: int) -> None:
    """Every group's values on `cpus` usable cores (the caps on workers, threads and ranks)."""
    _check_scalars(typed, cpus)
    _check_engine(typed.engine)
    _check_distributed(typed.distributed, typed.engine)
    nproc = typed.distributed.nproc_per_node
    check_per_cpu("distributed.nproc_per_node", nproc, 1, cpus, "ranks")
    _check_train(typed)


def _check_scalars(typed: GpuoptConf, cpus: int) -> None:
    """Ranges and names of the typed groups (loader, precision, ..., measure)."""
    loader = typed.loader
    check_min("loader.batch_size", loader.batch_size, 1, "an integer >= 1")
    check_per_cpu("loader.num_workers", loader.num_workers, 0, cpus, "worker processes")
    if loader.prefetch_factor is not None:
        check_min("loader.prefetch_factor", loader.prefetch_factor, 1, "null or an integer >= 1")
    check_choice("precision.mode", typed.precision.mode, PRECISIONS)
    check_choice("compile.mode", typed.compile.mode, COMPILE_MODES)
    check_choice("cache.empty_cache", typed.cache.empty_cache, EMPTY_CACHE_POLICIES)
    check_min("cache.every_n_steps", typed.cache.every_n_steps, 1, "an integer >= 1")
    alloc = typed.cache.cuda_alloc_conf
    if alloc is not None and not ALLOC_CONF_PATTERN.match(alloc):
        raise ConfigError(
            "cache.cuda_alloc_conf",
            alloc,
            "null or key:value[,key:value] (PYTORCH_CUDA_ALLOC_CONF)",
        )
    _check_optimizer(typed.optimizer)
    if not DEVICE_PATTERN.match(str(typed.device.type)):
        raise ConfigError("device.type", typed.device.type, "auto | cpu | cuda | cuda:N | mps")
    if typed.device.num_threads is not None:
        check_per_cpu("device.num_threads", typed.device.num_threads, 1, cpus, "threads")
    _check_measure(typed.measure)
    _check_profile(typed.profile)
    check_min("seed", typed.seed, 0, "an integer >= 0")
    if not typed.output_dir:
        raise ConfigError("output_dir", typed.output_dir, "a directory path")


def _check_train(typed: GpuoptConf) -> None:
    """train.global_batch: a multiple of the micro-batch, agreeing with
    engine.accumulate_grad_batches when that is set too; the guard's knobs."""
    global_batch, micro = typed.train.global_batch, typed.loader.batch_size
    world = typed.distributed.world_size
    if global_batch is not None:
        step = micro * world  # one micro-batch on every rank
        if global_batch < 1 or global_batch % step:
            multiples = ", ".join(str(step * n) for n in range(1, 5))
            ranks = f" x {world} ranks" if world > 1 else ""
            raise ConfigError(
                "train.global_batch",
                global_batch,
                f"null or a multiple of loader.batch_size ({micro}){ranks}: {multiples}, ... "
                "(or a loader.batch_size that divides it)",
            )
        accumulate = typed.engine.accumulate_grad_batches
        if typed.engine.name == "lightning" and accumulate not in (1, global_batch // step):
            per_rank = " x world size" if world > 1 else ""
            raise ConfigError(
                "engine.accumulate_grad_batches",
                accumulate,
                f"1 or {global_batch // step} (train.global_batch / loader.batch_size{per_rank})",
            )
    guard = typed.guard
    check_min("guard.steps", guard.steps, 2, "an integer >= 2")
    if guard.global_batch is not None:
        check_min("guard.global_batch", guard.global_batch, 1, "null or >= 1")
    _positive("guard.loss_tolerance", guard.loss_tolerance, "a relative drift > 0")


def _check_optimizer(optimizer: OptimizerConf) -> None:
    check_choice("optimizer.name", optimizer.name, OPTIMIZERS)
    check_choice("optimizer.lr_scaling", optimizer.lr_scaling, LR_SCALING_RULES)
    if optimizer.reference_batch is not None:
        check_min("optimizer.reference_batch", optimizer.reference_batch, 1, "null or >= 1")
    check_min("optimizer.lr", optimizer.lr, 0.0, "a learning rate >= 0")
    check_min("optimizer.weight_decay", optimizer.weight_decay, 0.0, "a number >= 0")
    check_min("optimizer.momentum", optimizer.momentum, 0.0, "a number >= 0")
    if optimizer.fused and optimizer.foreach:
        raise ConfigError(
            "optimizer.fused", True, "false or null when optimizer.foreach=true (pick one)"
        )


def _check_profile(profile: ProfileConf) -> None:
    check_min("profile.steps", profile.steps, 1, "an integer >= 1")
    if profile.max_s is not None:
        _positive("profile.max_s", profile.max_s, "seconds > 0, or null (always steps)")
    check_min("profile.warmup_steps", profile.warmup_steps, 0, "an integer >= 0")
    check_min("profile.top_ops", profile.top_ops, 0, "an integer >= 0")


def _check_measure(measure: MeasureConf) -> None:
    check_min("measure.warmup_steps", measure.warmup_steps, 0, "an integer >= 0")
    check_min("measure.min_steps", measure.min_steps, 2, "an integer >= 2")
    if measure.max_steps < measure.min_steps:
        raise ConfigError(
            "measure.max_steps", measure.max_steps, f">= measure.min_steps ({measure.min_steps})"
        )
    _positive("measure.time_budget_s", measure.time_budget_s, "seconds > 0")
    if not measure.min_time_s >= 0:
        raise ConfigError("measure.min_time_s", measure.min_time_s, "seconds >= 0")
    if not 0 < measure.stability_target < 1:
        raise ConfigError(
            "measure.stability_target", measure.stability_target, "a fraction in (0, 1), e.g. 0.03"
        )
    check_min("measure.ceiling_steps", measure.ceiling_steps, 1, "an integer >= 1")
    _positive("measure.nvml_interval_s", measure.nvml_interval_s, "seconds > 0")


def measure_conf(value: MeasureConf | dict[str, Any] | str | None = None) -> MeasureConf:
    """A validated `MeasureConf` from a preset name of conf/measure/ (`"quick"`), a mapping of its
    fields (the others default), or a MeasureConf; raises ConfigError."""
    if isinstance(value, str):
        from importlib.resources import files

        presets = files("gpuopt.conf") / "measure"
        names = sorted(p.name.removesuffix(".yaml") for p in presets.iterdir())
        if value not in names:
            raise ConfigError("measure", value, " | ".join(names) + " (conf/measure/), or a dict")
        value = OmegaConf.to_container(OmegaConf.create((presets / f"{value}.yaml").read_text()))
    if value is None:
        conf = MeasureConf()
    elif isinstance(value, MeasureConf):
        conf = value
    else:
        conf = to_schema(MeasureConf, dict(value), "measure.")
    _check_measure(conf)
    return conf


def _check_engine(engine: EngineConf) -> None:
    """The engine name, its knobs, and (for lightning) that the optional extra is installed."""
    check_choice("engine.name", engine.name, ENGINES)
    if engine.name != "lightning":
        return
    # find_spec is cheap (no `import lightning`, which takes seconds) and returns None when the
    # package is absent (or masked with sys.modules["lightning"] = None).
    if importlib.util.find_spec("lightning") is None:
        raise ConfigError(
            "engine.name",
            engine.name,
            f"native, or install the Lightning extra first: {LIGHTNING_INSTALL_HINT}",
        )
    if engine.precision is not None:
        check_choice("engine.precision", engine.precision, LIGHTNING_PRECISIONS)
    check_min(
        "engine.accumulate_grad_batches", engine.accumulate_grad_batches, 1, "an integer >= 1"
    )
    if engine.gradient_clip_val is not None:
        check_min(
            "engine.gradient_clip_val", engine.gradient_clip_val, 0.0, "null or a number >= 0"
        )


def _check_distributed(dist: DistributedConf, engine: EngineConf) -> None:
    """The distributed group's values (what it needs of the device: gpuopt.core.checks.device)."""
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
    _positive("distributed.timeout_s", dist.timeout_s, "seconds > 0")
    _positive("distributed.bucket_cap_mb", dist.bucket_cap_mb, "megabytes > 0")
    for key in ("param_dtype", "reduce_dtype"):
        value = getattr(dist, key)
        if value is not None:
            check_choice(f"distributed.{key}", value, SHARD_DTYPES)
    if dist.rdzv_endpoint is not None and not ENDPOINT_PATTERN.match(dist.rdzv_endpoint):
        raise ConfigError("distributed.rdzv_endpoint", dist.rdzv_endpoint, "null or host:port")
