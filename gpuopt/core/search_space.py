"""The search space found for you: after one measured run of an app as it is, the config keys its
DataLoader and Trainer arguments came from (an observed value traced back to a key of the job's
composed config that holds it and is named for it), and the `params:` block a throughput sweep of
them would search (`gpuopt_search_space.yaml`, beside the result). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SEARCH_SPACE_FILE = "gpuopt_search_space.yaml"

# What each observed setting is called in the configs apps have (Lightning, the HF Trainer's
# arguments, plain DataLoader kwargs). The first name of each is how `observed` spells it.
NAMES: dict[str, tuple[str, ...]] = {
    "batch_size": ("batch_size", "train_batch_size", "per_device_train_batch_size"),
    "num_workers": ("num_workers", "dataloader_num_workers", "workers"),
    "pin_memory": ("pin_memory", "dataloader_pin_memory"),
    "prefetch_factor": ("prefetch_factor", "dataloader_prefetch_factor"),
    "persistent_workers": ("persistent_workers", "dataloader_persistent_workers"),
    "precision": ("precision",),
    "accumulate_grad_batches": ("accumulate_grad_batches", "gradient_accumulation_steps"),
}
BATCH_FACTORS = ("batch_size", "accumulate_grad_batches")  # their product: the global batch


def leaves(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every scalar leaf of a composed config by dotted key (Hydra's own `hydra` node left out)."""
    found: dict[str, Any] = {}
    for name, value in config.items():
        key = f"{prefix}{name}"
        if key == "hydra":
            continue
        if isinstance(value, Mapping):
            found.update(leaves(value, f"{key}."))
        elif not isinstance(value, list):
            found[key] = value
    return found


def _named(key: str, setting: str) -> bool:
    return key.rsplit(".", 1)[-1] in NAMES[setting]


def trace(config: Mapping[str, Any], observed: Mapping[str, Any]) -> dict[str, str]:
    """setting -> the config key its observed value came from (the shortest such key)."""
    flat = leaves(config)
    traced = {}
    for setting, value in observed.items():
        if setting not in NAMES or value is None:
            continue
        keys = [k for k, v in flat.items() if _named(k, setting) and _same(v, value)]
        if keys:
            traced[setting] = min(keys, key=lambda k: (k.count("."), k))
    return traced


# Lightning's precision flags as a config may give them (`precision: 32`) and as the Trainer
# reports them (`"32-true"`).
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}


def _same(config_value: Any, observed: Any) -> bool:
    if isinstance(observed, bool) or isinstance(config_value, bool):
        return config_value is observed or str(config_value).lower() == str(observed).lower()
    text = str(config_value)
    return text == str(observed) or PRECISION_ALIASES.get(text) == str(observed)


def propose(
    traced: Mapping[str, str], observed: Mapping[str, Any], device: str = "cpu", cpus: int = 2
) -> tuple[dict[str, str], list[str]]:
    """The `params:` block over the traced keys (Hydra's sweep syntax) and the batch keys."""
    params: dict[str, str] = {}
    batch = observed.get("batch_size")
    if "batch_size" in traced and isinstance(batch, int) and batch > 0:
        sizes = sorted({max(1, batch // 2), batch, batch * 2, batch * 4})
        params[traced["batch_size"]] = f"choice({', '.join(map(str, sizes))})"
    if "num_workers" in traced:
        workers = sorted({0, 1, max(1, cpus // 2), cpus})
        params[traced["num_workers"]] = f"choice({', '.join(map(str, workers))})"
    if "pin_memory" in traced and device == "cuda":
        params[traced["pin_memory"]] = "choice(true, false)"
    if "persistent_workers" in traced:
        params[traced["persistent_workers"]] = "choice(true, false)"
    if "prefetch_factor" in traced and observed.get("num_workers"):
        params[traced["prefetch_factor"]] = "choice(2, 4)"
    if "precision" in traced:
        modes = ["32-true", "bf16-mixed"] + (["16-mixed"] if device == "cuda" else [])
        params[traced["precision"]] = f"choice({', '.join(modes)})"
    if "accumulate_grad_batches" in traced:
        params[traced["accumulate_grad_batches"]] = "choice(1, 2, 4)"
    batch_keys = [traced[s] for s in BATCH_FACTORS if s in traced]
    return params, batch_keys


def render(params: Mapping[str, str], batch_keys: Iterable[str], traced: Mapping[str, str]) -> str:
    """The proposal as the YAML a user pastes under `hydra.sweeper:`."""
    lines = ["# Found in this run: the keys the job's DataLoader and Trainer arguments came from"]
    lines += [f"#   {setting}: {key}" for setting, key in traced.items()]
    lines.append("hydra:")
    lines.append("  sweeper:")
    keys = list(batch_keys)
    if keys:
        lines.append(f"    batch_keys: [{', '.join(keys)}]")
    lines.append("    params:")
    lines += [f"      {key}: {choice}" for key, choice in params.items()]
    return "\n".join(lines) + "\n"


def write_proposal(run_dir: Path, observed: Mapping[str, Any], device: str) -> str | None:
    """The proposal from the run directory's composed config, written beside the result; its
    text, or None when nothing could be traced (no `.hydra/config.yaml`, no matching key)."""
    import os

    from omegaconf import OmegaConf

    from gpuopt.core.checks import resolved_or_written

    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    traced = trace(resolved_or_written(OmegaConf.load(path)), observed)
    if not traced:
        return None
    params, batch_keys = propose(traced, observed, device, os.cpu_count() or 1)
    text = render(params, batch_keys, traced)
    (run_dir / SEARCH_SPACE_FILE).write_text(text)
    return text


def batch_keys_among(keys: Iterable[str]) -> list[str]:
    """The batch keys of a sweep that names none: the one key among `keys` named like a batch size,
    and the one named like an accumulation count; [] without exactly one batch size key."""
    keys = list(keys)
    found = []
    for setting in BATCH_FACTORS:
        named = [k for k in keys if _named(k, setting)]
        if len(named) != 1:
            if setting == "batch_size":
                return []
            continue
        found.append(named[0])
    return found
