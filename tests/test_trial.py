"""run_trial end to end on CPU with tiny sizes: real models, real DataLoader workers, real failures."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
import time

import pytest
import torch
from omegaconf import open_dict

from gpuopt.core.errors import ConfigError
from gpuopt.core.result import Metrics, Status
from gpuopt.engines._ceiling import CeilingReplay
from gpuopt.engines.registry import run_trial
from gpuopt.trial.devices import trial_device
from gpuopt.trial.prepare import load_spec
from tests.conftest import TINY_TRIAL, assert_cpu_peak

FAMILIES = {
    "mlp": ["model=mlp", "model.width=16", "model.depth=1", "model.input_shape=[12]"],
    "cnn": ["model=cnn", "model.width=4", "model.depth=1", "model.input_shape=[3,8,8]"],
    "transformer": ["model=transformer", "model.width=16", "model.depth=1", "model.heads=2",
                    "model.input_shape=[8]", "model.num_classes=32"],
}  # fmt: skip


def _run(compose_cfg, *overrides, inspect=None, edit=None):
    cfg = compose_cfg(*TINY_TRIAL, *overrides)
    if edit is not None:
        with open_dict(cfg):
            edit(cfg)
    spec = load_spec(cfg)
    device, warnings = trial_device(spec)
    result = run_trial(spec, device=device, inspect=inspect)
    result.warnings[:0] = warnings
    return result


def _assert_measured(result, max_steps=6):
    m = result.metrics
    assert result.status is Status.OK, result.reason
    assert 2 <= m.timed_steps <= max_steps
    assert m.stop_reason in ("stable", "budget", "max_steps")
    assert m.throughput > 0 and m.ceiling_throughput > 0
    # Throughput is samples over the window's wall time, and the step times tile that window.
    assert m.throughput == pytest.approx(m.timed_steps * 8 / m.timed_seconds)
    assert m.step_time_p10_ms <= m.step_time_ms <= m.step_time_p90_ms
    assert 0 <= m.data_wait <= 100 and m.utilization == pytest.approx(100 - m.data_wait)
    assert m.host_data_wait == m.data_wait  # CPU: the host's wait is the device's
    assert m.peak_reserved_mb is None and m.utilization_source is m.power_source is None
    assert m.input_efficiency == pytest.approx(100 * m.throughput / m.ceiling_throughput)
    assert m.flops_per_sample > 0 and m.mfu is None  # no documented peak for a CPU
    assert_cpu_peak(result)
    assert m.startup_time_s > 0 and m.warmup_time_s > 0
    assert m.compile_time_s == 0.0
    assert m.compute_dtype == result.config["precision"]["mode"]  # the guard's evidence needs it
    assert m.power_w is None and m.energy_per_sample_j is None  # no NVML on CPU
    # /proc/stat's steal share; unknown (None) only for a window no clock tick (10 ms) fell in.
    if m.cpu_steal_pct is None:
        assert m.timed_seconds < 0.011  # /proc/stat counts in USER_HZ (100/s) ticks
    else:
        assert 0.0 <= m.cpu_steal_pct <= 100.0
    assert result.env["device"] == "cpu" and result.env["torch"] == torch.__version__


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_model_family_trains_and_is_measured(compose_cfg, family):
    built = {}
    result = _run(compose_cfg, *FAMILIES[family], inspect=built.__setitem__)
    _assert_measured(result)
    expected = {"mlp": "MLP", "cnn": "CNN", "transformer": "GPT"}[family]
    assert type(built["model"]).__name__ == expected
    assert result.config["model"]["_target_"].endswith(expected)


def test_mlp_flops_match_the_matmul_count(compose_cfg):
    # Linear layers 12->16, 16->16, 16->10: forward 2*sum(in*out) per sample; backward computes the
    # weight gradients (same count) and input gradients for every layer but the first.
    result = _run(compose_cfg, *FAMILIES["mlp"])
    layers = [(12, 16), (16, 16), (16, 10)]
    forward = 2 * sum(i * o for i, o in layers)
    backward = forward + 2 * sum(i * o for i, o in layers[1:])
    assert result.metrics.flops_per_sample == forward + backward


@pytest.mark.parametrize(
    ("mode", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_each_cpu_precision_runs_with_its_autocast_and_scaler(compose_cfg, mode, dtype):
    built = {}
    result = _run(compose_cfg, *FAMILIES["mlp"], f"precision={mode}", inspect=built.__setitem__)
    assert result.status is Status.OK, result.reason
    workload = built["workload"]
    with workload.precision.autocast():
        out = workload.model(torch.zeros(2, 12))
    assert out.dtype == dtype
    assert (workload.precision.scaler is not None) == (mode == "fp16")


def test_tf32_on_cpu_is_a_config_error_naming_precision_mode(compose_cfg):
    spec = load_spec(compose_cfg(*TINY_TRIAL, "precision=tf32"))
    with pytest.raises(ConfigError) as info:
        trial_device(spec)
    assert (info.value.key, info.value.value) == ("precision.mode", "tf32")
    assert "compute capability >= 8.0" in str(info.value)


def test_loader_knobs_reach_a_real_dataloader_with_worker_processes(compose_cfg, tmp_path):
    def use_pid_dataset(cfg):
        cfg.data = {"_target_": "tests.helpers.user_models.PidRecordingDataset", "pid_dir": str(tmp_path),
                    "features": 12, "classes": 10, "size": 64}  # fmt: skip

    built = {}
    result = _run(
        compose_cfg, *FAMILIES["mlp"], "trust=[tests.*]", "loader.num_workers=2", "loader.prefetch_factor=3",
        "loader.persistent_workers=true", "loader.pin_memory=true", "loader.drop_last=false",
        inspect=built.__setitem__, edit=use_pid_dataset,
    )  # fmt: skip
    assert result.status is Status.OK, result.reason
    loader = built["loader"]
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 3, True)
    assert (loader.batch_size, loader.drop_last) == (8, False)
    assert loader.pin_memory is False  # no accelerator: pinning is a no-op, and we say so
    assert any("pin_memory" in w for w in result.warnings)
    producers = [name.split("-") for name in os.listdir(tmp_path)]
    worker_pids = {int(pid) for pid, worker in producers if worker != "main"}
    assert worker_pids and os.getpid() not in worker_pids
    assert {worker for _, worker in producers} == {"0", "1"}


def test_prefetch_without_workers_is_ignored_with_a_warning(compose_cfg):
    built = {}
    result = _run(
        compose_cfg, *FAMILIES["mlp"], "loader.prefetch_factor=4", inspect=built.__setitem__
    )
    assert result.status is Status.OK and built["loader"].num_workers == 0
    assert any("prefetch_factor" in w and "ignored" in w for w in result.warnings)


def _user_model(target, **kwargs):
    def edit(cfg):
        cfg.model = {"_target_": f"tests.helpers.user_models.{target}", "input": "vectors",
                     "input_shape": [12], "num_classes": 3, "features": 12, "classes": 3, **kwargs}  # fmt: skip

    return edit


def test_user_model_by_target_is_trained_with_its_own_arguments(compose_cfg):
    built = {}
    result = _run(
        compose_cfg,
        "trust=[tests.*]",
        inspect=built.__setitem__,
        edit=_user_model("TinyNet", hidden=5),
    )
    _assert_measured(result)
    assert type(built["model"]).__name__ == "TinyNet" and built["model"].hidden == 5
    # The sweeper receives the result across processes (submitit pickles it).
    assert pickle.loads(pickle.dumps(result)) == result


def test_nan_loss_is_a_diverged_result(compose_cfg):
    result = _run(compose_cfg, "trust=[tests.*]", edit=_user_model("NaNNet"))
    assert result.status is Status.DIVERGED
    assert "NaN" in result.reason and "warm-up" in result.reason


def test_exploding_learning_rate_diverges(compose_cfg):
    result = _run(compose_cfg, *FAMILIES["mlp"], "optimizer=sgd", "optimizer.lr=1e30")
    assert result.status is Status.DIVERGED


def test_exception_in_user_model_is_an_error_result_with_type_and_message(compose_cfg):
    result = _run(compose_cfg, "trust=[tests.*]", edit=_user_model("BrokenNet"))
    assert result.status is Status.ERROR
    assert result.reason == "ValueError: user model bug: shapes do not line up"


def test_real_cpu_out_of_memory_is_an_oom_result_and_the_next_trial_runs(compose_cfg):
    # A 10^9-wide layer asks the CPU allocator for ~10^12 bytes: it refuses for real.
    result = _run(compose_cfg, *FAMILIES["mlp"], "model.width=1000000000")
    assert result.status is Status.OOM
    assert "can't allocate memory" in result.reason
    assert result.metrics.throughput is None  # nothing measured is reported as null, not zero
    _assert_measured(_run(compose_cfg, *FAMILIES["mlp"]))


def test_num_threads_applies_and_null_restores_the_default():
    from gpuopt.trial.policies import set_num_threads

    set_num_threads(None)
    default = torch.get_num_threads()
    set_num_threads(1)
    assert torch.get_num_threads() == 1
    set_num_threads(None)  # a later trial in the same process without a setting
    assert torch.get_num_threads() == default


def test_ceiling_replay_both_engines_drive_is_bounded_by_steps_and_by_time():
    """CeilingReplay (the one ceiling both engines use): warm-up untimed, at most max_steps timed,
    or fewer once the budget passed, never under its minimum of timed steps."""
    cpu = torch.device("cpu")
    calls = []
    replay = CeilingReplay(cpu, max_steps=7, budget_s=10.0, warmup_steps=1)
    replay.run(lambda: calls.append(1) or 8)
    assert (len(calls), replay.steps, replay.samples) == (8, 7, 56) and replay.seconds < 10.0
    slow = CeilingReplay(cpu, max_steps=1000, budget_s=0.05, warmup_steps=0)
    slow.run(lambda: time.sleep(0.02) or 8)
    assert 3 <= slow.steps < 1000 and slow.seconds >= 0.05
    m = Metrics(throughput=slow.samples / slow.seconds / 2)
    slow.record(m)
    assert m.ceiling_throughput == pytest.approx(slow.samples / slow.seconds)
    assert m.input_efficiency == pytest.approx(50.0)
    # A framework's batch-end hook drives the same object step by step.
    hooked = CeilingReplay(cpu, max_steps=2, budget_s=10.0, warmup_steps=1)
    hooked.begin()
    assert [hooked.step_done(4) for _ in range(3)] == [False, False, True]
    assert (hooked.steps, hooked.samples) == (2, 8)


def test_engine_without_its_extra_is_an_error_result_before_anything_is_built(
    compose_cfg, monkeypatch
):
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("validating engine=lightning needs the extra installed")
    spec = load_spec(compose_cfg(*TINY_TRIAL, "engine=lightning"))  # validated while installed
    monkeypatch.setitem(sys.modules, "lightning", None)  # then as if it never was
    built = {}
    result = run_trial(spec, inspect=built.__setitem__)
    assert result.status is Status.ERROR and built == {}
    assert result.reason == (
        'ModuleNotFoundError: engine=lightning needs lightning: pip install "gpuopt[lightning]"'
    )


# -- input wait on the GPU timeline (issue 17 item 3) ---------------------------------------------
class FakeStream:
    """A CUDA stream's timeline stand-in: queued work runs in order after the host queued it; an
    event is reached once the work queued before it is done (at once on an idle stream)."""

    def __init__(self) -> None:
        self.host = 0.0  # the host's clock
        self.busy_until = 0.0  # when the queued work ends

    def enqueue(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, self.host) + seconds

    def sync(self) -> None:  # e.g. GradScaler reading found_inf
        self.host = max(self.host, self.busy_until)

    def record(self) -> FakeEvent:
        return FakeEvent(max(self.busy_until, self.host))


class FakeEvent:
    def __init__(self, at: float) -> None:
        self.at = at

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3  # ms, like torch.cuda.Event


def _loop(stream, wait, steps, compute_s, fetch_s, copy_s=1e-4, sync=False):
    """The native loop's order: fetch (host), copy (queued), the step (queued; the host returns)."""
    for _ in range(steps):
        wait.fetch_started()
        stream.host += fetch_s
        wait.fetch_ended()
        wait.copy_started()
        stream.enqueue(copy_s)
        wait.copy_ended()
        stream.enqueue(compute_s)
        if sync:
            stream.sync()


