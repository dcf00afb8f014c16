"""The public measuring API on a user's own loop: `gpuopt.measure_step` (the user-step engine)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import gpuopt
from gpuopt.core.errors import ConfigError
from gpuopt.core.result import Status, TrialResult
from tests.conftest import assert_cpu_peak

QUICK = {"warmup_steps": 1, "min_steps": 3, "max_steps": 6, "time_budget_s": 0.5, "min_time_s": 0.0}


def _user_loop(batch_size: int = 8, batches: int = 3, nan_after: int | None = None):
    """A user's model, optimizer, batches and step, as they would write them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [
        (torch.randn(batch_size, 12), torch.randint(0, 3, (batch_size,))) for _ in range(batches)
    ]
    calls = []

    def step(batch):
        inputs, targets = batch
        loss = nn.functional.cross_entropy(model(inputs), targets)
        if nan_after is not None and len(calls) >= nan_after:
            loss = loss * float("nan")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        calls.append(inputs.shape[0])
        return loss

    return model, data, step, calls


def test_import_gpuopt_stays_light_and_exports_the_api():
    code = "import sys, gpuopt; assert 'torch' not in sys.modules; print(sorted(gpuopt.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "measure_step" in out.stdout and "MeasureCallback" in out.stdout
    assert gpuopt.TrialResult is TrialResult
    with pytest.raises(AttributeError):
        _ = gpuopt.no_such_thing


def test_a_user_loop_gets_a_built_in_trials_metrics():
    model, data, step, calls = _user_loop()
    result = gpuopt.measure_step(step, data, model=model, device="cpu", measure=QUICK)
    m = result.metrics
    assert result.status is Status.OK, result.reason
    assert 3 <= m.timed_steps <= 6 and m.stop_reason in ("stable", "budget", "max_steps")
    assert m.throughput == pytest.approx(m.timed_steps * 8 / m.timed_seconds)
    assert m.step_time_p10_ms <= m.step_time_ms <= m.step_time_p90_ms
    assert 0 <= m.data_wait <= 100 and m.utilization == pytest.approx(100 - m.data_wait)
    # flop_counter on one step, per sample: forward 2*(12*16 + 16*3); backward: both weight
    # gradients, and the input gradient of the second layer only (the inputs need none).
    assert m.flops_per_sample == pytest.approx(2 * (12 * 16 + 16 * 3) + 2 * 12 * 16 + 4 * 16 * 3)
    assert m.mfu is None  # no documented peak for a CPU
    assert m.ceiling_throughput > 0 and m.input_efficiency > 0
    assert_cpu_peak(result)
    assert m.warmup_time_s > 0
    # flops step + warm-up + window + ceiling (warm-up 1 + up to 5 timed) all ran the user's step
    assert len(calls) >= 1 + 1 + m.timed_steps + 2
    assert result.config["engine"]["name"] == "user_step" and result.config["model"] == "Sequential"
    assert result.env["device"] == "cpu"
    assert TrialResult.from_dict(result.to_dict()).metrics == m  # saves like any trial


def test_a_dataloader_over_a_user_dataset_with_a_sample_count_function():
    _, _, step, _ = _user_loop()
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 12), torch.randint(0, 3, (40,)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=10)
    result = gpuopt.measure_step(
        step, loader, measure=QUICK, samples_per_batch=lambda b: 2 * len(b[1]), ceiling=False
    )
    m = result.metrics
    assert result.status is Status.OK, result.reason
    assert m.throughput == pytest.approx(m.timed_steps * 20 / m.timed_seconds)
    assert m.flops_per_sample is None and m.ceiling_throughput is None  # no model, no ceiling


def test_a_nan_loss_is_status_diverged():
    _, data, step, _ = _user_loop(nan_after=2)
    result = gpuopt.measure_step(step, data, device="cpu", measure=QUICK)
    assert result.status is Status.DIVERGED and "NaN" in result.reason


def test_running_out_of_memory_is_status_oom():
    _, data, step, calls = _user_loop()

    def greedy_step(batch):
        if len(calls) >= 2:  # the CPU allocator's real failure: 2**50 floats cannot be allocated
            torch.empty(2**50)
        return step(batch)

    result = gpuopt.measure_step(greedy_step, data, device="cpu", measure=QUICK)
    assert result.status is Status.OOM, result.reason
    assert "allocate" in result.reason


def test_a_crashing_step_and_a_one_shot_iterator_are_errors_not_exceptions():
    def broken(batch):
        raise ValueError("bug in the user's step")

    result = gpuopt.measure_step(broken, [torch.ones(2, 2)], measure=QUICK)
    assert result.status is Status.ERROR and "bug in the user's step" in result.reason
    _, data, step, _ = _user_loop()
    result = gpuopt.measure_step(step, iter(data), measure=QUICK)
    assert result.status is Status.ERROR and "ran out" in result.reason


