"""A stand-in trial engine for sweeper tests: gpuopt's real configs, a deterministic TrialResult.

No torch: each trial costs only Hydra's composition, so the sweeper's handling of every status
(ok / oom / diverged / error / a process that dies) is tested in seconds. What it returns:
- throughput (= throughput_amortized) = loader.batch_size * (1 + loader.num_workers), utilization = 50 + 10 * num_workers
- model.width >= 1_000_000 or +case=oom -> oom; optimizer.lr >= 10 or +case=diverge -> diverged
- +case=crash -> the task raises (error); +case=die -> the process exits without a result
- +case=segfault / abort / hang -> SIGSEGV, os.abort() (SIGABRT), sleeps for an hour
- +case=valueerror -> an error result after logging the traceback (as gpuopt's engine does)
- +pid_dir=D -> the trial process writes its pid as a file name in D (to find it from a test)
- +sleep_s=S -> the trial takes S seconds (for concurrent workers); env records the
  CUDA_VISIBLE_DEVICES the trial process saw
- +env_digest=NAME -> env records the sha256 of the trial's environment variable NAME
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

import gpuopt.core.checks
import gpuopt.sweeper.confirm.in_process
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.core.spec import register_schemas

register_schemas()

# The keys above (`+case`, `+pid_dir`, `+sleep_s`, `+env_digest`) are this stand-in's, not gpuopt's schema: the
# sweeper's one check of the composed config (gpuopt.core.checks.check_composed) sees the config
# without them, and checks everything else as it does for `python -m gpuopt.run -m`.
FAKE_KEYS = ("case", "pid_dir", "sleep_s", "env_digest")
_check_composed = gpuopt.core.checks.check_composed


def _check_without_fake_keys(cfg: DictConfig, *args: Any, **kwargs: Any) -> Any:
    return _check_composed(
        OmegaConf.masked_copy(cfg, [k for k in cfg if k not in FAKE_KEYS]), *args, **kwargs
    )


gpuopt.core.checks.check_composed = _check_without_fake_keys

# The confirmation re-measures in fresh processes here: its in-process mode builds the real engine
# (gpuopt.processes.shared_windows), whose numbers are not this stand-in's. tests/test_interleave.py and the
# real-engine sweep in tests/test_sweep_e2e.py test that mode.
gpuopt.sweeper.confirm.in_process.open_shared = lambda *args, **kwargs: None


def fake_result(cfg: DictConfig) -> TrialResult:
    config = OmegaConf.to_container(cfg, resolve=True)
    case = cfg.get("case")
    if cfg.get("pid_dir"):
        (Path(cfg.pid_dir) / str(os.getpid())).touch()
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
    if cfg.get("sleep_s"):
        time.sleep(float(cfg.sleep_s))
    if cfg.model.width >= 1_000_000 or case == "oom":
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
    if cfg.get("env_digest"):  # what the trial got in that variable, as a digest (never the value)
        value = os.environ.get(str(cfg.env_digest), "")
        env["digest"] = hashlib.sha256(value.encode()).hexdigest()
    return TrialResult(status=Status.OK, metrics=metrics, config=config, env=env)


@hydra.main(config_path="pkg://gpuopt.conf", config_name="config")
def main(cfg: DictConfig) -> TrialResult:
    return fake_result(cfg)


if __name__ == "__main__":
    main()