def _gpu_wait(stream):
    from gpuopt.engines._window import InputWait

    return InputWait(
        torch.device("cuda"), record_event=stream.record, host_clock=lambda: stream.host
    )


def test_loader_time_overlapping_queued_compute_is_no_data_wait_on_a_gpu():
    # A GPU-bound 10 ms step with 2 ms of loader work: the loader runs while the GPU computes.
    stream = FakeStream()
    wait = _gpu_wait(stream)
    _loop(stream, wait, steps=10, compute_s=0.010, fetch_s=0.002)
    totals = wait.totals()
    assert totals.host_s == pytest.approx(0.020)  # the host did wait for the loader ...
    # ... but the GPU starved only before the first batch, and for the copies.
    assert totals.device_s == pytest.approx(0.002 + 10 * 1e-4)


def test_a_loader_slower_than_the_step_is_starvation_on_the_gpu_timeline():
    stream = FakeStream()
    wait = _gpu_wait(stream)
    _loop(stream, wait, steps=10, compute_s=0.002, fetch_s=0.010)
    # First step: 10 ms fetch + copy; then each step the GPU idles 10 - 2 ms (+ the copy).
    assert wait.totals().device_s == pytest.approx(0.0101 + 9 * 0.008)
    assert wait.totals().host_s == pytest.approx(0.100)


