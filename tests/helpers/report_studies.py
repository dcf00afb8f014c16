"""Real Optuna studies in a SQLite file, written by the gpuopt sweeper's own code.

Each trial is asked from Optuna with enqueued parameters (the baseline flagged as the sweeper's
`_enqueue_baseline` does), its `TrialResult` comes back in a Hydra `JobReturn` and goes through the
sweeper's public `gpuopt.sweeper.record.outcome_of` and `record_trial` (values, constraints, user attributes, overrides, run_dir), and its
resolved config is composed by Hydra from its overrides: the report is tested on what a sweep
stores.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution

from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_OVERRIDES,
    STUDY_DIRECTIONS,
    STUDY_HARDWARE,
    STUDY_OBJECTIVES,
)
from gpuopt.sweeper.record import outcome_of, record_trial

# The search space of the test studies, as hydra-optuna-sweeper would declare it with choice(...).
DISTRIBUTIONS = {
    "loader.batch_size": CategoricalDistribution([32, 64, 128, 256, 1024]),
    "loader.num_workers": CategoricalDistribution([0, 1, 2]),
    "precision": CategoricalDistribution(["fp32", "bf16", "fp16"]),
    "optimizer": CategoricalDistribution(["adamw", "sgd"]),
}
CPU_ENV = {"device": "cpu", "device_name": "Test CPU", "torch": "2.13.0"}
GPU_ENV = {"device": "cuda:0", "device_name": "NVIDIA H200", "torch": "2.13.0"}


@functools.cache
def _compose(overrides: tuple[str, ...]) -> str:
    """Composing takes ~0.5 s here: each distinct override list is composed once per session."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from gpuopt.core.spec import register_schemas

    register_schemas()
    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return json.dumps(OmegaConf.to_container(cfg, resolve=True))


def compose_config(overrides: Sequence[str]) -> dict[str, Any]:
    """The resolved trial config Hydra composes from gpuopt's conf/ and these overrides."""
    return json.loads(_compose(tuple(overrides)))


def overrides_for(params: dict[str, Any]) -> list[str]:
    return [f"{key}={value}" for key, value in params.items()]


@dataclass
class Planned:
    """One trial to write: its parameters, how it ended and what it measured."""

    params: dict[str, Any]
    status: Status = Status.OK
    metrics: dict[str, Any] = field(default_factory=dict)
    baseline: bool = False
    env: dict[str, Any] = field(default_factory=lambda: dict(CPU_ENV))
    running: bool = False  # asked, never told
    enqueue: bool = True  # False: take the trial the study has queued (e.g. a re-run)


def build_study(
    storage: str | optuna.storages.BaseStorage,
    name: str,
    planned: Sequence[Planned],
    objectives: Sequence[str] = ("throughput",),
    directions: Sequence[str] = ("maximize",),
    hardware: dict[str, Any] | None = None,
    compose: bool = True,
    study_attrs: dict[str, Any] | None = None,
) -> None:
    """Write a study into `storage` (e.g. a tmp SQLite URL).

    The trials are run through ask/tell in memory, then copied with `optuna.copy_study`: the same
    rows in the file, one transaction per trial instead of one per attribute (SQLite commits cost
    ~10 ms each here, the tests would spend seconds in fsync). Pass one `RDBStorage` for several
    studies: opening a URL checks or creates Optuna's schema each time (~1 s here).
    """
    study = optuna.create_study(study_name=name, directions=list(directions))
    study.set_user_attr(STUDY_OBJECTIVES, list(objectives))
    study.set_user_attr(STUDY_DIRECTIONS, list(directions))
    study.set_user_attr(STUDY_HARDWARE, hardware or {"cpu": "Test CPU", "cpu_count": 2, "gpus": []})
    for key, value in (study_attrs or {}).items():
        study.set_user_attr(key, value)
    add_trials(study, planned, compose)
    optuna.copy_study(from_study_name=name, from_storage=study._storage, to_storage=storage)


