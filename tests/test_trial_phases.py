"""A whole trial's phase clock (the result's `phases`) and "do each thing once" in one trial process:
the FLOP count and the numerics guard's fp32 reference are computed once per process for what they
depend on (gpuopt.engines.native.flops_key, gpuopt.trial.numerics.reference_key), and reused
identically. In-process, tiny CPU trials; calls are counted, nothing is timed."""

from __future__ import annotations

import struct
import time

import pytest
import torch

from gpuopt.core.result import ATTR_PHASES, Status, TrialResult, result_user_attrs
from gpuopt.engines import _guard, native
from gpuopt.engines.registry import run_trial
from gpuopt.trial import numerics
from gpuopt.trial.context import Trial
from gpuopt.trial.prepare import load_spec
from tests.conftest import TINY_TRIAL

CPU = torch.device("cpu")
MLP = ["model=mlp", "model.width=16", "model.depth=1", "model.input_shape=[12]"]
FAMILIES = {
    # width 8: channels_last at width 4 has 1x1 stride-2 shortcuts of 4 input channels, which
    # oneDNN's AVX2 kernel crashes on (gpuopt.trial.library_bugs refuses them on such CPUs).
    "cnn": ["model=cnn", "model.width=8", "model.depth=1", "model.input_shape=[3,8,8]"],
    "transformer": ["model=transformer", "model.width=16", "model.depth=1", "model.heads=2",
                    "model.input_shape=[8]", "model.num_classes=32"],
}  # fmt: skip
GUARD = ["guard.steps=3", "data.sample_cost=0"]
# The phases of a native trial, in the order they run (profile off; a guarded configuration).
ORDER = ["setup", "build", "first_batch", "flops", "warmup", "window", "boundary", "loader_cost",
         "ceiling", "peak_probe", "release", "fingerprint", "guard", "guard_reference", "other"]  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch):
    """Each test starts as a fresh trial process would: nothing counted or trained yet."""
    monkeypatch.setattr(native, "_flops_per_sample", {})
    monkeypatch.setattr(numerics, "_reference_cache", {})


def _spec(compose_cfg, *overrides):
    return load_spec(compose_cfg(*TINY_TRIAL, *overrides))


def _counting(monkeypatch, module, name):
    """Wrap module.name so its calls are counted (the real function still runs)."""
    real, calls = getattr(module, name), []

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_the_phase_clock_names_each_phase_in_order_and_sums_to_the_trials_wall_time(compose_cfg):
    spec = _spec(compose_cfg, *MLP, *GUARD, "precision=bf16")
    started = time.perf_counter()
    result = run_trial(spec, device=CPU)
    wall = time.perf_counter() - started
    assert result.status is Status.OK, result.reason
    phases = result.phases
    assert list(phases) == ORDER  # every phase the trial ran, in the order it first ran
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["window"] > 0 and phases["guard"] > 0 and phases["guard_reference"] > 0
    # run_measured's wall time, tiled: the phases (`other` the rest) sum to it, inside the call's.
    assert sum(phases.values()) <= wall
    assert sum(phases.values()) == pytest.approx(wall, rel=0.2)
    # The timed window's own clock lies inside its phase.
    assert result.metrics.timed_seconds <= phases["window"]
    # It travels as the result's other dict fields do: result.json and the study's user attrs.
    assert TrialResult.from_dict(result.to_dict()).phases == phases
    assert result_user_attrs(result)[ATTR_PHASES] == pytest.approx(phases)


def test_the_clock_leaves_out_what_a_trial_did_not_run_and_keeps_a_failures_phases(compose_cfg):
    off = ["measure.ceiling=false", "measure.count_flops=false", "measure.loader_cost=false"]
    quiet = run_trial(_spec(compose_cfg, *MLP, *off, "measure.peak_probe=false"), device=CPU)
    assert quiet.status is Status.OK, quiet.reason
    assert set(quiet.phases).isdisjoint({"flops", "ceiling", "loader_cost", "peak_probe", "guard"})
    # A trial that diverges: the phases up to the failure, and what ran after it.
    failed = run_trial(_spec(compose_cfg, *MLP, "optimizer=sgd", "optimizer.lr=1e30"), device=CPU)
    assert failed.status is Status.DIVERGED
    assert {"setup", "build", "release", "other"} <= set(failed.phases)
    assert "guard" not in failed.phases  # the guard runs after a trial measured ok only