def test_the_global_batch_is_counted_from_the_optimizers_steps_or_given():
    """Issue 22: a sweep's "same training" needs what one optimizer step trains on."""
    torch.manual_seed(0)
    model = nn.Linear(12, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    data = [(torch.randn(8, 12), torch.randint(0, 3, (8,))) for _ in range(4)]
    seen = []

    def accumulating_step(batch):  # the optimizer steps every second batch of 8
        seen.append(batch)
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1]) / 2
        loss.backward()
        if len(seen) % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()  # the lr moves; the schedule's starting lr is the one reported
        return loss

    result = gpuopt.measure_step(
        accumulating_step, data, optimizer=optimizer, measure=QUICK, ceiling=False
    )
    m = result.metrics
    assert result.status is Status.OK, result.reason
    assert (m.global_batch, m.micro_batch, m.accumulation_steps) == (16, 8, 2)
    assert m.lr == pytest.approx(0.1) and optimizer.param_groups[0]["lr"] < 0.1

    _, data, step, _ = _user_loop()
    given = gpuopt.measure_step(step, data, global_batch=32, measure=QUICK, ceiling=False)
    assert (given.metrics.global_batch, given.metrics.micro_batch) == (32, 8)
    assert given.metrics.accumulation_steps == 4 and given.metrics.lr is None
    unknown = gpuopt.measure_step(step, data, measure=QUICK, ceiling=False).metrics
    assert (unknown.global_batch, unknown.lr) == (None, None) and unknown.micro_batch == 8
    with pytest.raises(ValueError, match="global_batch=0"):
        gpuopt.measure_step(step, data, global_batch=0)


def test_measure_settings_get_the_measure_groups_checks():
    _, data, step, _ = _user_loop()
    with pytest.raises(ConfigError, match=r"measure\.min_steps"):
        gpuopt.measure_step(step, data, measure={"min_steps": 1})
    with pytest.raises(ConfigError, match="quick"):
        gpuopt.measure_step(step, data, measure="nope")


# ---- Lightning users: gpuopt.MeasureCallback in their own Trainer --------------------------------
def _user_trainer(meter):
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=50,
        callbacks=[meter],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_the_callback_measures_a_user_trainer_fit():
    pytest.importorskip("lightning")
    from tests.helpers.lightning_models import TinyClassifier

    meter = gpuopt.MeasureCallback(measure=QUICK)
    model = TinyClassifier()
    result = meter.fit(_user_trainer(meter), model)
    m = result.metrics
    assert result.status is Status.OK, result.reason
    assert result is meter.result and result.config["engine"]["name"] == "lightning_callback"
    assert 3 <= m.timed_steps <= 6 and m.stop_reason in ("stable", "budget", "max_steps")
    # the stop rule ended the user's fit long before its 50 epochs (32 batches each)
    assert model.training_steps_run == 1 + m.timed_steps
    assert m.throughput == pytest.approx(m.timed_steps * 8 / m.timed_seconds)
    assert m.flops_per_sample > 0 and 0 <= m.data_wait <= 100
    assert m.ceiling_throughput is None  # needs a second fit: measure_step / engine=lightning
    assert (m.global_batch, m.micro_batch, m.accumulation_steps) == (8, 8, 1)
    assert m.lr == pytest.approx(1e-2)  # TinyClassifier's SGD


def test_the_callback_reads_the_global_batch_and_lr_from_the_trainer():
    """batch x accumulate_grad_batches x world size: a timed step is an optimizer step."""
    pytest.importorskip("lightning")
    import lightning as L

    from tests.helpers.lightning_models import TinyClassifier

    meter = gpuopt.MeasureCallback(measure=QUICK)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=50, callbacks=[meter], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=3,
    )  # fmt: skip
    result = meter.fit(trainer, TinyClassifier(lr=0.05))
    m = result.metrics
    assert result.status is Status.OK, result.reason
    assert (m.global_batch, m.micro_batch, m.accumulation_steps) == (24, 8, 3)
    assert m.lr == pytest.approx(0.05)
    assert m.throughput == pytest.approx(m.timed_steps * 24 / m.timed_seconds)


def test_the_callback_after_a_plain_trainer_fit_and_its_failures_as_statuses():
    pytest.importorskip("lightning")
    from tests.helpers.lightning_models import NaNAfter, OOMAfter, TinyClassifier

    meter = gpuopt.MeasureCallback(measure=QUICK)
    _user_trainer(meter).fit(TinyClassifier())  # the user's own call
    assert meter.result is not None and meter.result.ok
    meter = gpuopt.MeasureCallback(measure=QUICK)
    assert meter.fit(_user_trainer(meter), NaNAfter(after=1)).status is Status.DIVERGED
    meter = gpuopt.MeasureCallback(measure=QUICK)
    result = meter.fit(_user_trainer(meter), OOMAfter(after=2))
    assert result.status is Status.OOM and "out of memory" in result.reason
