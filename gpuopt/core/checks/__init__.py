"""The one check of a composed config, torch-free, before anything is created: `check_composed`.

Every process that runs or plans a trial calls it once: a trial's own (gpuopt.run, the shared
measuring process and the memory probe, through gpuopt.trial.prepare) and the sweeper, on the
composed config before any study (gpuopt.sweeper.task). Each part runs once, in this order: the
types (the schema), the values (`values`: ranges, names, the distributed group), the workload
(`workload`: model, data and loss configs, their `_target_`s trusted by name), and, given a
machine's facts, the device (`device`: the sweeper's facts come from `python -m gpuopt.env --json`;
a trial's process reads its own from torch once torch is imported, and its
gpuopt.trial.devices.trial_device hands them to `check_device_facts`). Every failure is one
`ConfigError` naming the key, the bad value and what is allowed. What needs torch or the user's
modules (the targets imported, the device resolved) is gpuopt.trial.prepare's.

Also here: `measure_conf` (the measuring API's settings), `check_writable_path` (where a command
writes), and the model's checks a built model answers (`check_module_patterns`).
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gpuopt.core.checks.device import check_device_facts
from gpuopt.core.checks.values import check_values, measure_conf
from gpuopt.core.checks.workload import check_module_patterns, check_workload, matches_any
from gpuopt.core.errors import ConfigError, config_error_from_omegaconf, per_cpu_limit
from gpuopt.core.host import usable_cpus
from gpuopt.core.spec import GpuoptConf, TrialSpec

__all__ = [
    "check_composed",
    "check_device_facts",
    "check_module_patterns",
    "check_writable_path",
    "matches_any",
    "measure_conf",
    "per_cpu_limit",
]


def check_composed(
    cfg: DictConfig,
    cpus: int | None = None,
    facts: dict[str, Any] | None = None,
    run_dir: bool = False,
) -> TrialSpec:
    """The `TrialSpec` of a composed config whose every value checks out; raises `ConfigError`.

    `cpus`: the usable cores of the machine the trials run on, for the caps on workers, threads
    and ranks (default: this one's). `facts`: that machine's devices (`check_device_facts`);
    without them the device is checked where it is resolved. `run_dir`: a single run's
    `hydra.run.dir` can be created too, before Hydra creates it. Imports neither torch nor any
    `_target_`: a LightningModule's own data (no `data` config) is `data={}` until the torch side
    imports the module and asks it.
    """
    container = _resolved_container(cfg)
    try:
        typed: GpuoptConf = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(GpuoptConf), container)
        )  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # a key the schema lacks, a value of the wrong type
        raise config_error_from_omegaconf(exc, container) from None
    check_values(typed, usable_cpus() if cpus is None else cpus)
    check_nodes(typed.distributed, cfg)
    model, data, trusted = check_workload(container, typed)
    if facts is not None:
        check_device_facts(typed, facts)
    if run_dir:
        check_writable_path("hydra.run.dir", str(cfg.hydra.run.dir), directory=True)
    return TrialSpec(
        model=model,
        data=data if data is not None else {},
        loader=typed.loader,
        precision=typed.precision,
        compile=typed.compile,
        cache=typed.cache,
        optimizer=typed.optimizer,
        device=typed.device,
        measure=typed.measure,
        loss=typed.loss,
        seed=typed.seed,
        trusted_targets=trusted,
        engine=typed.engine,
        profile=typed.profile,
        train=typed.train,
        guard=typed.guard,
        distributed=typed.distributed,
    )


# The launchers whose job spans several nodes (gpuopt.sweeper.launchers.slurm's two names).
MULTI_NODE_LAUNCHERS = ("slurm", "gpuopt_slurm")


def check_nodes(dist: Any, cfg: DictConfig) -> None:
    """A trial over several nodes (`distributed.nnodes > 1`) needs a place for its nodes to meet:
    `distributed.rdzv_endpoint` (the first node's host:port), or a SLURM job (hydra/launcher=slurm
    sizes it one task per node; its first node hosts the rendezvous). Anywhere else its one node
    would wait for the others until the rendezvous timed out."""
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