def add_trials(study: optuna.Study, planned: Sequence[Planned], compose: bool = True) -> None:
    objectives = study.user_attrs[STUDY_OBJECTIVES]
    directions = study.user_attrs[STUDY_DIRECTIONS]
    for plan in planned:
        if plan.enqueue:
            baseline_attrs = {ATTR_BASELINE: True} if plan.baseline else None
            study.enqueue_trial(plan.params, user_attrs=baseline_attrs)
        trial = study.ask({k: DISTRIBUTIONS[k] for k in plan.params})
        overrides = overrides_for(plan.params)
        if plan.running:
            trial.set_user_attr(ATTR_OVERRIDES, overrides)
            continue
        result = TrialResult(
            status=plan.status,
            metrics=Metrics(**plan.metrics),
            reason=None if plan.status is Status.OK else f"{plan.status.value}: test",
            # Failed trials carry their config too in a sweep; the report never reads it, and
            # each composition costs ~0.6 s here, so only ok trials get one.
            config=compose_config(overrides) if compose and plan.status is Status.OK else {},
            env=plan.env,
        )
        ret = JobReturn(overrides=overrides, status=JobStatus.COMPLETED, _return_value=result)
        ret.hydra_cfg = OmegaConf.create(
            {"hydra": {"runtime": {"output_dir": f"outputs/sweeps/test/trial_{trial.number}"}}}
        )
        outcome = outcome_of(ret, objectives, directions)
        record_trial(study, trial, overrides, ret, outcome)


def input_bound_metrics(
    throughput: float, data_wait: float, input_efficiency: float
) -> dict[str, Any]:
    """CPU metrics: utilization = 100 - data_wait, MFU not measured (None)."""
    return {
        "throughput": throughput,
        "step_time_ms": 1000.0 * 64 / throughput,
        "data_wait": data_wait,
        "utilization": 100.0 - data_wait,
        "input_efficiency": input_efficiency,
        "ceiling_throughput": throughput * 100.0 / input_efficiency,
        "mfu": None,
        "peak_memory_mb": 300.0,
    }


def cpu_params(
    batch_size: int, num_workers: int, precision: str = "fp32", optimizer: str = "adamw"
) -> dict[str, Any]:
    return {
        "loader.batch_size": batch_size,
        "loader.num_workers": num_workers,
        "precision": precision,
        "optimizer": optimizer,
    }


# A CPU loader study: the baseline (#0) is input-bound; the best (#5) uses more workers, a bigger
# batch and SGD (a group choice that also changes optimizer.lr); one oom, one diverged, one error,
# one still running.
CPU_TRIALS = [
    Planned(cpu_params(32, 0), metrics=input_bound_metrics(1000, 42.0, 55.0), baseline=True),
    Planned(cpu_params(64, 2), metrics=input_bound_metrics(1800, 4.0, 95.0)),
    Planned(cpu_params(1024, 2, "bf16"), status=Status.OOM),
    Planned(cpu_params(256, 1, "fp16"), status=Status.DIVERGED),
    Planned(cpu_params(128, 1, "bf16"), status=Status.ERROR),
    Planned(cpu_params(128, 2, optimizer="sgd"), metrics=input_bound_metrics(2500, 2.0, 97.0)),
    Planned(cpu_params(256, 0), metrics=input_bound_metrics(1500, 30.0, 60.0)),
    Planned(cpu_params(64, 1, "bf16"), metrics=input_bound_metrics(600, 5.0, 94.0)),
    Planned(cpu_params(256, 2, "bf16"), metrics=input_bound_metrics(900, 3.0, 96.0)),
    Planned(cpu_params(32, 2), metrics=input_bound_metrics(1300, 12.0, 80.0)),
    Planned(cpu_params(128, 0), running=True),
]
CPU_STUDY = "mlp-loader-cpu2"


def gpu_metrics(
    throughput: float, utilization: float, mfu: float, peak_memory_mb: float
) -> dict[str, Any]:
    return {
        "throughput": throughput,
        "utilization": utilization,
        "mfu": mfu,
        "data_wait": 0.5,
        "input_efficiency": 99.0,
        "peak_memory_mb": peak_memory_mb,
        "step_time_ms": 1000.0 * 128 / throughput,
    }


