"""The workload's checks, torch-free: the model, data and loss configs (`check_workload`), trusted
by name without importing them; and what only a built model answers (`check_module_patterns`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
from typing import Any

from gpuopt.core.errors import ConfigError, check_choice, check_min, to_schema
from gpuopt.core.spec import (
    BUILTIN_TRUSTED_TARGETS,
    BUILTIN_WORKLOAD_SCHEMAS,
    HF_INSTALL_HINT,
    HF_TARGET_PREFIX,
    INPUT_KINDS,
    INPUT_RANKS,
    LOSSES,
    GPTConf,
    GpuoptConf,
    SyntheticDataConf,
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


def check_workload(
    container: dict[str, Any], typed: GpuoptConf
) -> tuple[dict[str, Any], dict[str, Any] | None, tuple[str, ...]]:
    """The model and data configs, then the loss; with the trial's trusted target patterns. `data`
    is None when a LightningModule may bring its own."""
    model, data = _model_and_data(container, typed)
    _check_loss(typed)
    return model, data, BUILTIN_TRUSTED_TARGETS + _builder_results(model) + tuple(typed.trust)


def _model_and_data(
    container: dict[str, Any], typed: GpuoptConf
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Model and data configs: present, trusted, agreeing on the input kind; gpuopt's own
    workloads also against their schemas."""
    trusted = BUILTIN_TRUSTED_TARGETS + tuple(typed.trust)
    model = container.get("model")
    data = container.get("data")
    if not isinstance(model, dict) or "_target_" not in model:
        raise ConfigError("model", model, "a model config with _target_ (conf/model/ or your own)")
    check_trusted("model._target_", model["_target_"], trusted)
    _check_hf_extra(model)
    if data is None and typed.engine.name == "lightning":
        return model, None
    if not isinstance(data, dict) or "_target_" not in data:
        raise ConfigError("data", data, "a dataset config with _target_ (conf/data/ or your own)")
    check_trusted("data._target_", data["_target_"], trusted)
    epoch_steps = data.get("epoch_steps")
    if epoch_steps is not None and (
        isinstance(epoch_steps, bool) or not isinstance(epoch_steps, int) or epoch_steps < 1
    ):
        raise ConfigError("data.epoch_steps", epoch_steps, "null or an integer >= 1")
    model_input = model.get("input", "any")
    check_choice("model.input", model_input, INPUT_KINDS)
    data_kind = data.get("kind", "any")
    check_choice("data.kind", data_kind, INPUT_KINDS)
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


def _check_loss(typed: GpuoptConf) -> None:
    """`loss`: a built-in name, or a trusted `_target_` (imported later, with the other targets)."""
    if isinstance(typed.loss, dict):
        trusted = BUILTIN_TRUSTED_TARGETS + tuple(typed.trust)
        check_trusted("loss._target_", typed.loss.get("_target_"), trusted)
        return
    if typed.loss not in LOSSES:
        raise ConfigError("loss", typed.loss, " | ".join(LOSSES) + " | {_target_: a loss function}")


def _builder_results(model: dict[str, Any]) -> tuple[str, ...]:
    """What gpuopt's Hugging Face builder returns (Hydra 1.4 also checks a target's result against
    the whitelist): the transformers model classes, trusted for that builder only."""
    return ("transformers.models.*",) if str(model["_target_"]).startswith(HF_TARGET_PREFIX) else ()


def _check_hf_extra(model: dict[str, Any]) -> None:
    """A Hugging Face model (conf/model/hf_*) needs `transformers`: found without importing it."""
    target = str(model["_target_"])
    if target.startswith(HF_TARGET_PREFIX) and importlib.util.find_spec("transformers") is None:
        name = model.get("architecture", target)
        raise ConfigError("model", name, f"install the Hugging Face extra first: {HF_INSTALL_HINT}")


def _check_builtin_workload(group: str, node: dict[str, Any]) -> None:
    """gpuopt's own models and dataset: keys and types from their schema, then their ranges."""
    schema = BUILTIN_WORKLOAD_SCHEMAS.get(node["_target_"])
    if schema is None:
        return  # a user's model or dataset: its constructor is the schema
    typed = to_schema(schema, node, f"{group}.")
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
        if item.type == "int" and item.name != "seed":
            check_min(f"{group}.{item.name}", getattr(typed, item.name), 1, "an integer >= 1")
    if isinstance(typed, GPTConf) and typed.width % typed.heads:
        divisors = [n for n in range(1, typed.width + 1) if typed.width % n == 0]
        raise ConfigError(
            "model.heads",
            typed.heads,
            f"a divisor of model.width ({typed.width}): {', '.join(map(str, divisors[:12]))}"
            + (", ..." if len(divisors) > 12 else ""),
        )
    if isinstance(typed, SyntheticDataConf):
        check_min("data.sample_cost", typed.sample_cost, 0.0, "a number >= 0")
        check_min("data.seed", typed.seed, 0, "an integer >= 0")


# The most class names a "no submodule matches" error lists (a Hugging Face model has dozens).
MAX_NAMED_CLASSES = 24


def check_module_patterns(key: str, patterns: list[str], classes: list[str]) -> None:
    """`distributed.shard_modules` / `checkpoint_modules`: each pattern (a class name or an fnmatch
    pattern) must match a submodule's class, else one ConfigError naming the classes there are."""
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