def test_a_per_step_sync_exposes_the_loader_and_data_wait_says_so():
    # fp16's GradScaler syncs each step: the queue is drained, so the GPU idles while the host
    # fetches. The same loader and step as the overlapped case above now cost the GPU for real.
    stream = FakeStream()
    wait = _gpu_wait(stream)
    _loop(stream, wait, steps=10, compute_s=0.010, fetch_s=0.002, sync=True)
    assert wait.totals().device_s == pytest.approx(10 * (0.002 + 1e-4))
    assert wait.totals().host_s == pytest.approx(0.020)


def test_a_prefetched_batch_opens_its_span_at_the_copy_and_reset_forgets_open_spans():
    stream = FakeStream()
    wait = _gpu_wait(stream)
    wait.fetch_started()  # a fetch whose copy never comes in this window
    wait.reset()
    stream.host = 1.0
    wait.copy_started()  # batch fetched earlier (Lightning's prefetch): only the copy counts
    stream.enqueue(0.003)
    wait.copy_ended()
    assert wait.totals().device_s == pytest.approx(0.003) and wait.totals().host_s == 0.0


def test_without_cuda_events_the_device_wait_is_the_host_fetch_time():
    from gpuopt.engines._window import InputWait

    clock = iter([0.0, 0.25, 1.0, 1.5])
    wait = InputWait(torch.device("cpu"), host_clock=lambda: next(clock))
    for _ in range(2):
        wait.fetch_started()
        wait.copy_started()  # no-ops without events
        wait.copy_ended()
        wait.fetch_ended()
    assert wait.totals().device_s == wait.totals().host_s == pytest.approx(0.75)


