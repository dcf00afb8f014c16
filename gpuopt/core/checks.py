"""The checks of a composed Hydra config's values, torch-free, each raising one `ConfigError` that
names the key, the bad value and what is allowed, before anything is created.

`check_composed()` adds what types cannot say (ranges, allowed names, and the workload's checks in
`gpuopt.core.workload_checks`); `spec_from_checked()` makes the `TrialSpec` once the torch side has
imported the `_target_`s (`gpuopt.engines.registry.load_spec`); `measure_conf()` checks the
measuring API's settings; `check_device_facts()` checks a config against a device's facts (the
sweeper's, from `python -m gpuopt.env --json`); `check_writable_path()` where a command writes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gpuopt.core.distributed_checks import check_distributed_facts, check_distributed_values
from gpuopt.core.errors import ConfigError, check_choice, check_min, config_error_from_omegaconf
from gpuopt.core.host import usable_cpus
from gpuopt.core.spec import (
    BUILTIN_TRUSTED_TARGETS,
    COMPILE_MODES,
    DEVICE_PATTERN,
    EMPTY_CACHE_POLICIES,
    ENGINES,
    LIGHTNING_INSTALL_HINT,
    LIGHTNING_PRECISIONS,
    LOSSES,
    LR_SCALING_RULES,
    OPTIMIZERS,
    PER_CPU_LIMIT,
    PER_CPU_LIMIT_FLOOR,
    PRECISIONS,
    EngineConf,
    GpuoptConf,
    MeasureConf,
    OptimizerConf,
    ProfileConf,
    TrialSpec,
)
from gpuopt.core.workload_checks import builder_results, check_trusted, check_workload_values


def per_cpu_limit(cpus: int) -> int:
    """The most loader workers (or compute threads) accepted on `cpus` usable cores."""
    return max(PER_CPU_LIMIT * cpus, PER_CPU_LIMIT_FLOOR)


def _check_per_cpu(key: str, value: int, minimum: int, cpus: int, what: str) -> None:
    limit = per_cpu_limit(cpus)
    if not minimum <= value <= limit:
        raise ConfigError(
            key,
            value,
            f"an integer >= {minimum} and <= {limit} ({what}: at most {PER_CPU_LIMIT} per usable CPU "
            f"core, {cpus} here, or {PER_CPU_LIMIT_FLOOR})",
        )


@dataclass(frozen=True)
class Checked:
    """What the value checks leave for `load_spec`: the typed config and the workload dicts."""

    typed: GpuoptConf
    model: dict[str, Any]
    data: dict[str, Any] | None


def check_composed(cfg: DictConfig, cpus: int | None = None) -> None:
    """Check every value of a composed config without importing torch or any `_target_`.

    The one check of values before anything is created: `python -m gpuopt.run` calls it before
    its run directory exists, and the sweeper calls it once on the composed config before it
    opens (or creates) a study. Raises `ConfigError` (key, value, what is allowed). `cpus` is the
    usable core count of the machine the trials run on (default: this one), for the caps on
    loader workers and threads. What needs the device is `check_device_facts`; importing the
    targets is `gpuopt.engines.registry.load_spec`.
    """
    check_values(cfg, usable_cpus() if cpus is None else cpus)


def _resolved_container(cfg: DictConfig) -> dict[str, Any]:
    if "hydra" in cfg:  # the callback's config still holds Hydra's node: not a trial setting
        cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as exc:  # a missing value or a broken interpolation
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(str(key), "<unresolvable>", str(exc).splitlines()[0]) from None
    assert isinstance(container, dict)
    return container


def check_values(cfg: DictConfig, cpus: int) -> Checked:
    """The typed config and the workload dicts of a composed config whose values all check out on
    `cpus` usable cores (the first half of `load_spec`); raises ConfigError."""
    container = _resolved_container(cfg)
    try:
        typed: GpuoptConf = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(GpuoptConf), container)
        )  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # a key the schema lacks, a value of the wrong type
        raise config_error_from_omegaconf(exc, container) from None
    _check_scalars(typed, cpus)
    _check_engine(typed.engine)
    check_distributed_values(typed.distributed, typed.engine)
    nproc = typed.distributed.nproc_per_node
    _check_per_cpu("distributed.nproc_per_node", nproc, 1, cpus, "ranks")
    _check_train(typed)
    model, data = check_workload_values(container, typed)
    _check_loss(typed)
    return Checked(typed, model, data)


def _check_loss(typed: GpuoptConf) -> None:
    """`loss`: a built-in name, or a trusted `_target_` (imported later, with the other targets)."""
    if isinstance(typed.loss, dict):
        trusted = BUILTIN_TRUSTED_TARGETS + tuple(typed.trust)
        check_trusted("loss._target_", typed.loss.get("_target_"), trusted)
        return
    if typed.loss not in LOSSES:
        raise ConfigError("loss", typed.loss, " | ".join(LOSSES) + " | {_target_: a loss function}")


def spec_from_checked(checked: Checked, data: dict[str, Any]) -> TrialSpec:
    """The typed `TrialSpec` of a checked config whose `_target_`s imported (`data`: the data
    config, `{}` for a LightningModule that brings its own)."""
    typed = checked.typed
    return TrialSpec(
        model=checked.model,
        data=data,
        loader=typed.loader,
        precision=typed.precision,
        compile=typed.compile,
        cache=typed.cache,
        optimizer=typed.optimizer,
        device=typed.device,
        measure=typed.measure,
        loss=typed.loss,
        seed=typed.seed,
        trusted_targets=BUILTIN_TRUSTED_TARGETS
        + builder_results(checked.model)
        + tuple(typed.trust),
        engine=typed.engine,
        profile=typed.profile,
        train=typed.train,
        guard=typed.guard,
        distributed=typed.distributed,
    )


ALLOC_CONF_PATTERN = re.compile(r"^\w+:[^,:]+(,\w+:[^,:]+)*$")


def _check_scalars(typed: GpuoptConf, cpus: int) -> None:
    """Ranges and names of the typed groups (loader, precision, ..., measure)."""
    loader = typed.loader
    check_min("loader.batch_size", loader.batch_size, 1, "an integer >= 1")
    _check_per_cpu("loader.num_workers", loader.num_workers, 0, cpus, "worker processes")
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
        _check_per_cpu("device.num_threads", typed.device.num_threads, 1, cpus, "threads")
    _check_measure(typed.measure)
    _check_profile(typed.profile)
    check_min("seed", typed.seed, 0, "an integer >= 0")
    if not typed.output_dir:
        raise ConfigError("output_dir", typed.output_dir, "a directory path")


def _check_train(typed: GpuoptConf) -> None:
    """train.global_batch: a multiple of the micro-batch (loader.batch_size), agreeing with
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
    if not guard.loss_tolerance > 0:
        raise ConfigError("guard.loss_tolerance", guard.loss_tolerance, "a relative drift > 0")


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
    if profile.max_s is not None and not profile.max_s > 0:
        raise ConfigError("profile.max_s", profile.max_s, "seconds > 0, or null (always steps)")
    check_min("profile.warmup_steps", profile.warmup_steps, 0, "an integer >= 0")
    check_min("profile.top_ops", profile.top_ops, 0, "an integer >= 0")


