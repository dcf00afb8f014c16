"""A user's own training measured as one trial however it runs: the Hugging Face Trainer
(gpuopt.HFMeasureCallback) in one process, and a torchrun-style script that initialized its own
process group (gpuopt.measure_step returns the job's result). The Trainer under torchrun and a
failing rank are swept in tests/test_user_sweeps.py (one run of each path, not two). Real parts:
the real Trainer on a GPT-2 built from a config, gloo at world size 2 on the 2 cores, torch's own
`torch.distributed.run` (torchrun) starting the ranks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpuopt.core.result import Status, TrialResult
from tests.helpers.user_jobs import HF_SCRIPT, TORCHRUN_SCRIPT

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # each test starts one or two real training processes


def _run(tmp_path: Path, script: str, nproc: int = 0, **env: str) -> tuple[TrialResult | None, str]:
    """The script run (under torchrun with `nproc` ranks), its saved result and its output."""
    path = tmp_path / "train.py"
    path.write_text(script)
    result = tmp_path / "result.json"
    command = [sys.executable, str(path)]
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        command += ["--standalone", str(path)]
    environ = {**os.environ, "RESULT": str(result), "OUT": str(tmp_path / "out"), **env}
    environ["OMP_NUM_THREADS"] = "1"
    process = subprocess.Popen(
        command,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=300)
    finally:  # the launcher and every rank it started: none outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return (TrialResult.load(result) if result.exists() else None), output


def test_the_hf_trainer_is_measured_in_optimizer_steps_with_its_global_batch(tmp_path):
    result, output = _run(tmp_path, HF_SCRIPT)
    assert result is not None, output
    assert result.status is Status.OK, result.reason
    m = result.metrics
    # 8 per device x 2 accumulated micro-batches, one process: what one optimizer step trains on
    assert (m.micro_batch, m.accumulation_steps, m.global_batch) == (8, 2, 16)
    assert m.compute_dtype == "fp32"  # no bf16/fp16/tf32 in its arguments
    assert m.lr == pytest.approx(5e-5)
    assert m.timed_steps and m.timed_steps >= 5 and m.throughput and m.throughput > 0
    assert m.data_wait is not None and 0 <= m.data_wait < 100
    assert m.flops_per_sample and m.flops_per_sample > 0  # the first warm-up step, counted
    assert result.config["trainer"]["gradient_accumulation_steps"] == 2
    # The window ended the training long before max_steps=200 (one line per step is no output)
    assert m.timed_steps < 150


def test_a_trainer_that_diverges_or_ends_too_soon_is_a_status_not_an_exception(tmp_path):
    diverged, output = _run(tmp_path, HF_SCRIPT, LR="1e30")
    assert diverged is not None, output
    assert diverged.status is Status.DIVERGED, diverged.reason
    short, output = _run(tmp_path, HF_SCRIPT, STEPS="3")
    assert short is not None, output
    assert short.status is Status.ERROR and "before the timed window did" in (short.reason or "")


def test_a_torchrun_script_gets_the_jobs_result_from_measure_step(tmp_path):
    result, output = _run(tmp_path, TORCHRUN_SCRIPT, nproc=2)
    assert result is not None, output
    assert result.status is Status.OK, result.reason
    m = result.metrics
    assert m.world_size == 2 and m.global_batch == 32 and m.straggler_rank in (0, 1)
    assert len({r["timed_steps"] for r in result.ranks or []}) == 1
    assert "no compute ceiling in a multi-rank job" in " ".join(result.warnings)