def test_record_window_reads_data_wait_from_the_device_and_host_wait_from_the_host():
    from gpuopt.engines._window import InputWaitSeconds, record_window
    from gpuopt.trial.measure import WindowResult
    from gpuopt.trial.memory import MemoryBaseline

    m = Metrics()
    window = WindowResult([0.1] * 10, 1.0, 10, "max_steps", time.time())
    cpu = torch.device("cpu")
    waited = InputWaitSeconds(device_s=0.05, host_s=0.3)
    record_window(m, window, 80, waited, cpu, None, MemoryBaseline.take(cpu), None, time.time())
    assert m.data_wait == pytest.approx(5.0) and m.host_data_wait == pytest.approx(30.0)


# -- memory peaks (item 4) --------------------------------------------------------------------------
def test_cuda_peaks_are_reset_when_the_window_starts_not_when_the_baseline_is_taken(monkeypatch):
    from gpuopt.trial.memory import MemoryBaseline

    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 8 * 2**20)
    cuda = torch.device("cuda", 0)
    memory = MemoryBaseline.take(cuda)
    assert calls == []
    memory.window_starting()
    assert calls == [("reset", cuda)]
    assert (memory.peak_mb(), memory.peak_reserved_mb()) == (3.0, 8.0)
    assert MemoryBaseline.take(torch.device("cpu")).peak_reserved_mb() is None


