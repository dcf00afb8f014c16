"""Typed config schemas and the validation that turns a composed Hydra config into a `TrialSpec`.

The schema dataclasses are stored in Hydra's ConfigStore as `gpuopt_schema` (first in
conf/config.yaml's defaults list), so OmegaConf already rejects wrong types and unknown keys.
`validate()` adds what types cannot say (ranges, allowed names, devices, importable targets, model/data
agreement) and raises one `ConfigError` naming the key, the bad value and what is allowed, before
anything is built.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
EMPTY_CACHE_POLICIES = ("never", "trial_end", "every_n_steps")
OPTIMIZERS = ("sgd", "adamw")
INPUT_KINDS = ("vectors", "images", "tokens", "any")
LOSSES = ("cross_entropy", "mse")
ENGINES = ("native", "lightning")
# Lightning 2.x `Trainer(precision=...)` strings (engine.precision overrides the precision group).
LIGHTNING_PRECISIONS = (
    "32-true",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "64-true",
    "transformer-engine",
    "transformer-engine-float16",
)
LIGHTNING_INSTALL_HINT = 'pip install "gpuopt[lightning]"'
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")

# Keys of a model config that describe the model to gpuopt and are not constructor arguments.
MODEL_META_KEYS = ("input", "input_shape", "num_classes", "channels_last")
# Keys of a data config that gpuopt reads itself.
DATA_META_KEYS = ("kind",)

# `_target_`s any config may instantiate. Everything else must be trusted explicitly with the
# top-level `trust` list (e.g. `trust=[mypkg.*]`), so a shared YAML cannot run arbitrary code.
BUILTIN_TRUSTED_TARGETS = ("gpuopt.*", "torch.nn.*", "torch.utils.data.*", "torchvision.*")


class ConfigError(ValueError):
    """An invalid configuration: raised before any trial work starts."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}; allowed: {allowed}")


@dataclass
class LoaderConf:
    batch_size: int = 32
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None  # None: PyTorch's default (2) when num_workers > 0
    persistent_workers: bool = False
    drop_last: bool = True
    non_blocking: bool = False  # host-to-device copies with non_blocking=True


@dataclass
class PrecisionConf:
    mode: str = "fp32"  # fp32 | tf32 | fp16 (autocast + GradScaler) | bf16 (autocast)


@dataclass
class CompileConf:
    mode: str = "off"  # off | default | reduce-overhead | max-autotune
    fullgraph: bool = False
    dynamic: bool | None = None


@dataclass
class CacheConf:
    empty_cache: str = "never"  # never | trial_end | every_n_steps
    every_n_steps: int = 100
    cuda_alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True
    cudnn_benchmark: bool = True
    cpu_thp: bool = False  # THP_MEM_ALLOC_ENABLE=1: transparent huge pages for CPU tensors


@dataclass
class OptimizerConf:
    name: str = "adamw"  # sgd | adamw
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    foreach: bool | None = None  # None: PyTorch's choice
    fused: bool | None = None


@dataclass
class DeviceConf:
    type: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    num_threads: int | None = None  # torch.set_num_threads; None: PyTorch's default


@dataclass
class MeasureConf:
    warmup_steps: int = 5
    min_steps: int = 10
    max_steps: int = 500
    time_budget_s: float = 8.0  # timed window ends after this, stable or not
    min_time_s: float = 2.0  # the stability stop waits at least this long (capped at the budget)
    stability_target: float = 0.03  # stop once the 95% CI half-width of throughput is below this
    ceiling: bool = True  # replay one on-device batch to measure the compute-only ceiling
    ceiling_steps: int = 20
    count_flops: bool = True  # torch.utils.flop_counter on one step, for MFU
    nvml_interval_s: float = 0.1


@dataclass
class ProfileConf:
    """The profiled window (gpuopt.profile): a few steps under torch.profiler after the timed
    window, never timed for throughput. Off by default; `profile=on` turns it on for one run."""

    enabled: bool = False
    steps: int = 5  # profiled steps (each recorded op costs host time: keep it small)
    warmup_steps: int = 1  # steps the profiler records and discards (its own start-up)
    top_ops: int = 10  # operators listed by self time


@dataclass
class EngineConf:
    """Which training loop runs the trial. The Lightning-only knobs are ignored by `native`."""

    name: str = "native"  # native (gpuopt.engines.native) | lightning (gpuopt.engines.lightning)
    precision: str | None = None  # Lightning precision string overriding the precision group
    strategy: str = "auto"  # Trainer(strategy=...)
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None


@dataclass
class GpuoptConf:
    """The whole trial config. `model` and `data` stay untyped: they carry user `_target_` kwargs."""

    model: Any = None
    data: Any = None
    engine: EngineConf = field(default_factory=EngineConf)
    loader: LoaderConf = field(default_factory=LoaderConf)
    precision: PrecisionConf = field(default_factory=PrecisionConf)
    compile: CompileConf = field(default_factory=CompileConf)
    cache: CacheConf = field(default_factory=CacheConf)
    optimizer: OptimizerConf = field(default_factory=OptimizerConf)
    device: DeviceConf = field(default_factory=DeviceConf)
    measure: MeasureConf = field(default_factory=MeasureConf)
    profile: ProfileConf = field(default_factory=ProfileConf)
    loss: str = "cross_entropy"
    seed: int = 0
    trust: list[str] = field(default_factory=list)
    output_dir: str = "outputs"


def register_schemas() -> None:
    ConfigStore.instance().store(name="gpuopt_schema", node=GpuoptConf, replace=True)