def _check_measure(measure: MeasureConf) -> None:
    check_min("measure.warmup_steps", measure.warmup_steps, 0, "an integer >= 0")
    check_min("measure.min_steps", measure.min_steps, 2, "an integer >= 2")
    if measure.max_steps < measure.min_steps:
        raise ConfigError(
            "measure.max_steps", measure.max_steps, f">= measure.min_steps ({measure.min_steps})"
        )
    if not measure.time_budget_s > 0:
        raise ConfigError("measure.time_budget_s", measure.time_budget_s, "seconds > 0")
    if not measure.min_time_s >= 0:
        raise ConfigError("measure.min_time_s", measure.min_time_s, "seconds >= 0")
    if not 0 < measure.stability_target < 1:
        raise ConfigError(
            "measure.stability_target", measure.stability_target, "a fraction in (0, 1), e.g. 0.03"
        )
    check_min("measure.ceiling_steps", measure.ceiling_steps, 1, "an integer >= 1")
    floor = measure.contender_floor
    if floor is not None and (
        isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0
    ):
        raise ConfigError("measure.contender_floor", floor, "samples/s > 0, or null (no floor)")
    if not measure.nvml_interval_s > 0:
        raise ConfigError("measure.nvml_interval_s", measure.nvml_interval_s, "seconds > 0")


