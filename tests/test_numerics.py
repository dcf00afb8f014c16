"""The numerics guard (gpuopt.trial.numerics): fp32 vs fp32 is drift 0, accumulation splits ~0, a broken
low-precision path is caught and made infeasible, fp16 skipped steps are visible."""

from __future__ import annotations

import math

import pytest
import torch

from gpuopt.core.result import Status
from gpuopt.engines import _guard
from gpuopt.engines.registry import run_trial
from gpuopt.sweeper.objectives import outcome_from_return
from gpuopt.trial import numerics
from gpuopt.trial.prepare import load_spec
from gpuopt.workload.data import SyntheticDataset

CPU = torch.device("cpu")
# A small MLP that learns the synthetic teacher visibly within K=8 steps.
SMALL = [
    "model.width=32",
    "model.depth=1",
    "model.input_shape=[16]",
    "data.size=512",
    "data.sample_cost=0",
    "optimizer.lr=1e-2",
    "loader.batch_size=64",
    "device=cpu",
    "device.num_threads=1",
]
LOSSY = ["model._target_=tests.helpers.numerics_models.LossyHalfNet", "trust=[tests.*]"]
TINY_WINDOW = [
    "measure.warmup_steps=1",
    "measure.min_steps=3",
    "measure.max_steps=4",
    "measure.time_budget_s=0.3",
    "measure.ceiling=false",
    "measure.count_flops=false",
]


@pytest.fixture(autouse=True)
def _fresh_reference_cache(monkeypatch):
    monkeypatch.setattr(numerics, "_reference_cache", {})
    torch.set_num_threads(1)


def _spec(compose_cfg, *overrides):
    return load_spec(compose_cfg(*SMALL, *overrides))


def test_fp32_against_itself_is_no_drift_and_the_loss_falls(compose_cfg):
    spec = _spec(compose_cfg)
    evidence = _guard.check(spec, CPU, changes=["none"])
    assert evidence.passed and evidence.loss_drift == 0.0 and evidence.skipped_steps == 0
    assert evidence.losses == evidence.reference_losses and len(evidence.losses) == 8
    # the synthetic targets come from a teacher: there is something to learn within K steps
    assert evidence.losses[-1] < 0.97 * evidence.losses[0]


def test_accumulation_splits_follow_the_full_batch(compose_cfg):
    for micro in (16, 32, 64):
        spec = _spec(compose_cfg, f"loader.batch_size={micro}", "train.global_batch=128")
        assert numerics.math_changes(spec) == (
            [f"accumulation {128 // micro} x {micro}"] if micro < 128 else []
        )
        evidence = _guard.check(spec, CPU)
        assert evidence.global_batch == 128 and evidence.loss_drift < 1e-5, micro


def test_a_broken_half_precision_path_is_caught(compose_cfg):
    healthy = _guard.check(_spec(compose_cfg, "precision=bf16"), CPU)
    assert healthy.passed and healthy.loss_drift < 0.01
    broken = _guard.check(_spec(compose_cfg, *LOSSY, "precision=bf16"), CPU)
    assert not broken.passed and broken.loss_drift > broken.tolerance == 0.05
    assert broken.changes == ["precision bf16"]
    assert "over tolerance" in broken.summary


def test_a_trial_with_a_broken_path_is_measured_but_infeasible(compose_cfg):
    spec = _spec(compose_cfg, *LOSSY, *TINY_WINDOW, "precision=bf16")
    result = run_trial(spec, device=CPU)
    assert result.status is Status.OK and result.metrics.throughput > 0
    assert result.numerics["passed"] is False and result.metrics.loss_drift > 0.05
    assert result.numerics["losses"] and result.numerics["reference_losses"]
    assert any(w.startswith("numerics: loss_drift") for w in result.warnings)
    outcome = outcome_from_return(result, ["throughput"], ["maximize"])
    assert outcome.constraints["numerics"] == 1.0 and outcome.values == [result.metrics.throughput]
    assert outcome.user_attrs["numerics"]["loss_drift"] == result.metrics.loss_drift


def test_the_guard_runs_only_where_the_math_changes_and_can_be_switched_off(compose_cfg):
    plain = run_trial(_spec(compose_cfg, *TINY_WINDOW), device=CPU)
    assert plain.numerics is None and plain.metrics.loss_drift is None
    off = run_trial(
        _spec(compose_cfg, *LOSSY, *TINY_WINDOW, "precision=bf16", "guard.enabled=false")
    )
    assert off.numerics is None
    assert outcome_from_return(off, ["throughput"], ["maximize"]).constraints["numerics"] == 0.0


