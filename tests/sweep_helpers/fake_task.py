"""A stand-in task for sweeper tests: gpuopt's real configs, a deterministic TrialResult.

No torch: each trial costs only Hydra's composition, so the sweeper's handling of every status
(ok / oom / diverged / error / a process that dies) is tested in seconds. The stand-in is the task
only: the sweeper runs unpatched, as for any app on gpuopt's configs with a task of its own (its
composed config checked once before the study; no race, and a confirmation in fresh processes
through the sweep's launcher: only gpuopt's own task can be rebuilt in one measuring process).

Its switches are its model's keys (conf/model/fake.yaml: a user model's constructor arguments,
which gpuopt's schema leaves to the model). What it returns:
- throughput (= throughput_amortized) = loader.batch_size * (1 + loader.num_workers), utilization = 50 + 10 * num_workers
- model.width >= 1_000_000 or model.case=oom -> oom; optimizer.lr >= 10 or model.case=diverge -> diverged
- model.case=crash -> the task raises (error); model.case=die -> the process exits without a result
- model.case=segfault / abort / hang -> SIGSEGV, os.abort() (SIGABRT), sleeps for an hour
- model.case=valueerror -> an error result after logging the traceback (as gpuopt's engine does)
- model.pid_dir=D -> the trial process writes its pid as a file name in D (to find it from a test)
- model.await_pids=N (with pid_dir) -> the trial waits (at most AWAIT_S) until D names N processes:
  several workers' first trials overlap by construction, whatever their start-up skew
- model.sleep_s=S -> the trial takes S seconds (for concurrent workers); env records the
  CUDA_VISIBLE_DEVICES the trial process saw
- model.env_digest=NAME -> env records the sha256 of the trial's environment variable NAME
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.core.spec import register_schemas

register_schemas()  # gpuopt's typed schema, which its conf/config.yaml composes (as gpuopt.run)
AWAIT_S = 60.0


class FakeModel:
    """The stand-in's `model._target_` (conf/model/fake.yaml), trusted by name as any user model;
    never built: the stand-in task measures nothing."""


def _await_pids(pid_dir: Path, count: int) -> None:
    deadline = time.monotonic() + AWAIT_S
    while len(list(pid_dir.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def fake_result(cfg: DictConfig) -> TrialResult:
    config = OmegaConf.to_container(cfg, resolve=True)
    fake = cfg.model
    case = fake.case
    if fake.pid_dir:
        (Path(fake.pid_dir) / str(os.getpid())).touch()
        _await_pids(Path(fake.pid_dir), int(fake.await_pids))
    if case == "crash":
        raise RuntimeError("fake crash")
    if case == "die":
        os._exit(3)  # the trial process dies: the launcher has no result to return
    if case == "segfault":
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if case == "abort":
        os.abort()
    if case == "hang":
        time.sleep(3600)
    if case == "valueerror":  # as gpuopt's engine reports a trial that raised: logged, then error
        try:
            raise ValueError("fake: bad shape")
        except ValueError as exc:
            logging.getLogger("gpuopt.engines").warning("trial failed", exc_info=exc)
            return TrialResult(status=Status.ERROR, reason=f"ValueError: {exc}", config=config)
    if fake.sleep_s:
        time.sleep(float(fake.sleep_s))
    if fake.width >= 1_000_000 or case == "oom":
        return TrialResult(status=Status.OOM, reason="fake: out of memory", config=config)
    if cfg.optimizer.lr >= 10 or case == "diverge":
        return TrialResult(status=Status.DIVERGED, reason="fake: loss is nan", config=config)
    workers = cfg.loader.num_workers
    throughput = float(cfg.loader.batch_size * (1 + workers))
    metrics = Metrics(
        throughput=throughput,
        throughput_amortized=throughput,  # no epoch boundary in a fake step
        utilization=50.0 + 10.0 * workers,
        step_time_ms=1000.0 / (1 + workers),
        peak_memory_mb=float(cfg.loader.batch_size),
    )
    env = {"device": "fake", "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if fake.env_digest:  # what the trial got in that variable, as a digest (never the value)
        value = os.environ.get(str(fake.env_digest), "")
        env["digest"] = hashlib.sha256(value.encode()).hexdigest()
    return TrialResult(status=Status.OK, metrics=metrics, config=config, env=env)


@hydra.main(config_path="conf", config_name="fake")
def main(cfg: DictConfig) -> TrialResult:
    return fake_result(cfg)


if __name__ == "__main__":
    main()
