"""The numerics guard of a distributed trial, with real gloo ranks of world size 2 on this CPU: a
DDP / FSDP2 job from the command line is one printed result whose ranks' averaged loss trajectory
on the same global batch follows the single-process fp32 reference to rounding; it drifts by bf16
rounding under an FSDP2 bf16 param policy, and a parameter left out of the gradient reduction (the
ranks' replicas drift apart) shows as drift."""

from __future__ import annotations

import re

import pytest
import torch

from gpuopt.core.checks import check_module_patterns
from gpuopt.core.errors import ConfigError
from gpuopt.core.result import Status, TrialResult
from gpuopt.engines import _guard
from gpuopt.engines.registry import run_trial
from gpuopt.trial.prepare import load_spec
from gpuopt.workload.models import MLP
from tests.helpers.cli import run_cli

# A small MLP that learns within the guard's K=8 steps; global batch 128 = 32 x 2 x 2 ranks.
SMALL = [
    "model.width=32",
    "model.depth=1",
    "model.input_shape=[16]",
    "data.size=512",
    "data.sample_cost=0",
    "optimizer.lr=1e-2",
    "loader.batch_size=32",
    "train.global_batch=128",
    "distributed.nproc_per_node=2",
    "device=cpu",
    "device.num_threads=1",
    "measure.warmup_steps=1",
    "measure.min_steps=3",
    "measure.max_steps=4",
    "measure.time_budget_s=0.3",
    "measure.ceiling=false",
    "measure.count_flops=false",
]
UNREDUCED = ["model._target_=tests.test_distributed_numerics.UnreducedMLP", "trust=[tests.*]"]
# fp32 over ranks differs from one process by the summation order of the reduction only (2e-7
# measured): a tolerance this tight passes it and fails anything that changes the math.
TIGHT = "guard.loss_tolerance=1e-4"
CPU = "cpu"


class UnreducedMLP(MLP):
    """gpuopt's MLP whose parameters DDP leaves out of its all-reduce (DDP's own
    `_ddp_params_and_buffers_to_ignore`): each rank steps on its own share of the batch, the bug a
    wrong sharding or a missing reduction is."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        names = [name for name, _ in self.named_parameters()]
        self._ddp_params_and_buffers_to_ignore = names[:-1]  # DDP needs one it reduces


def _guarded(compose_cfg, *overrides):
    result = run_trial(load_spec(compose_cfg(*SMALL, *overrides)))
    assert result.status is Status.OK, result.reason
    return result, result.numerics


# Each kind's own knobs ride along: none of them changes the math (the guard must not list them).
KIND_KNOBS = {
    "ddp": ["distributed.bucket_cap_mb=1", "distributed.gradient_as_bucket_view=true"],
    "fsdp2": [
        "distributed.shard_modules=[Sequential]",
        "distributed.checkpoint_modules=[Sequential]",
    ],
}


@pytest.mark.slow  # starts real gloo ranks in subprocesses
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_job_from_the_command_line_is_one_result_and_its_fp32_ranks_follow_the_reference(
    tmp_path, compose_cfg, kind
):
    """One `python -m gpuopt.run distributed=KIND` job: one printed result for both ranks (merged
    as trial/ranks says), and its ranks' loss trajectory is the single-process reference's."""
    overrides = [*SMALL, f"distributed={kind}", *KIND_KNOBS[kind]]
    proc = run_cli(tmp_path, *overrides, TIGHT, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("gpuopt trial: ok") == 1 and "2 (gloo)" in proc.stdout
    (path,) = (tmp_path / "outputs" / "runs").glob("*/*/result.json")
    result = TrialResult.load(path)
    m = result.metrics
    assert result.status is Status.OK and m.world_size == 2 and result.env["backend"] == "gloo"
    assert result.config["distributed"]["kind"] == kind
    # global batch 128 = micro-batch 32 x accumulation 2 x 2 ranks
    assert (m.global_batch, m.micro_batch, m.accumulation_steps) == (128, 32, 2)
    rows = result.ranks
    assert [row["rank"] for row in rows] == [0, 1]
    assert rows[0]["timed_steps"] == rows[1]["timed_steps"] == m.timed_steps  # steps agreed
    samples = sum(row["throughput"] * row["timed_seconds"] for row in rows)
    assert m.timed_seconds == max(row["timed_seconds"] for row in rows)
    assert m.throughput == pytest.approx(samples / m.timed_seconds)
    slowest = max(rows, key=lambda row: row["step_time_ms"])
    assert m.straggler_rank == slowest["rank"] and m.step_time_ms == slowest["step_time_ms"]
    assert m.peak_memory_mb == max(row["peak_memory_mb"] for row in rows)
    found = result.numerics
    assert found["passed"] and found["loss_drift"] < 1e-5, found["summary"]
    assert found["changes"] == ["accumulation 2 x 32", f"{kind} x 2 ranks"]
    assert len(found["losses"]) == 8 and found["losses"][-1] < found["losses"][0]
    # rank 0 compared with the reference one process trains on the job's global batch
    spec = load_spec(compose_cfg(*overrides))
    batches = _guard.fixed_batches(spec, 8)
    alone = _guard.reference_losses(spec, torch.device(CPU), batches, None)
    assert found["reference_losses"] == pytest.approx(alone, rel=1e-9)
    assert m.loss_drift == found["loss_drift"]


@pytest.mark.slow  # starts real gloo ranks in subprocesses
def test_a_bf16_shard_policy_drifts_by_its_rounding(compose_cfg):
    _, found = _guarded(compose_cfg, "distributed=fsdp2", "distributed.param_dtype=bf16", TIGHT)
    assert not found["passed"] and 1e-4 < found["loss_drift"] < 0.05, found["summary"]
    assert found["changes"][-1] == "fsdp2 x 2 ranks (param bf16)"


@pytest.mark.slow  # starts real gloo ranks in subprocesses
def test_parameters_left_out_of_the_reduction_show_as_drift(compose_cfg):
    """The default tolerance (0.05): each rank's replica steps on its own half of the batch."""
    result, found = _guarded(compose_cfg, "distributed=ddp", *UNREDUCED, "optimizer.lr=0.1")
    assert not found["passed"] and found["loss_drift"] > 0.05, found["summary"]
    assert any(w.startswith("numerics: loss_drift") for w in result.warnings)