# A two-objective GPU study (throughput up, peak memory down): #0 host-bound baseline, #1
# memory-bound, #2 and #3 on the Pareto front, #4 dominated, #5 oom (peak memory told as +inf).
GPU_TRIALS = [
    Planned(
        cpu_params(32, 2), metrics=gpu_metrics(9000, 45.0, 4.0, 900), env=GPU_ENV, baseline=True
    ),
    Planned(cpu_params(256, 2), metrics=gpu_metrics(20000, 97.0, 9.0, 5000), env=GPU_ENV),
    Planned(cpu_params(256, 2, "bf16"), metrics=gpu_metrics(41000, 98.0, 55.0, 3000), env=GPU_ENV),
    Planned(cpu_params(64, 2, "bf16"), metrics=gpu_metrics(30000, 96.0, 35.0, 1200), env=GPU_ENV),
    Planned(cpu_params(128, 2, "fp16"), metrics=gpu_metrics(25000, 96.0, 30.0, 3500), env=GPU_ENV),
    Planned(cpu_params(1024, 2, "bf16"), status=Status.OOM, env=GPU_ENV),
]
GPU_STUDY = "cnn-precision-h200"
GPU_HARDWARE = {
    "id": "h200-abc123",
    "cpu": "Test CPU",
    "cpu_count": 16,
    "gpus": ["NVIDIA H200"],
    "env": {"device": "cuda", "device_name": "NVIDIA H200"},
}


def build_cpu_study(
    storage: str | optuna.storages.BaseStorage,
    name: str = CPU_STUDY,
    study_attrs: dict[str, Any] | None = None,
) -> None:
    build_study(storage, name, CPU_TRIALS, study_attrs=study_attrs)


def build_gpu_study(storage: str | optuna.storages.BaseStorage, name: str = GPU_STUDY) -> None:
    build_study(
        storage,
        name,
        GPU_TRIALS,
        objectives=("throughput", "peak_memory_mb"),
        directions=("maximize", "minimize"),
        hardware=GPU_HARDWARE,
        compose=False,
    )


def confirmation_record(tie: bool = False, same_training: bool = False) -> dict[str, Any]:
    """The sweeper's confirmation attribute for CPU_TRIALS, built with its own code
    (gpuopt/sweeper/confirm/verdicts.py, as the round records it): trial #5's first measurement
    was lucky, re-measured #1 is faster, so the confirmed winner is #1. `tie`: both candidates
    re-measure like the baseline, so the baseline stays the best. `same_training`: #9 (the
    baseline's batch, 2 workers) is a candidate too, flagged same training and faster than the
    baseline: answer (a), beside #1's (b)."""
    from gpuopt.study.records import ConfirmedConfig
    from gpuopt.sweeper.confirm.verdicts import compare

    def config(label: str, number: int, again: list[float]) -> ConfirmedConfig:
        params = CPU_TRIALS[number].params
        return ConfirmedConfig(
            label,
            number,
            dict(params),
            overrides_for(params),
            list(again),
            ["ok"] * len(again),
        )

    configs = [
        config("baseline", 0, [980.0, 1010.0]),
        config("candidate1", 5, [1005.0, 975.0] if tie else [1500.0, 1550.0]),
        config("candidate2", 1, [1020.0, 960.0] if tie else [1950.0, 2000.0]),
    ]
    if same_training:
        configs.append(config("candidate3", 9, [1270.0, 1290.0]))
        configs[-1].same_training = True
    record = {
        "objective": "throughput",
        "direction": "maximize",
        "rounds": 2,
        "top_k": 2,
        "after_trials": 10,
        "time": "2026-01-01T00:00:00",
        "sweep_dir": "outputs/sweeps/test",
        "configs": [vars(c) for c in configs],
        **compare(configs, "maximize"),
    }
    return json.loads(json.dumps(record))


@contextlib.contextmanager
def fast_storage_dir(fallback: Path) -> Iterator[Path]:
    """A folder for test databases on tmpfs (/dev/shm) when there is one, else `fallback`.

    Still a real SQLite file; tmpfs only skips the fsync of each commit, which costs ~10-500 ms
    on this machine's disk (Optuna creating its schema alone commits dozens of times).
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        folder = Path(tempfile.mkdtemp(prefix="gpuopt-report-", dir=shm))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    else:
        yield fallback