@dataclass(frozen=True)
class TrialSpec:
    """A validated trial configuration: what `run_trial` builds and measures."""

    model: dict[str, Any]
    data: dict[str, Any]
    loader: LoaderConf
    precision: PrecisionConf
    compile: CompileConf
    cache: CacheConf
    optimizer: OptimizerConf
    device: DeviceConf
    measure: MeasureConf
    loss: str
    seed: int
    trusted_targets: tuple[str, ...]
    engine: EngineConf = field(default_factory=EngineConf)
    profile: ProfileConf = field(default_factory=ProfileConf)

    @property
    def model_input(self) -> str:
        return str(self.model.get("input", "any"))


def _check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, " | ".join(allowed))


def _check_min(key: str, value: Any, minimum: float, allowed: str | None = None) -> None:
    if value is None or value < minimum:
        raise ConfigError(key, value, allowed or f"a number >= {minimum}")


def check_target(key: str, target: Any, trusted: tuple[str, ...]) -> None:
    """A `_target_` must be trusted and importable; checked without calling it."""
    if not isinstance(target, str) or not target:
        raise ConfigError(key, target, "a dotted path to a class or function")
    if not any(fnmatch.fnmatchcase(target, pattern) for pattern in trusted):
        raise ConfigError(
            key,
            target,
            f"targets matching {', '.join(trusted)}; trust your own module with "
            f"trust=[{target.rsplit('.', 1)[0]}.*]",
        )
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


def validate(cfg: DictConfig) -> TrialSpec:
    """Check a composed config and return the typed `TrialSpec`, or raise `ConfigError`."""
    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as exc:  # a missing value or a broken interpolation
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(str(key), "<unresolvable>", str(exc).splitlines()[0]) from None
    assert isinstance(container, dict)
    typed: GpuoptConf = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(GpuoptConf), container)
    )  # type: ignore[assignment]

    loader = typed.loader
    _check_min("loader.batch_size", loader.batch_size, 1, "an integer >= 1")
    _check_min("loader.num_workers", loader.num_workers, 0, "an integer >= 0")
    if loader.prefetch_factor is not None:
        _check_min("loader.prefetch_factor", loader.prefetch_factor, 1, "null or an integer >= 1")
    _check_choice("precision.mode", typed.precision.mode, PRECISIONS)
    _check_choice("compile.mode", typed.compile.mode, COMPILE_MODES)
    _check_choice("cache.empty_cache", typed.cache.empty_cache, EMPTY_CACHE_POLICIES)
    _check_min("cache.every_n_steps", typed.cache.every_n_steps, 1, "an integer >= 1")
    _check_choice("optimizer.name", typed.optimizer.name, OPTIMIZERS)
    _check_min("optimizer.lr", typed.optimizer.lr, 0.0, "a learning rate >= 0")
    if typed.optimizer.fused and typed.optimizer.foreach:
        raise ConfigError(
            "optimizer.fused", True, "false or null when optimizer.foreach=true (pick one)"
        )
    if not DEVICE_PATTERN.match(str(typed.device.type)):
        raise ConfigError("device.type", typed.device.type, "auto | cpu | cuda | cuda:N | mps")
    if typed.device.num_threads is not None:
        _check_min("device.num_threads", typed.device.num_threads, 1, "null or an integer >= 1")
    measure = typed.measure
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
    _check_min("profile.steps", typed.profile.steps, 1, "an integer >= 1")
    _check_min("profile.warmup_steps", typed.profile.warmup_steps, 0, "an integer >= 0")
    _check_min("profile.top_ops", typed.profile.top_ops, 0, "an integer >= 0")

    _check_engine(typed.engine)
    model, data = _check_workload(container, typed)
    if isinstance(typed.loss, str) and not typed.loss.startswith("_"):
        _check_choice("loss", typed.loss, LOSSES)

    return TrialSpec(
        model=model,
        data=data,
        loader=loader,
        precision=typed.precision,
        compile=typed.compile,
        cache=typed.cache,
        optimizer=typed.optimizer,
        device=typed.device,
        measure=measure,
        loss=typed.loss,
        seed=typed.seed,
        trusted_targets=BUILTIN_TRUSTED_TARGETS + tuple(typed.trust),
        engine=typed.engine,
        profile=typed.profile,
    )


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


def _check_workload(
    container: dict[str, Any], typed: GpuoptConf
) -> tuple[dict[str, Any], dict[str, Any]]:
    trusted = BUILTIN_TRUSTED_TARGETS + tuple(typed.trust)
    model = container.get("model")
    data = container.get("data")
    if not isinstance(model, dict) or "_target_" not in model:
        raise ConfigError("model", model, "a model config with _target_ (conf/model/ or your own)")
    if data is None and typed.engine.name == "lightning":
        # A LightningModule may bring its own train_dataloader (compose with `~data`).
        check_target("model._target_", model["_target_"], trusted)
        from gpuopt.engines import brings_own_data

        if not brings_own_data(model["_target_"]):
            raise ConfigError(
                "data",
                data,
                "a Dataset or LightningDataModule config with _target_, or a "
                f"LightningModule with its own train_dataloader (not {model['_target_']})",
            )
        return model, {}
    if not isinstance(data, dict) or "_target_" not in data:
        raise ConfigError("data", data, "a dataset config with _target_ (conf/data/ or your own)")
    check_target("model._target_", model["_target_"], trusted)
    check_target("data._target_", data["_target_"], trusted)
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
    if model.get("channels_last") and model_input not in ("images", "any"):
        raise ConfigError("model.channels_last", True, "false for models that do not take images")
    return model, data