# -- distributed.shard_modules / checkpoint_modules that match no submodule ------------------------
def test_a_pattern_matching_no_submodule_is_one_line_naming_the_classes():
    with pytest.raises(ConfigError) as info:
        check_module_patterns(
            "distributed.shard_modules", ["*Block", "Blok"], ["Linear", "MyBlock"]
        )
    error = info.value
    assert (error.key, error.value) == ("distributed.shard_modules", ["Blok"])
    assert "Linear, MyBlock" in error.allowed and "\n" not in str(error)
    check_module_patterns("distributed.shard_modules", ["*Block", "Linear"], ["Linear", "MyBlock"])


def test_a_builtin_models_bad_pattern_is_the_trials_error_before_any_rank(compose_cfg, monkeypatch):
    from gpuopt.trial import distributed

    monkeypatch.setattr(distributed, "run_ranks", pytest.fail)  # no rank may start
    spec = load_spec(compose_cfg(*SMALL, "distributed=fsdp2", "distributed.shard_modules=[Blok]"))
    result = run_trial(spec)
    assert result.status is Status.ERROR
    assert result.reason.startswith("invalid config: distributed.shard_modules=['Blok']; allowed:")
    assert "Linear" in result.reason and "\n" not in result.reason


@pytest.mark.slow  # starts real gloo ranks in subprocesses
def test_another_models_bad_pattern_is_the_trials_error_from_its_ranks(compose_cfg):
    overrides = [*UNREDUCED, "distributed=fsdp2", "distributed.checkpoint_modules=[Nope*]"]
    result = run_trial(load_spec(compose_cfg(*SMALL, *overrides)))
    assert result.status is Status.ERROR
    # both ranks fail alike; the first to fail is the reason
    says = "ConfigError: invalid config: distributed.checkpoint_modules=['Nope*']; allowed:"
    assert re.match(rf"rank [01]: {re.escape(says)}", result.reason), result.reason
    assert "Linear" in result.reason and "\n" not in result.reason