def test_fp16_skipped_steps_are_visible(compose_cfg):
    spec = _spec(
        compose_cfg,
        "model._target_=tests.helpers.numerics_models.LoudNet",
        "trust=[tests.*]",
        "precision=fp16",
    )
    evidence = _guard.check(spec, CPU)
    assert evidence.skipped_steps > 0 and "fp16 step(s) skipped" in evidence.summary


def test_the_reference_is_computed_once_and_cached_in_the_sweep_dir(
    compose_cfg, tmp_path, monkeypatch
):
    calls = []
    real = _guard.loss_trajectory
    monkeypatch.setattr(
        _guard,
        "loss_trajectory",
        lambda spec, *a: calls.append(spec.precision.mode) or real(spec, *a),
    )
    spec = _spec(compose_cfg, "precision=bf16")
    first = _guard.check(spec, CPU, cache_dir=tmp_path)
    _guard.check(_spec(compose_cfg, "precision=fp16"), CPU, cache_dir=tmp_path)
    assert calls == ["fp32", "bf16", "fp16"]  # one reference for both: same global batch
    (cached,) = tmp_path.glob("*.json")
    monkeypatch.setattr(numerics, "_reference_cache", {})  # another trial process of the sweep
    again = _guard.check(spec, CPU, cache_dir=tmp_path)
    assert calls[3:] == ["bf16"] and again.reference_losses == first.reference_losses
    assert cached.is_file()


def test_one_reference_on_every_usable_cpu_serves_trials_of_any_thread_count(
    compose_cfg, monkeypatch
):
    """A 1-thread and a 2-thread trial of one global batch share one reference; both
    trajectories train on every usable CPU (not the trial's count), which is restored after."""
    from gpuopt.core.host import usable_cpus

    threads = []
    real = _guard.loss_trajectory
    monkeypatch.setattr(
        _guard,
        "loss_trajectory",
        lambda spec, *a: (
            threads.append((spec.precision.mode, torch.get_num_threads())) or real(spec, *a)
        ),
    )
    before = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            _guard.check(_spec(compose_cfg, "precision=bf16"), CPU)
            assert torch.get_num_threads() == count
    finally:
        torch.set_num_threads(before)
    every = usable_cpus()
    assert threads == [("fp32", every), ("bf16", every), ("bf16", every)]


def test_loss_drift_is_the_largest_relative_deviation():
    assert numerics.loss_drift([2.0, 1.0], [2.0, 1.0]) == 0.0
    assert numerics.loss_drift([2.2, 1.0], [2.0, 1.25]) == pytest.approx(0.2)
    assert numerics.loss_drift([math.nan, 1.0], [2.0, 1.0]) == math.inf


def test_synthetic_targets_follow_a_fixed_teacher():
    data = SyntheticDataset("vectors", [16], 10, size=64, sample_cost=0, seed=3)
    again = SyntheticDataset("vectors", [16], 10, size=64, sample_cost=0, seed=3)
    for i in range(8):
        x, y = data[i]
        assert int(y) == int(torch.argmax(x @ torch.from_numpy(data._teacher)))
        assert torch.equal(again[i][1], y)
    tokens = SyntheticDataset("tokens", [64], 50, size=8, sample_cost=0)
    inputs, targets = tokens[0]
    following = torch.from_numpy(tokens._teacher)
    # most next tokens are the teacher's (a random one at TOKEN_NOISE of the positions)
    assert (following[inputs] == targets).float().mean() > 0.7


def test_a_batch_change_is_guarded_at_the_baseline_batch_on_one_reference(compose_cfg, monkeypatch):
    """guard.global_batch (a sweep sets the baseline's): a bf16 trial at another batch is checked
    at that batch, on the reference a bf16 trial of that batch uses; an accumulating trial keeps
    its own batch (its split is what the guard checks)."""
    batches = []
    real = _guard.loss_trajectory
    monkeypatch.setattr(
        _guard,
        "loss_trajectory",
        lambda spec, *a: batches.append((spec.precision.mode, spec.global_batch)) or real(spec, *a),
    )
    at_baseline = ["guard.global_batch=64", "precision=bf16"]
    own = _guard.check(_spec(compose_cfg, *at_baseline), CPU)
    bigger = _guard.check(_spec(compose_cfg, *at_baseline, "loader.batch_size=256"), CPU)
    assert batches == [("fp32", 64), ("bf16", 64), ("bf16", 64)]  # one reference, no batch 256
    assert own.trial_global_batch is None and own.global_batch == 64
    assert bigger.global_batch == 64 and bigger.trial_global_batch == 256
    assert bigger.passed and "checked at global batch 64, the trial trains 256" in bigger.summary
    split = _spec(compose_cfg, *at_baseline, "loader.batch_size=64", "train.global_batch=128")
    assert numerics.guarded_spec(split) is split
    assert _guard.check(split, CPU).global_batch == 128