def test_a_cpu_peak_under_a_high_water_mark_set_before_the_trial_is_unknown_not_zero():
    """ru_maxrss cannot be reset: in a process whose earlier work set it (the race's shared
    process), a trial that stays below it has no peak (null, with the note); one that raises it
    reads its growth over the RSS it started from."""
    import numpy as np

    from gpuopt.trial.memory import SHARED_PEAK_NOTE, MemoryBaseline, rss_mb

    cpu = torch.device("cpu")
    earlier = np.ones(300 * 2**20 // 8)  # 300 MB, touched: earlier work sets the mark
    del earlier  # an mmap'd block: back to the OS, the RSS drops, the mark stays
    memory = MemoryBaseline.take(cpu)
    assert rss_mb() is not None and memory.rss_before_mb < memory.high_water_before_mb - 200
    small = np.ones(20 * 2**20 // 8)
    assert (memory.peak_mb(), memory.unmeasured()) == (None, SHARED_PEAK_NOTE)
    large = np.ones(600 * 2**20 // 8)  # raises the mark: this trial's own peak
    assert memory.peak_mb() == pytest.approx(620, rel=0.1) and memory.unmeasured() is None
    del small, large


def test_native_peaks_count_from_after_the_flop_step_compile_and_warm_up(compose_cfg, monkeypatch):
    from gpuopt.engines import native
    from gpuopt.engines._step import Workload
    from gpuopt.trial.memory import MemoryBaseline

    order, steps = [], []
    train_step = Workload.train_step
    monkeypatch.setattr(
        Workload, "train_step", lambda self, *b: steps.append(1) or train_step(self, *b)
    )
    count_flops = native.count_flops
    monkeypatch.setattr(native, "count_flops", lambda *a: order.append("flops") or count_flops(*a))
    monkeypatch.setattr(
        MemoryBaseline, "release_cache", lambda self: order.append(("release", len(steps)))
    )
    monkeypatch.setattr(
        MemoryBaseline, "window_starting", lambda self: order.append(("window", len(steps)))
    )
    result = _run(compose_cfg, *FAMILIES["mlp"], "measure.warmup_steps=2")
    _assert_measured(result)
    # The eager FLOP step first, the cache released before the warm-up steps, the peaks reset
    # after them (no compile: no compile step).
    assert order == ["flops", ("release", 0), ("window", 2)]


# -- in-process clean-up and OOM classification (item 8) ------------------------------------------
@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
         Status.OOM),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), Status.OOM),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), Status.OOM),
        (torch.OutOfMemoryError("CUDA out of memory."), Status.OOM),
        (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"),
         Status.ERROR),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), Status.ERROR),
        (ValueError("CUBLAS_STATUS_ALLOC_FAILED in a user's message"), Status.ERROR),
    ],
)  # fmt: skip
def test_library_allocation_failures_are_oom(exc, status):
    from gpuopt.trial.failures import classify_failure

    assert classify_failure(exc)[0] is status


@pytest.mark.parametrize(("mode", "resets"), [("off", 0), ("default", 1), ("reduce-overhead", 1)])
def test_release_resets_the_compiler_after_a_compiled_trial(compose_cfg, monkeypatch, mode, resets):
    import dataclasses

    from gpuopt.engines._lifecycle import release
    from gpuopt.trial.context import Trial

    spec = load_spec(compose_cfg(*TINY_TRIAL, *FAMILIES["mlp"]))
    spec = dataclasses.replace(spec, compile=dataclasses.replace(spec.compile, mode=mode))
    calls = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: calls.append(1))
    release(Trial(spec, torch.device("cpu")), Status.OOM)
    assert len(calls) == resets


