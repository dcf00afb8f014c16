"""The one check of a composed config, torch-free, before anything is created: `check_composed`,
called once by every process that runs or plans a trial. In order: the types (the schema), the
values, the workload (targets trusted by name, not imported) and, given a machine's facts, the
device. Every failure is one `ConfigError` naming the key, the bad value and what is allowed; what
needs torch or the user's modules is gpuopt.trial.prepare's.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gpuopt.core.checks.device import check_device_facts
from gpuopt.core.checks.values import check_values, measure_conf  # noqa: F401 (re-exported)
from gpuopt.core.checks.workload import check_module_patterns, check_workload, matches_any  # noqa: F401
from gpuopt.core.errors import ConfigError, per_cpu_limit, to_schema  # noqa: F401
from gpuopt.core.host import usable_cpus
from gpuopt.core.spec import GpuoptConf, TrialSpec


def check_composed(
    cfg: DictConfig,
    cpus: int | None = None,
    facts: dict[str, Any] | None = None,
    run_dir: bool = False,
) -> TrialSpec:
    """The `TrialSpec` of a composed config whose every value checks out; raises `ConfigError`.
    `cpus`: the trials' machine's usable cores (default: this one's); `facts`: its devices
    (without them the device is checked where it is resolved); `run_dir`: check that a single
    run's `hydra.run.dir` can be created. A LightningModule's own data is `data={}` until then."""
    container = _resolved_container(cfg)
    typed: GpuoptConf = to_schema(GpuoptConf, container)  # a key it lacks, a value's wrong type
    check_values(typed, usable_cpus() if cpus is None else cpus)
    check_nodes(typed.distributed, cfg)
    model, data, trusted = check_workload(container, typed)
    if facts is not None:
        check_device_facts(typed, facts)
    if run_dir:
        check_writable_path("hydra.run.dir", str(cfg.hydra.run.dir), directory=True)
    own = {"model", "data", "trusted_targets"}
    typed_fields = {f.name: getattr(typed, f.name) for f in fields(TrialSpec) if f.name not in own}
    return TrialSpec(
        model=model, data=data if data is not None else {}, trusted_targets=trusted, **typed_fields
    )


# The launchers whose job spans several nodes (gpuopt.sweeper.launchers.slurm's two names).
MULTI_NODE_LAUNCHERS = ("slurm", "gpuopt_slurm")


def check_nodes(dist: Any, cfg: DictConfig) -> None:
    """A trial over several nodes needs a place for them to meet: `distributed.rdzv_endpoint` or a
    SLURM job; anywhere else its one node would wait for the others until the rendezvous timeout."""
    if (
        dist.kind == "none"
        or dist.nnodes == 1
        or dist.rdzv_endpoint
        or "SLURM_JOB_ID" in os.environ
    ):
        return
    if _launcher_choice(cfg) in MULTI_NODE_LAUNCHERS:
        return
    raise ConfigError(
        "distributed.nnodes",
        dist.nnodes,
        "1, or several with distributed.rdzv_endpoint=host:port (the first node's) or "
        "hydra/launcher=slurm (one task per node)",
    )


def _launcher_choice(cfg: DictConfig) -> str | None:
    """The composed `hydra/launcher` choice: from the config's Hydra node, else Hydra's."""
    choice = OmegaConf.select(cfg, "hydra.runtime.choices", default=None)
    if choice is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        choice = HydraConfig.get().runtime.choices
    return choice.get("hydra/launcher")


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


def resolved_or_written(cfg: Any) -> dict[str, Any]:
    """The config as a dict, resolved; as written where an interpolation does not resolve (one that
    needs the running job, `${hydra:...}`)."""
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except Exception:
        container = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(container, dict)
    return container  # type: ignore[return-value]


def check_writable_path(key: str, path: str | os.PathLike[str], directory: bool = False) -> None:
    """`path` (a file to write, or a directory to create) can be written, before any work; nothing
    is created."""
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