def measure_conf(value: MeasureConf | dict[str, Any] | str | None = None) -> MeasureConf:
    """A validated `MeasureConf` from a preset name of conf/measure/ (`"quick"`, `"default"`), a
    mapping of its fields (a partial one keeps the other defaults), or a MeasureConf; raises
    ConfigError (the measuring API's settings get the same checks as the `measure` group)."""
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
        try:
            merged = OmegaConf.merge(OmegaConf.structured(MeasureConf), dict(value))
        except OmegaConfBaseException as exc:
            error = config_error_from_omegaconf(exc, dict(value))
            raise ConfigError(f"measure.{error.key}", error.value, error.allowed) from None
        conf = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _check_measure(conf)
    return conf


def _check_engine(engine: EngineConf) -> None:
    """The engine name, its knobs, and (for lightning) that the optional extra is installed."""
    check_choice("engine.name", engine.name, ENGINES)
    if engine.name != "lightning":
        return
    import importlib.util

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


def check_device_facts(cfg: DictConfig, facts: dict[str, Any]) -> None:
    """What the device must offer for this config, against facts instead of torch.

    `facts` is `python -m gpuopt.env --json`'s output (the sweeper has it, from the machine the
    trials run on) or the same keys built in-process: `devices` (a list of {"device": "cpu" |
    "cuda:N" | "mps", "compute_capability": "8.0", ...}), optionally `accelerator` ({"why": ...}
    when none is visible) and `cpus`. Raises `ConfigError`; pure, so it is tested without a GPU.
    """
    device_type = str(OmegaConf.select(cfg, "device.type", default="auto"))
    devices = {str(d.get("device")): d for d in facts.get("devices", [])}
    cuda = [name for name in devices if name.startswith("cuda")]
    why = (facts.get("accelerator") or {}).get("why")
    here = f"cpu | auto here ({why})" if why else "cpu | auto here"
    if device_type == "cuda" and not cuda:
        raise ConfigError("device.type", device_type, here)
    if device_type.startswith("cuda:") and device_type not in devices:
        listed = " | ".join([*cuda, "cpu", "auto"])
        raise ConfigError("device.type", device_type, listed if cuda else here)
    if device_type == "mps" and "mps" not in devices:
        raise ConfigError("device.type", device_type, "cpu | auto here (MPS is not available)")
    resolved = _resolve_device(device_type, devices)
    mode = OmegaConf.select(cfg, "precision.mode", default="fp32")
    capability = str(devices.get(resolved, {}).get("compute_capability") or "0.0")
    check_distributed_facts(cfg, resolved, len(cuda), float(capability) >= 8.0)
    if mode == "tf32" and (not resolved.startswith("cuda") or float(capability) < 8.0):
        raise ConfigError(
            "precision.mode",
            mode,
            f"fp32 | fp16 | bf16 on {resolved} (tf32 needs an NVIDIA GPU with compute capability "
            ">= 8.0)",
        )
    cpus = facts.get("cpus")
    if isinstance(cpus, int) and cpus > 0:
        workers = OmegaConf.select(cfg, "loader.num_workers", default=0)
        _check_per_cpu("loader.num_workers", workers, 0, cpus, "worker processes")
        threads = OmegaConf.select(cfg, "device.num_threads", default=None)
        if threads is not None:
            _check_per_cpu("device.num_threads", threads, 1, cpus, "threads")


def _resolve_device(device_type: str, devices: dict[str, Any]) -> str:
    """`auto` -> the first CUDA device, then mps, then cpu (as `gpuopt.trial.devices.resolve_device`)."""
    if device_type == "cuda":
        device_type = "cuda:0"
    if device_type != "auto":
        return device_type
    cuda = sorted(name for name in devices if name.startswith("cuda"))
    return cuda[0] if cuda else "mps" if "mps" in devices else "cpu"


def check_writable_path(key: str, path: str | os.PathLike[str], directory: bool = False) -> None:
    """`path` (a file to write, or a directory to create) can be written, before any work.

    Walks up to the nearest existing folder and checks it with `os.access`; nothing is created.
    """
    target = os.path.abspath(os.fspath(path))
    if not directory and os.path.isdir(target):
        raise ConfigError(key, str(path), "a file path (this is a directory)")
    if directory and os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(key, str(path), "a directory path (this is a file)")
    existing = target if directory and os.path.isdir(target) else os.path.dirname(target)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(key, str(path), f"a path under a directory ({existing} is a file)")
    if not os.access(existing, os.W_OK | os.X_OK) or not _can_create_in(existing):
        raise ConfigError(key, str(path), f"a path you can write ({existing} is not writable)")


def _can_create_in(folder: str) -> bool:
    """os.access says yes to root everywhere; an anonymous temporary file (gone on close) tells."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False