def test_trial_phase_sums_a_phase_that_runs_twice_also_when_it_raises():
    trial = Trial(spec=None, device=CPU)  # type: ignore[arg-type]
    with trial.phase("a"):
        pass
    with pytest.raises(ValueError), trial.phase("a"):
        raise ValueError
    with trial.phase("b"):
        pass
    assert list(trial.phases) == ["a", "b"] and trial.phases["a"] > 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flops_are_counted_once_per_process_and_equal_a_recount(compose_cfg, monkeypatch, family):
    counts = _counting(monkeypatch, native, "measure_step_flops")
    # The baseline, then configurations that differ in the searched knobs only.
    configs = [[], ["precision=bf16", "loader.batch_size=16"], ["precision=fp16"]]
    if family == "cnn":
        configs.append(["model.channels_last=true"])
    per_sample = []
    for overrides in configs:
        spec = _spec(compose_cfg, *FAMILIES[family], *overrides)
        per_sample.append(_flops_of(spec))
    assert len(counts) == 1  # counted for the first configuration only
    # Each reused count is what counting that configuration afresh gives.
    for overrides, reused in zip(configs[1:], per_sample[1:], strict=True):
        native._flops_per_sample.clear()
        spec = _spec(compose_cfg, *FAMILIES[family], *overrides)
        assert _flops_of(spec) == reused == per_sample[0]
    assert len(counts) == len(configs)
    # What the count depends on is a new key: another model width is counted.
    _flops_of(_spec(compose_cfg, *FAMILIES[family], "model.width=12"))
    assert len(counts) == len(configs) + 1


def _flops_of(spec):
    """The native engine's FLOP count of `spec` (its build, its first micro-batch)."""
    trial = Trial(spec, CPU)
    workload, feed = native.build(trial, native.apply_policies(spec, CPU))
    try:
        native.count_flops(trial, workload, feed.next_step()[0])
    finally:
        feed.close()
    return trial.metrics.flops_per_sample, trial.metrics.hardware_flops_per_sample


def test_two_trials_of_one_process_count_flops_and_train_the_reference_once(
    compose_cfg, monkeypatch
):
    flops = _counting(monkeypatch, native, "measure_step_flops")
    trained = _counting(monkeypatch, _guard, "loss_trajectory")
    first = run_trial(_spec(compose_cfg, *MLP, *GUARD, "precision=bf16"), device=CPU)
    second = run_trial(_spec(compose_cfg, *MLP, *GUARD, "precision=fp16"), device=CPU)
    assert first.status is second.status is Status.OK, (first.reason, second.reason)
    assert len(flops) == 1 and first.metrics.flops_per_sample == second.metrics.flops_per_sample
    # The guard trained: the first trial's reference and trajectory, the second's trajectory only.
    assert [call[0].precision.mode for call in trained] == ["fp32", "bf16", "fp16"]
    assert first.numerics["reference_losses"] == second.numerics["reference_losses"]


def _bits(losses):
    return [struct.pack("<d", loss).hex() for loss in losses]


def test_a_cached_reference_is_bit_identical_to_a_recomputed_one(compose_cfg, monkeypatch):
    trained = _counting(monkeypatch, _guard, "loss_trajectory")
    torch.set_num_threads(1)
    bf16 = _spec(compose_cfg, *MLP, *GUARD, "precision=bf16", "loader.batch_size=16")
    # The same reference: another precision, the same global batch in two micro-batches.
    split = _spec(compose_cfg, *MLP, *GUARD, "precision=fp16", "loader.batch_size=8",
                  "train.global_batch=16")  # fmt: skip
    first = _guard.check(bf16, CPU)
    again = _guard.check(split, CPU)
    assert len(trained) == 3  # reference once, then each trial's own trajectory
    assert _bits(again.reference_losses) == _bits(first.reference_losses)
    numerics._reference_cache.clear()  # a fresh process: the reference trained afresh
    recomputed = _guard.check(split, CPU)
    assert len(trained) == 5
    assert _bits(recomputed.reference_losses) == _bits(first.reference_losses)


def test_the_reference_key_follows_what_the_reference_depends_on(compose_cfg, monkeypatch):
    trained = _counting(monkeypatch, _guard, "loss_trajectory")
    torch.set_num_threads(1)
    base = [*MLP, *GUARD, "precision=bf16", "loader.batch_size=16"]
    _guard.check(_spec(compose_cfg, *base), CPU)
    references = 1
    # Each of these changes the reference: it is trained again, not taken from the cache.
    for change in ["optimizer.lr=0.5", "seed=3", "loader.batch_size=32", "guard.steps=2"]:
        _guard.check(_spec(compose_cfg, *base, change), CPU)
        references += 1
        assert len(trained) == 2 * references, change
    # A trial's thread count does not reach the reference (it trains on every usable CPU): reused.
    torch.set_num_threads(2)
    try:
        _guard.check(_spec(compose_cfg, *base), CPU)
    finally:
        torch.set_num_threads(1)
    assert len(trained) == 2 * references + 1
    # The tolerance only reads the reference: reused.
    _guard.check(_spec(compose_cfg, *base, "guard.loss_tolerance=0.5"), CPU)
    assert len(trained) == 2 * references + 2
