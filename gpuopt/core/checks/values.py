"""The values of a typed config (`check_values`): ranges and allowed names of every group, and what
types cannot say across groups; and the measuring API's settings (`measure_conf`).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from functools import reduce
from typing import Any

from omegaconf import OmegaConf

from gpuopt.core.errors import ConfigError, check_per_cpu, to_schema
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
    GpuoptConf,
    MeasureConf,
)

ALLOC_CONF_PATTERN = re.compile(r"^\w+:[^,:]+(,\w+:[^,:]+)*$")
ENDPOINT_PATTERN = re.compile(r"^[\w.\-]+:\d{1,5}$")
# One value's rule: (key, test, what is allowed). The test: a tuple of names, a minimum (>=), a
# pattern or a predicate; "" words: the names. A null value passes (the schema said if it may be).
Rule = tuple[str, "tuple[str, ...] | float | re.Pattern[str] | Callable[[Any], bool]", str]


def _positive(value: float) -> bool:
    return value > 0  # NaN fails


INT_1, INT_0 = "an integer >= 1", "an integer >= 0"
_VALUES: tuple[Rule, ...] = (
    ("loader.batch_size", 1, INT_1),
    ("loader.prefetch_factor", 1, "null or an integer >= 1"),
    ("precision.mode", PRECISIONS, ""),
    ("compile.mode", COMPILE_MODES, ""),
    ("cache.empty_cache", EMPTY_CACHE_POLICIES, ""),
    ("cache.every_n_steps", 1, INT_1),
    (
        "cache.cuda_alloc_conf",
        ALLOC_CONF_PATTERN,
        "null or key:value[,key:value] (PYTORCH_CUDA_ALLOC_CONF)",
    ),
    ("optimizer.name", OPTIMIZERS, ""),
    ("optimizer.lr_scaling", LR_SCALING_RULES, ""),
    ("optimizer.reference_batch", 1, "null or >= 1"),
    ("optimizer.lr", 0.0, "a learning rate >= 0"),
    ("optimizer.weight_decay", 0.0, "a number >= 0"),
    ("optimizer.momentum", 0.0, "a number >= 0"),
    ("device.type", DEVICE_PATTERN, "auto | cpu | cuda | cuda:N | mps"),
    ("profile.steps", 1, INT_1),
    ("profile.max_s", _positive, "seconds > 0, or null (always steps)"),
    ("profile.warmup_steps", 0, INT_0),
    ("profile.top_ops", 0, INT_0),
    ("seed", 0, INT_0),
    ("output_dir", bool, "a directory path"),
)
_MEASURE: tuple[Rule, ...] = (
    ("warmup_steps", 0, INT_0),
    ("min_steps", 2, "an integer >= 2"),
    ("time_budget_s", _positive, "seconds > 0"),
    ("min_time_s", lambda s: s >= 0, "seconds >= 0"),
    ("stability_target", lambda t: 0 < t < 1, "a fraction in (0, 1), e.g. 0.03"),
    ("ceiling_steps", 1, INT_1),
    ("nvml_interval_s", _positive, "seconds > 0"),
)
_LIGHTNING: tuple[Rule, ...] = (
    ("engine.precision", LIGHTNING_PRECISIONS, ""),
    ("engine.accumulate_grad_batches", 1, INT_1),
    ("engine.gradient_clip_val", 0.0, "null or a number >= 0"),
)
_DISTRIBUTED: tuple[Rule, ...] = (
    ("distributed.kind", DISTRIBUTED_KINDS, ""),
    ("distributed.backend", DISTRIBUTED_BACKENDS, ""),
    ("distributed.nproc_per_node", 1, INT_1),
    ("distributed.nnodes", 1, INT_1),
)
_SHARDED: tuple[Rule, ...] = (
    ("distributed.timeout_s", _positive, "seconds > 0"),
    ("distributed.bucket_cap_mb", _positive, "megabytes > 0"),
    ("distributed.param_dtype", SHARD_DTYPES, ""),
    ("distributed.reduce_dtype", SHARD_DTYPES, ""),
    ("distributed.rdzv_endpoint", ENDPOINT_PATTERN, "null or host:port"),
)
_GUARD: tuple[Rule, ...] = (
    ("guard.steps", 2, "an integer >= 2"),
    ("guard.global_batch", 1, "null or >= 1"),
    ("guard.loss_tolerance", _positive, "a relative drift > 0"),
)


def _check(conf: Any, rules: tuple[Rule, ...], prefix: str = "") -> None:
    """ConfigError for the first value (by dotted key under `conf`) its rule refuses."""
    for key, test, allowed in rules:
        value = reduce(getattr, key.split("."), conf)
        if value is None:
            continue
        if isinstance(test, tuple):
            ok, allowed = value in test, allowed or " | ".join(test)
        elif isinstance(test, re.Pattern):
            ok = bool(test.match(str(value)))
        elif callable(test):
            ok = test(value)
        else:
            ok = not value < test
        if not ok:
            raise ConfigError(prefix + key, value, allowed)


def check_values(typed: GpuoptConf, cpus: int) -> None:
    """Every group's values on `cpus` usable cores (the caps on workers, threads and ranks)."""
    _check(typed, _VALUES)
    _check_measure(typed.measure)
    if typed.optimizer.fused and typed.optimizer.foreach:
        raise ConfigError(
            "optimizer.fused", True, "false or null when optimizer.foreach=true (pick one)"
        )
    _check_engine(typed)
    _check(typed, _DISTRIBUTED)
    dist = typed.distributed
    if dist.kind != "none":
        engine = typed.engine
        if engine.name == "lightning" and engine.strategy != "auto":  # the kind picks the strategy
            raise ConfigError(
                "engine.strategy",
                engine.strategy,
                f"auto with distributed={dist.kind} (the distributed group sets Lightning's "
                "strategy)",
            )
        _check(typed, _SHARDED)
    check_per_cpu("loader.num_workers", typed.loader.num_workers, 0, cpus, "worker processes")
    if typed.device.num_threads is not None:
        check_per_cpu("device.num_threads", typed.device.num_threads, 1, cpus, "threads")
    check_per_cpu("distributed.nproc_per_node", dist.nproc_per_node, 1, cpus, "ranks")
    _check_train(typed)


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
    _check(typed, _GUARD)


def _check_measure(measure: MeasureConf) -> None:
    _check(measure, _MEASURE, "measure.")
    if measure.max_steps < measure.min_steps:
        raise ConfigError(
            "measure.max_steps", measure.max_steps, f">= measure.min_steps ({measure.min_steps})"
        )


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


def _check_engine(typed: GpuoptConf) -> None:
    """The engine name, its knobs, and (for lightning) that the optional extra is installed."""
    _check(typed, (("engine.name", ENGINES, ""),))
    if typed.engine.name != "lightning":
        return
    # find_spec is cheap (no `import lightning`, which takes seconds) and returns None when the
    # package is absent (or masked with sys.modules["lightning"] = None).
    if importlib.util.find_spec("lightning") is None:
        raise ConfigError(
            "engine.name",
            typed.engine.name,
            f"native, or install the Lightning extra first: {LIGHTNING_INSTALL_HINT}",
        )
    _check(typed, _LIGHTNING)