# -- NVML notes and sources (monitor.NvmlStats) ---------------------------------------------------
def test_nvml_fallback_notes_become_trial_warnings_and_sources_are_recorded(monkeypatch):
    from gpuopt.engines._window import WindowMonitors, apply_device_monitor
    from gpuopt.trial import monitor

    stats = monitor.NvmlStats(
        samples=4, utilization=70.0, memory_used_mb=10.0, power_w=300.0, energy_j=30.0,
        energy_source="counter", utilization_source=monitor.UTILIZATION_POLLED,
        power_source=monitor.POWER_COUNTER, notes=("utilization: polled",),
    )  # fmt: skip

    class Sampler:
        nvml = handle = None  # no NVML module: GPM is not there (gpuopt.trial.gpm says why)

        def start(self):
            pass

        def stop(self):
            return stats

    monkeypatch.setattr(monitor, "open_sampler", lambda device, interval: (Sampler(), None))
    warnings = ["earlier"]
    monitors = WindowMonitors(torch.device("cuda"), 0.1, warnings)
    monitors.start()
    assert monitors.stop() is stats and monitors.stop() is None  # a second stop: no sampler
    gpm_note = "this nvidia-ml-py has no GPM API (nvidia-ml-py >= 12): sm_active, sm_occupancy, "
    assert warnings[0] == "earlier" and warnings[2:] == ["utilization: polled"]
    assert warnings[1].startswith(gpm_note)  # GPM's null reason, one line
    m = Metrics()
    apply_device_monitor(m, "cuda", stats, samples=10)
    assert (m.utilization_source, m.power_source) == ("polled", "energy counter")
    assert m.energy_per_sample_j == pytest.approx(3.0)


# -- MFU notes (item 7) ---------------------------------------------------------------------------
def test_attention_flops_are_counted_apart_and_fp32_mfu_on_sm80_says_tensor_cores():
    from gpuopt.engines._window import attention_tf32_note
    from gpuopt.trial.measure import StepFlops, measure_step_flops

    q = torch.randn(2, 2, 8, 16, device="meta", requires_grad=True)
    attention = torch.ops.aten._scaled_dot_product_efficient_attention

    def step():
        attention(q, q, q, None, True)[0].sum().backward()
        torch.nn.functional.linear(
            torch.randn(4, 16, device="meta"), torch.randn(8, 16, device="meta")
        )

    flops = measure_step_flops(step)
    assert flops.hardware == flops.attention + 2 * 4 * 16 * 8 and flops.attention > 0
    note = attention_tf32_note("fp32", (9, 0), flops)
    assert note and "tensor cores" in note and "regardless of allow_tf32" in note
    assert attention_tf32_note("tf32", (9, 0), flops) is None  # against the tensor-core peak
    assert attention_tf32_note("fp32", (7, 0), flops) is None  # Volta: no TF32 tensor cores
    assert attention_tf32_note("fp32", None, flops) is None  # not CUDA: no MFU
    assert attention_tf32_note("fp32", (9, 0), StepFlops(100.0, 0.0)) is None  # no attention


def test_activation_checkpointing_counts_the_recompute_as_hardware_flops_only(compose_cfg):
    plain = _run(compose_cfg, *FAMILIES["mlp"], "model.depth=2")
    checkpointed = _run(
        compose_cfg, *FAMILIES["mlp"], "model.depth=2", "model.activation_checkpointing=true"
    )
    _assert_measured(checkpointed)
    # The recomputed forward is in the hardware count (hfu), not in the model's (mfu).
    assert checkpointed.metrics.hardware_flops_per_sample > plain.metrics.hardware_flops_per_sample
    assert checkpointed.metrics.flops_per_sample == plain.metrics.flops_per_sample


# -- steady state, the measured peak, the machine's limit (issue 15) -------------------------------
def test_the_window_never_restarts_the_loader_even_on_a_dataset_shorter_than_it(
    compose_cfg, monkeypatch
):
    # 16 samples = 2 batches per epoch, the trial draws up to 1 + 1 + 6 batches: one epoch that
    # cycles over the data, and one more iterator after the window (the measured boundary).
    from torch.utils.data import DataLoader

    iterators: dict[int, int] = {}
    real_iter = DataLoader.__iter__

    def counting_iter(self):
        iterators[id(self)] = iterators.get(id(self), 0) + 1
        return real_iter(self)

    monkeypatch.setattr(DataLoader, "__iter__", counting_iter)
    built = {}
    result = _run(compose_cfg, *FAMILIES["mlp"], "data.size=16", inspect=built.__setitem__)
    _assert_measured(result)
    assert iterators[id(built["loader"])] == 2
    assert result.metrics.epoch_steps == 2  # the real epoch: 16 samples / batch 8


