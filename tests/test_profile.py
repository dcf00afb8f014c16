"""The profiled window (gpuopt.trial.profiled_window): a real CPU trial profiled end to end (phases cover the
measured wall time, the trace loads, the annotations are gone afterwards), and the trace readers on
hand-made events where the arithmetic, not the machine, is under test (the GPU idle split)."""

from __future__ import annotations

import gzip
import json

import pytest

from gpuopt.core.errors import ConfigError
from gpuopt.core.result import ATTR_PROFILE, Status, TrialResult, result_user_attrs
from gpuopt.core.spec import ProfileConf
from gpuopt.engines.registry import run_trial
from gpuopt.sweeper.profile_runs import PROFILE_ON
from gpuopt.trial.devices import trial_device
from gpuopt.trial.prepare import load_spec
from gpuopt.trial.profiled_window import (
    STEP_COVERAGE_TOLERANCE,
    TRACE_FILE,
    Annotation,
    ProfileSummary,
    annotated,
    steps_within_budget,
)
from gpuopt.trial.trace import PHASES, STEP_SPAN, gpu_time_split, load_trace, phase_breakdown
from tests.conftest import TINY_TRIAL, compose_config

MLP = ["model=mlp", "model.width=16", "model.depth=1", "model.input_shape=[12]"]


