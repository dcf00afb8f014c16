"""The validation that turns a composed Hydra config into checked values, torch-free.

`check_composed()` adds what types cannot say (ranges, allowed names, model/data agreement, trusted
targets) and raises one `ConfigError` naming the key, the bad value and what is allowed, before
anything is created; `check_device_facts()` checks a config against a device's facts. Importing the
`_target_`s (the user's modules, hence torch) is the torch side's: `gpuopt.engines.registry.load_spec`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gpuopt.core.errors import ConfigError
from gpuopt.core.host import usable_cpus
from gpuopt.core.spec import (
    BUILTIN_TRUSTED_TARGETS,
    BUILTIN_WORKLOAD_SCHEMAS,
    COMPILE_MODES,
    DEVICE_PATTERN,
    EMPTY_CACHE_POLICIES,
    ENGINES,
    HF_INSTALL_HINT,
    HF_TARGET_PREFIX,
    INPUT_KINDS,
    INPUT_RANKS,
    LIGHTNING_INSTALL_HINT,
    LIGHTNING_PRECISIONS,
    LOSSES,
    LR_SCALING_RULES,
    OPTIMIZERS,
    PER_CPU_LIMIT,
    PER_CPU_LIMIT_FLOOR,
    PRECISIONS,
    EngineConf,
    GPTConf,
    GpuoptConf,
    MeasureConf,
    OptimizerConf,
    ProfileConf,
    SyntheticDataConf,
    TrialSpec,
)


def _check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, " | ".join(allowed))


def _check_min(key: str, value: Any, minimum: float, allowed: str | None = None) -> None:
    if value is None or value < minimum:
        raise ConfigError(key, value, allowed or f"a number >= {minimum}")


def check_target(key: str, target: Any, trusted: tuple[str, ...]) -> None:
    """A `_target_` must be trusted and importable; checked without calling it."""
    check_trusted(key, target, trusted)
    import logging

    from hydra.utils import get_object

    # get_object logs its failure at ERROR before raising: quiet that, the ConfigError says it.
    hydra_log = logging.getLogger("hydra.utils")
    was_disabled, hydra_log.disabled = hydra_log.disabled, True
    try:
        get_object(target)
    except Exception as exc:  # ImportError, AttributeError, or the module failing on import
        raise ConfigError(key, target, f"an importable class or function ({exc})") from None
    finally:
        hydra_log.disabled = was_disabled


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


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true | false",
    "str": "a string",
    "list[str]": "a list of strings",
    "list[int]": "a list of integers",
}


def _type_words(annotation: str) -> str:
    """`int | None` -> 'null or an integer': what a schema field accepts, in words."""
    parts = [part.strip() for part in str(annotation).split("|")]
    words = [_TYPE_WORDS.get(part, part) for part in parts if part != "None"]
    return ("null or " if "None" in parts else "") + " or ".join(words)


def _lookup(container: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(container, dict) or part not in container:
            return "?"
        container = container[part]
    return container


def config_error_from_omegaconf(
    exc: OmegaConfBaseException, values: dict[str, Any] | None = None
) -> ConfigError:
    """OmegaConf's schema errors (unknown key, wrong type) as one ConfigError.

    `exc.full_key` names the key and `exc.object_type` the schema dataclass; the allowed keys or the
    field's type come from that dataclass. `values` (the merged container) supplies the bad value.
    """
    key = str(getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?")
    value = _lookup(values, key) if values is not None else "?"
    schema = getattr(exc, "object_type", None)
    fields = (
        {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    )
    name = key.rsplit(".", 1)[-1]
    if name in fields:
        return ConfigError(key, value, _type_words(fields[name].type))
    if fields:
        parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
        known = ", ".join(parent + n for n in fields)
        return ConfigError(key, value, f"a key of {schema.__name__}: {known}")
    return ConfigError(key, value, str(getattr(exc, "msg", exc)).splitlines()[0])


@dataclass(frozen=True)
class Checked:
    """What the value checks leave for `validate`: the typed config and the workload dicts."""

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
    targets is `validate`.
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
    container = _resolved_container(cfg)
    try:
        typed: GpuoptConf = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(GpuoptConf), container)
        )  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # a key the schema lacks, a value of the wrong type
        raise config_error_from_omegaconf(exc, container) from None
    _check_scalars(typed, cpus)
    _check_engine(typed.engine)
    _check_train(typed)
    model, data = _check_workload_values(container, typed)
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
        + _builder_results(checked.model)
        + tuple(typed.trust),
        engine=typed.engine,
        profile=typed.profile,
        train=typed.train,
        guard=typed.guard,
    )


ALLOC_CONF_PATTERN = re.compile(r"^\w+:[^,:]+(,\w+:[^,:]+)*$")


def _check_scalars(typed: GpuoptConf, cpus: int) -> None:
    """Ranges and names of the typed groups (loader, precision, ..., measure)."""
    loader = typed.loader
    _check_min("loader.batch_size", loader.batch_size, 1, "an integer >= 1")
    _check_per_cpu("loader.num_workers", loader.num_workers, 0, cpus, "worker processes")
    if loader.prefetch_factor is not None:
        _check_min("loader.prefetch_factor", loader.prefetch_factor, 1, "null or an integer >= 1")
    _check_choice("precision.mode", typed.precision.mode, PRECISIONS)
    _check_choice("compile.mode", typed.compile.mode, COMPILE_MODES)
    _check_choice("cache.empty_cache", typed.cache.empty_cache, EMPTY_CACHE_POLICIES)
    _check_min("cache.every_n_steps", typed.cache.every_n_steps, 1, "an integer >= 1")
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
    _check_min("seed", typed.seed, 0, "an integer >= 0")
    if not typed.output_dir:
        raise ConfigError("output_dir", typed.output_dir, "a directory path")


def _check_train(typed: GpuoptConf) -> None:
    """train.global_batch: a multiple of the micro-batch (loader.batch_size), agreeing with
    engine.accumulate_grad_batches when that is set too; the guard's knobs."""
    global_batch, micro = typed.train.global_batch, typed.loader.batch_size
    if global_batch is not None:
        if global_batch < 1 or global_batch % micro:
            multiples = ", ".join(str(micro * n) for n in range(1, 5))
            raise ConfigError(
                "train.global_batch",
                global_batch,
                f"null or a multiple of loader.batch_size ({micro}): {multiples}, ... "
                "(or a loader.batch_size that divides it)",
            )
        accumulate = typed.engine.accumulate_grad_batches
        if typed.engine.name == "lightning" and accumulate not in (1, global_batch // micro):
            raise ConfigError(
                "engine.accumulate_grad_batches",
                accumulate,
                f"1 or {global_batch // micro} (train.global_batch / loader.batch_size)",
            )
    guard = typed.guard
    _check_min("guard.steps", guard.steps, 2, "an integer >= 2")
    if not guard.loss_tolerance > 0:
        raise ConfigError("guard.loss_tolerance", guard.loss_tolerance, "a relative drift > 0")


def _check_optimizer(optimizer: OptimizerConf) -> None:
    _check_choice("optimizer.name", optimizer.name, OPTIMIZERS)
    _check_choice("optimizer.lr_scaling", optimizer.lr_scaling, LR_SCALING_RULES)
    if optimizer.reference_batch is not None:
        _check_min("optimizer.reference_batch", optimizer.reference_batch, 1, "null or >= 1")
    _check_min("optimizer.lr", optimizer.lr, 0.0, "a learning rate >= 0")
    _check_min("optimizer.weight_decay", optimizer.weight_decay, 0.0, "a number >= 0")
    _check_min("optimizer.momentum", optimizer.momentum, 0.0, "a number >= 0")
    if optimizer.fused and optimizer.foreach:
        raise ConfigError(
            "optimizer.fused", True, "false or null when optimizer.foreach=true (pick one)"
        )


def _check_profile(profile: ProfileConf) -> None:
    _check_min("profile.steps", profile.steps, 1, "an integer >= 1")
    _check_min("profile.warmup_steps", profile.warmup_steps, 0, "an integer >= 0")
    _check_min("profile.top_ops", profile.top_ops, 0, "an integer >= 0")


def _check_measure(measure: MeasureConf) -> None:
    _check_min("measure.warmup_steps", measure.warmup_steps, 0, "an integer >= 0")
    _check_min("measure.min_steps", measure.min_steps, 2, "an integer >= 2")
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
    _check_min("measure.ceiling_steps", measure.ceiling_steps, 1, "an integer >= 1")
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
    _check_choice("engine.name", engine.name, ENGINES)
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
        _check_choice("engine.precision", engine.precision, LIGHTNING_PRECISIONS)
    _check_min(
        "engine.accumulate_grad_batches", engine.accumulate_grad_batches, 1, "an integer >= 1"
    )
    if engine.gradient_clip_val is not None:
        _check_min(
            "engine.gradient_clip_val", engine.gradient_clip_val, 0.0, "null or a number >= 0"
        )


def check_trusted(key: str, target: Any, trusted: tuple[str, ...]) -> None:
    """A `_target_` must match a trusted pattern; checked without importing it."""
    if not isinstance(target, str) or not target:
        raise ConfigError(key, target, "a dotted path to a class or function")
    if not any(fnmatch.fnmatchcase(target, pattern) for pattern in trusted):
        raise ConfigError(
            key,
            target,
            f"targets matching {', '.join(trusted)}; trust your own module with "
            f"trust=[{target.rsplit('.', 1)[0]}.*]",
        )


def _check_workload_values(
    container: dict[str, Any], typed: GpuoptConf
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Model and data configs: present, trusted, agreeing on the input kind; gpuopt's own
    workloads also against their schemas. `data` is None when a LightningModule may bring its own."""
    trusted = BUILTIN_TRUSTED_TARGETS + tuple(typed.trust)
    model = container.get("model")
    data = container.get("data")
    if not isinstance(model, dict) or "_target_" not in model:
        raise ConfigError("model", model, "a model config with _target_ (conf/model/ or your own)")
    check_trusted("model._target_", model["_target_"], trusted)
    _check_hf_extra(model)
    if data is None and typed.engine.name == "lightning":
        return model, None  # `validate` asks the LightningModule whether it has its own data
    if not isinstance(data, dict) or "_target_" not in data:
        raise ConfigError("data", data, "a dataset config with _target_ (conf/data/ or your own)")
    check_trusted("data._target_", data["_target_"], trusted)
    epoch_steps = data.get("epoch_steps")
    if epoch_steps is not None and (
        isinstance(epoch_steps, bool) or not isinstance(epoch_steps, int) or epoch_steps < 1
    ):
        raise ConfigError("data.epoch_steps", epoch_steps, "null or an integer >= 1")
    model_input = model.get("input", "any")
    _check_choice("model.input", model_input, INPUT_KINDS)
    data_kind = data.get("kind", "any")
    _check_choice("data.kind", data_kind, INPUT_KINDS)
    if "any" not in (model_input, data_kind) and model_input != data_kind:
        raise ConfigError(
            "data.kind",
            data_kind,
            f"{model_input!r}: model {model['_target_']} takes {model_input} "
            f"(drop the data.kind override, or pick a model that takes {data_kind})",
        )
    if model.get("channels_last") and model_input not in ("images", "hf_images", "any"):
        raise ConfigError("model.channels_last", True, "false for models that do not take images")
    _check_builtin_workload("model", model)
    _check_builtin_workload("data", data)
    if data["_target_"] in BUILTIN_WORKLOAD_SCHEMAS and typed.loader.drop_last:
        size, batch = data.get("size", SyntheticDataConf.size), typed.loader.batch_size
        if size < batch:  # every batch dropped: the loader would never yield one
            raise ConfigError(
                "data.size", size, f"an integer >= loader.batch_size ({batch}) with drop_last=true"
            )
    return model, data


def _builder_results(model: dict[str, Any]) -> tuple[str, ...]:
    """What gpuopt's Hugging Face builder returns (Hydra 1.4 also checks a target's result against
    the whitelist): the transformers model classes, trusted for that builder only."""
    return ("transformers.models.*",) if str(model["_target_"]).startswith(HF_TARGET_PREFIX) else ()


def _check_hf_extra(model: dict[str, Any]) -> None:
    """A Hugging Face model (conf/model/hf_*) needs `transformers`: found without importing it."""
    import importlib.util

    target = str(model["_target_"])
    if target.startswith(HF_TARGET_PREFIX) and importlib.util.find_spec("transformers") is None:
        name = model.get("architecture", target)
        raise ConfigError("model", name, f"install the Hugging Face extra first: {HF_INSTALL_HINT}")


def _check_builtin_workload(group: str, node: dict[str, Any]) -> None:
    """gpuopt's own models and dataset: keys and types from their schema, then their ranges."""
    schema = BUILTIN_WORKLOAD_SCHEMAS.get(node["_target_"])
    if schema is None:
        return  # a user's model or dataset: its constructor is the schema
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except OmegaConfBaseException as exc:
        error = config_error_from_omegaconf(exc, node)
        raise ConfigError(f"{group}.{error.key}", error.value, error.allowed) from None
    kind = getattr(typed, "input", None) or getattr(typed, "kind", "any")
    shape_key = "input_shape" if group == "model" else "shape"
    shape = getattr(typed, shape_key)
    if group == "data" and kind not in INPUT_RANKS:
        raise ConfigError("data.kind", kind, " | ".join(INPUT_RANKS))
    rank = INPUT_RANKS.get(kind)
    if (rank is not None and len(shape) != rank) or any(dim < 1 for dim in shape):
        dims = f"{rank} dimension(s)" if rank is not None else "dimensions"
        raise ConfigError(f"{group}.{shape_key}", shape, f"{dims} >= 1 for {kind}")
    for item in dataclasses.fields(typed):
        value = getattr(typed, item.name)
        if item.type == "int" and item.name != "seed":
            _check_min(f"{group}.{item.name}", value, 1, "an integer >= 1")
    if isinstance(typed, GPTConf) and typed.width % typed.heads:
        divisors = [n for n in range(1, typed.width + 1) if typed.width % n == 0]
        raise ConfigError(
            "model.heads",
            typed.heads,
            f"a divisor of model.width ({typed.width}): {', '.join(map(str, divisors[:12]))}"
            + (", ..." if len(divisors) > 12 else ""),
        )
    if isinstance(typed, SyntheticDataConf):
        _check_min("data.sample_cost", typed.sample_cost, 0.0, "a number >= 0")
        _check_min("data.seed", typed.seed, 0, "an integer >= 0")


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
    """`auto` -> the first CUDA device, then mps, then cpu (as `gpuopt.env.resolve_device`)."""
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