@pytest.mark.parametrize("workers", [0, 1])
def test_epoch_overhead_is_measured_apart_and_amortized_over_the_real_epoch(compose_cfg, workers):
    result = _run(compose_cfg, *FAMILIES["mlp"], f"loader.num_workers={workers}")
    m = result.metrics
    _assert_measured(result)
    assert m.epoch_steps == 64 // 8 and m.epoch_overhead_s >= 0
    if workers:
        assert m.epoch_overhead_s > 0  # a fresh epoch starts a worker process
    step_s = m.timed_seconds / m.timed_steps
    epoch_s = m.epoch_steps * step_s
    assert m.throughput_amortized == pytest.approx(
        m.throughput * epoch_s / (epoch_s + m.epoch_overhead_s)
    )
    assert m.throughput_amortized <= m.throughput


def test_data_epoch_steps_sets_the_epoch_amortized_over_and_is_not_a_dataset_argument(
    compose_cfg,
):
    result = _run(compose_cfg, *FAMILIES["mlp"], "data.epoch_steps=1000")
    assert result.status is Status.OK, result.reason
    assert result.metrics.epoch_steps == 1000
    with pytest.raises(ConfigError, match=r"data\.epoch_steps"):
        load_spec(compose_cfg(*TINY_TRIAL, "data.epoch_steps=0"))


def test_cpu_trial_reports_mfu_against_the_probe_and_its_limit(compose_cfg, monkeypatch, tmp_path):
    from gpuopt.core.host import usable_cpus

    monkeypatch.setenv("GPUOPT_CACHE_DIR", str(tmp_path))
    result = _run(compose_cfg, *FAMILIES["mlp"])
    m = result.metrics
    _assert_measured(result)
    # No documented CPU peak (mfu null), but the measured one gives a utilization of the math.
    assert m.mfu is None and m.hfu is None and m.peak_flops_measured > 0
    assert m.mfu_achievable == pytest.approx(
        100 * m.flops_per_sample * m.throughput / m.peak_flops_measured
    )
    assert (tmp_path / "peak_flops.json").exists()
    assert m.hardware_flops_per_sample == m.flops_per_sample  # no checkpointing
    # The limit: the usable cores shared by the loader's and the compute's cost per sample.
    assert m.loader_cost_us > 0 and m.compute_cost_us > 0 and m.limit_bound == "cores"
    per_sample_s = (m.loader_cost_us + m.compute_cost_us) / 1e6
    assert m.limit_throughput == pytest.approx(usable_cpus() / per_sample_s)
    assert m.limit_efficiency == pytest.approx(100 * m.throughput / m.limit_throughput)


def test_checkpointed_model_reports_model_and_hardware_flops_apart(compose_cfg):
    result = _run(compose_cfg, *FAMILIES["mlp"], "model.activation_checkpointing=true")
    m = result.metrics
    assert result.status is Status.OK, result.reason
    # One 16x16 block recomputed per sample in the backward: 2*16*16 FLOPs more on the hardware.
    assert m.hardware_flops_per_sample - m.flops_per_sample == 2 * 16 * 16


def test_measurements_beside_the_window_can_be_turned_off(compose_cfg):
    result = _run(
        compose_cfg, *FAMILIES["mlp"], "measure.peak_probe=false", "measure.loader_cost=false"
    )
    m = result.metrics
    assert m.mfu_achievable is None and m.peak_flops_measured is None
    assert m.loader_cost_us is None and m.limit_throughput is None
    assert m.throughput_amortized is not None  # the epoch boundary is always priced


@pytest.mark.parametrize(("stolen", "flagged"), [(20, True), (5, False)])
def test_a_window_the_hypervisor_stole_from_is_measured_and_flagged(
    compose_cfg, monkeypatch, stolen, flagged
):
    """cpu_steal_pct from /proc/stat's steal ticks over the window (here an injected counter:
    `stolen` of every 100 ticks), and a warning only past 5%. (A real window reads the real
    counter: _assert_measured.)"""
    from gpuopt.engines import _meter

    ticks = iter(range(10**6))

    def scripted() -> dict[str, int]:
        n = next(ticks)
        return {"user": (100 - stolen) * n, "idle": 0, "steal": stolen * n}

    monkeypatch.setattr(_meter, "cpu_ticks", scripted)
    result = _run(compose_cfg)
    assert result.status is Status.OK
    assert result.metrics.cpu_steal_pct == pytest.approx(stolen)
    warned = [f"hypervisor gave {stolen}%" in w for w in result.warnings if "hypervisor" in w]
    assert warned == ([True] if flagged else [])