def _profiled(compose_cfg, tmp_path, monkeypatch, *overrides):
    monkeypatch.setattr("gpuopt.trial.profiled_window.trial_run_dir", lambda: tmp_path)
    built = {}
    spec = load_spec(compose_cfg(*TINY_TRIAL, *MLP, "measure.ceiling=false", *overrides))
    device, _ = trial_device(spec)
    result = run_trial(spec, device=device, inspect=built.__setitem__)
    assert result.status is Status.OK, result.reason
    return result, built


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One profiled trial, read (not changed) by each test that takes it: (result, what the trial
    built, its run dir)."""
    run_dir = tmp_path_factory.mktemp("profiled")
    with pytest.MonkeyPatch.context() as monkeypatch:
        # data.sample_cost: a loader that costs host time, so data_wait is a phase with time in it.
        result, built = _profiled(
            compose_config,
            run_dir,
            monkeypatch,
            PROFILE_ON,
            "profile.steps=4",
            "data.sample_cost=2",
        )
    return result, built, run_dir


def test_profile_override_turns_the_window_on_and_off_is_the_default(compose_cfg):
    assert load_spec(compose_cfg(*MLP)).profile.enabled is False
    spec = load_spec(compose_cfg(*MLP, PROFILE_ON, "profile.steps=3"))
    assert spec.profile.enabled is True and spec.profile.steps == 3
    with pytest.raises(ConfigError, match=r"profile\.steps=0"):
        load_spec(compose_cfg(*MLP, "profile.steps=0"))
    with pytest.raises(ConfigError, match=r"profile\.max_s=0.*seconds > 0, or null"):
        load_spec(compose_cfg(*MLP, "profile.max_s=0"))
    assert load_spec(compose_cfg(*MLP, "profile.max_s=null")).profile.max_s is None


def test_slow_steps_are_profiled_fewer_within_the_budget():
    conf = ProfileConf(enabled=True, steps=5, max_s=2.0)
    assert steps_within_budget(conf, 900.0).steps == 2  # 2 of 0.9 s fit in 2 s
    assert steps_within_budget(conf, 5000.0).steps == 1  # at least one
    assert steps_within_budget(conf, 100.0) is conf  # 5 fast steps fit: as configured
    assert steps_within_budget(conf, None) is conf  # no timed step to go by
    unbounded = ProfileConf(enabled=True, steps=5, max_s=None)
    assert steps_within_budget(unbounded, 5000.0).steps == 5


def test_a_trial_of_slow_steps_records_fewer_profiled_steps(compose_cfg, tmp_path, monkeypatch):
    # a budget below one step: one recorded step (after the profiler's own warm-up step)
    result, _ = _profiled(
        compose_cfg,
        tmp_path,
        monkeypatch,
        PROFILE_ON,
        "profile.steps=4",
        "profile.max_s=1e-6",
    )
    assert ProfileSummary.from_dict(result.profile).steps == 1


def test_phases_sum_to_the_step_and_the_steps_cover_the_measured_window(profiled):
    result, _, _ = profiled
    summary = ProfileSummary.from_dict(result.profile)
    assert summary.steps == 4 and list(summary.phases_s) == list(PHASES)
    assert sum(summary.phases_s.values()) == pytest.approx(summary.step_s, rel=1e-9)
    assert sum(summary.phases_pct.values()) == pytest.approx(100.0, abs=1e-6)
    # The step spans (profiler clock) against perf_counter around the same steps, outside the
    # profiler: what is not covered is prof.step()'s own bookkeeping between the spans.
    covered = summary.steps * summary.step_s
    assert covered <= summary.window_s * 1.01
    assert covered >= summary.window_s * (1 - STEP_COVERAGE_TOLERANCE)
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        assert summary.phases_s[phase] > 0, phase
    assert all(value >= 0 for value in summary.phases_s.values())
    assert summary.gpu is None and summary.device_type == "cpu"
    assert summary.cost_s >= summary.window_s > 0


def test_lightning_engine_profiles_the_same_phases(compose_cfg, tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    result, _ = _profiled(
        compose_cfg, tmp_path, monkeypatch, "engine=lightning", PROFILE_ON,
        "profile.steps=4", "data.sample_cost=2",
    )  # fmt: skip
    summary = ProfileSummary.from_dict(result.profile)
    assert summary.steps == 4
    assert sum(summary.phases_s.values()) == pytest.approx(summary.step_s, rel=1e-9)
    covered = summary.steps * summary.step_s
    assert summary.window_s * (1 - STEP_COVERAGE_TOLERANCE) <= covered <= summary.window_s * 1.01
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        assert summary.phases_s[phase] > 0, phase
    # Lightning runs training_step and backward inside optimizer.step(closure): the optimizer's
    # phase is its span less the forward and backward spans nested in it.
    events = load_trace(tmp_path / TRACE_FILE)
    spans = [e for e in events if str(e.get("name", "")).startswith("gpuopt:")]
    optimizer = [e for e in spans if e["name"] == "gpuopt:optimizer"]
    nested = [
        e for e in spans
        if e["name"] in ("gpuopt:forward", "gpuopt:backward")
        and any(o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] for o in optimizer)
    ]  # fmt: skip
    assert len(nested) == 2 * summary.steps
    own = (sum(e["dur"] for e in optimizer) - sum(e["dur"] for e in nested)) / summary.steps / 1e6
    assert summary.phases_s["optimizer"] == pytest.approx(own, rel=1e-6)
    assert (tmp_path / TRACE_FILE).exists()


def test_top_operators_are_real_ops_by_self_time(profiled):
    summary = ProfileSummary.from_dict(profiled[0].profile)
    names = [op.name for op in summary.top_ops]
    assert names and len(names) <= 10
    assert not any(n.startswith(("gpuopt:", "ProfilerStep", "Optimizer.")) for n in names)
    assert any(n.startswith("aten::") for n in names)
    times = [op.self_s for op in summary.top_ops]
    assert times == sorted(times, reverse=True)


def test_trace_is_written_in_the_run_dir_and_loads_as_json(profiled):
    result, _, run_dir = profiled
    path = run_dir / TRACE_FILE
    assert result.profile["trace_path"] == str(path)
    with gzip.open(path, "rt") as f:
        trace = json.load(f)  # Chrome trace format: what Perfetto and TensorBoard read
    steps = [e for e in trace["traceEvents"] if e.get("name") == STEP_SPAN]
    assert len(steps) == 4  # the profiler's warm-up step is not in the trace
    assert load_trace(path) == trace["traceEvents"]


def test_profile_reaches_the_user_attributes_and_survives_result_json(profiled, tmp_path):
    result = profiled[0]
    attrs = result_user_attrs(result)
    assert attrs[ATTR_PROFILE]["phases_pct"] == pytest.approx(result.profile["phases_pct"])
    result.save(tmp_path / "result.json")
    assert TrialResult.load(tmp_path / "result.json").profile == result.profile


def test_annotations_exist_only_inside_the_window(profiled):
    _, built, _ = profiled
    workload = built["workload"]
    # Shadowing wrappers are gone: the timed window's step calls the class's own methods.
    assert "to_device" not in vars(workload) and "forward_backward" not in vars(workload)
    assert "step" not in vars(workload.optimizer)
    assert workload.forward is workload.model  # compile=off: the eager module, as built


def test_unprofiled_trial_has_no_profile_and_no_trace(compose_cfg, tmp_path, monkeypatch):
    result, _ = _profiled(compose_cfg, tmp_path, monkeypatch)
    assert result.profile is None and ATTR_PROFILE not in result_user_attrs(result)
    assert not (tmp_path / TRACE_FILE).exists()


def test_annotated_restores_originals_after_a_failure():
    class Owner:
        def method(self):
            return "class"

    owner = Owner()
    owner.field = lambda: "own"
    with pytest.raises(RuntimeError), annotated([Annotation(owner, "method", "forward"),
                                                 Annotation(owner, "field", "optimizer")]):  # fmt: skip
        assert owner.method() == "class" and "method" in vars(owner)
        raise RuntimeError
    assert "method" not in vars(owner) and owner.method() == "class"
    assert owner.field() == "own"


def _span(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"gpuopt:{name}", "ts": ts, "dur": dur}


def test_phase_breakdown_subtracts_nested_spans():
    events = [
        _span("step", 0, 100),
        _span("next_batch", 0, 30),
        _span("h2d_copy", 20, 10),
        _span("forward_backward", 30, 50),
        _span("forward", 30, 20),
        _span("optimizer", 80, 15),
    ]
    steps, step_s, phases = phase_breakdown(events + [dict(e, ts=e["ts"] + 100) for e in events])
    assert steps == 2 and step_s == pytest.approx(100e-6)
    expected = {"data_wait": 20, "h2d_copy": 10, "forward": 20, "backward": 30,
                "optimizer": 15, "other": 5}  # fmt: skip
    assert phases == pytest.approx({k: v * 1e-6 for k, v in expected.items()})
    with pytest.raises(ValueError, match="no gpuopt:step"):
        phase_breakdown([_span("forward", 0, 1)])


def _gpu(cat, ts, dur, correlation):
    return {"ph": "X", "cat": cat, "name": cat, "ts": ts, "dur": dur, "args": {"correlation": correlation}}  # fmt: skip


def _launch(ts, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "args": {"correlation": correlation}}  # fmt: skip


def test_gpu_idle_split_into_host_wait_and_kernel_wait():
    events = [
        _span("step", 0, 100),
        _span("forward", 0, 30),
        _span("optimizer", 35, 60),
        # A: launched at 5, runs 10-30. Gap 0-10: host wait 0-5, kernel wait 5-10.
        _launch(5, 1), _gpu("kernel", 10, 20, 1),
        # B: launched at 40, after A ended: gap 30-45 is host wait 30-40, kernel wait 40-45.
        _launch(40, 2), _gpu("kernel", 45, 15, 2),
        # C: launched long before, back to back with B: no gap.
        _launch(20, 3), _gpu("kernel", 60, 20, 3),
        # A copy launched at 50 (queued): gap 80-85 is kernel wait; 90-100 the GPU idles at the
        # end while the host still works: host wait.
        _launch(50, 4), _gpu("gpu_memcpy", 85, 5, 4),
    ]  # fmt: skip
    split = gpu_time_split(events)
    assert split.kernel == pytest.approx(55) and split.memcpy == pytest.approx(5)
    assert split.idle == pytest.approx(40)
    assert split.host_wait == pytest.approx(25) and split.kernel_wait == pytest.approx(15)
    assert split.unattributed_idle == 0
    assert split.host_wait + split.kernel_wait + split.unattributed_idle == pytest.approx(
        split.idle
    )
    # Busy time by the phase whose span launched it: A and C in forward (40 of 60), B and the copy
    # in optimizer (20 of 60).
    assert split.busy_by_phase == pytest.approx({"forward": 200 / 3, "optimizer": 100 / 3})


def test_cpu_trace_has_no_gpu_split():
    assert gpu_time_split([_span("step", 0, 10)]) is None


# -- diagnosis from the breakdown -----------------------------------------------------------------
def _profile(phases, gpu=None):
    base = dict.fromkeys(PHASES, 0.0)
    return {"phases_pct": {**base, **phases}, "gpu": gpu}


def test_input_bound_verdict_cites_the_share_of_the_step_in_next_loader():
    from gpuopt.report.diagnose import Bottleneck, diagnose

    metrics = {"data_wait": 50.0, "input_efficiency": 60.0,
               "profile": _profile({"data_wait": 53.2, "forward": 20, "backward": 20, "other": 6.8})}  # fmt: skip
    d = diagnose(metrics, device_type="cpu")
    assert d.bottleneck is Bottleneck.INPUT
    assert "53% of the step in next(loader)" in d.summary
    assert any(line.startswith("profiled step: next(loader) 53%") for line in d.evidence)
    # Without a profile the same verdict cites no phase.
    assert "of the step" not in diagnose({"data_wait": 50.0}, device_type="cpu").summary


def test_heavy_optimizer_phase_suggests_the_fused_optimizer_first_unless_already_fused():
    from gpuopt.report.diagnose import diagnose
    from gpuopt.report.evidence import OPTIMIZER_HIGH_PCT

    metrics = {"data_wait": 1.0, "input_efficiency": 99.0,
               "profile": _profile({"forward": 40, "backward": 42, "optimizer": 18})}  # fmt: skip
    d = diagnose(metrics, device_type="cpu", config={"optimizer": {"fused": None}})
    assert d.suggestions[0] == "optimizer 18% of the step: try optimizer.fused=true"
    assert "backward 42% of the step" in d.summary  # the largest phase
    fused = diagnose(metrics, device_type="cpu", config={"optimizer": {"fused": True}})
    assert not any("optimizer.fused" in tip for tip in fused.suggestions)
    light = {**metrics, "profile": _profile({"optimizer": OPTIMIZER_HIGH_PCT - 1})}
    assert not any("optimizer.fused" in t for t in diagnose(light, device_type="cpu").suggestions)


def test_profiled_gpu_idle_mostly_host_wait_is_launch_bound():
    from gpuopt.report.diagnose import Bottleneck, diagnose
    from gpuopt.report.evidence import HOST_WAIT_HIGH_PCT

    gpu = {"kernel": 55.0, "memcpy": 5.0, "idle": 40.0, "host_wait": 35.0, "kernel_wait": 5.0}
    # NVML's utilization is not recorded here: the profile alone gives the verdict.
    metrics = {"data_wait": 1.0, "input_efficiency": 99.0, "mfu": 30.0,
               "profile": _profile({"forward": 30, "backward": 50, "optimizer": 10}, gpu)}  # fmt: skip
    d = diagnose(metrics, device_type="cuda", config={"compile": {"mode": "off"}})
    assert d.bottleneck is Bottleneck.HOST
    assert "GPU idle 40%, of which 35 points host wait" in d.summary
    assert d.suggestions[0] == (
        "GPU idle 40%, of which 35 points host wait: launch-bound, try compile=reduce-overhead"
    )
    # The rule's own compile tip is not repeated after the phase tip.
    assert sum("compile=reduce-overhead" in tip for tip in d.suggestions) == 1
    assert any("35 points host wait, 5 kernel wait" in line for line in d.evidence)
    busy = {**gpu, "idle": 10.0, "host_wait": HOST_WAIT_HIGH_PCT - 5, "kernel_wait": 5.0}
    metrics["profile"] = _profile({"forward": 30, "backward": 60, "optimizer": 10}, busy)
    assert diagnose(metrics, device_type="cuda").bottleneck is Bottleneck.COMPUTE


def test_failed_trial_verdict_cites_no_profile():
    from gpuopt.report.diagnose import Bottleneck, diagnose

    d = diagnose({"profile": _profile({"forward": 90})}, status="oom", device_type="cpu")
    assert d.bottleneck is Bottleneck.NOT_MEASURED and d.evidence == [] and d.suggestions == []
