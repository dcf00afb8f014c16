"""The memory-aware batch axis (gpuopt/sweeper/memory_axis.py): fit, prediction, choices, and the
sweep's space on CPU with a configured memory cap."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from optuna.distributions import CategoricalDistribution

from gpuopt.sweeper import memory_axis
from gpuopt.sweeper.memory_axis import (
    MemoryModel,
    MemoryProbe,
    batch_choices,
    fit,
    largest_batch,
    memory_budget,
    plan_batch_axis,
    powers_of_two,
    preset_batches,
)
from gpuopt.sweeper.options import SweeperOptions
from gpuopt.sweeper.shared_process import write_config
from gpuopt.sweeper.space import build_search_space

PRESET = {"loader.batch_size": "choice(32,64,128,256,512)", "loader.num_workers": "choice(0,1)"}


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([(8, 108.0), (32, 132.0)], MemoryModel(100.0, 1.0)),  # exact line
        ([(32, 132.0), (8, 108.0)], MemoryModel(100.0, 1.0)),  # order does not matter
        ([(8, 108.0), (16, 116.0), (32, 132.0)], MemoryModel(100.0, 1.0)),  # least squares
        ([(8, 4.0), (32, 28.0)], MemoryModel(0.0, 1.0)),  # a negative intercept clamps to 0
        ([(8, 100.0)], None),  # one size: no slope
        ([(8, 100.0), (8, 120.0)], None),  # one distinct size
        ([(8, 120.0), (32, 120.0)], None),  # flat: nothing scales with the batch
        ([(8, 130.0), (32, 120.0)], None),  # shrinking: noise, not a model
    ],
)
def test_fit_fixed_plus_per_sample_memory(points, expected) -> None:
    model = fit(points)
    if expected is None:
        assert model is None
    else:
        assert model is not None
        assert model.fixed_mb == pytest.approx(expected.fixed_mb)
        assert model.per_sample_mb == pytest.approx(expected.per_sample_mb)


@pytest.mark.parametrize(
    ("model", "budget", "margin", "expected"),
    [
        (MemoryModel(100, 1.0), 1100, 0.0, 1000),
        (MemoryModel(100, 1.0), 1100, 0.1, 890),  # 990 usable - 100 fixed
        (MemoryModel(100, 0.5), 1100, 0.1, 1780),
        (MemoryModel(2000, 1.0), 1100, 0.1, 0),  # the fixed part alone does not fit
        (MemoryModel(100, 3.0), 1100, 0.0, 333),  # rounded down
    ],
)
def test_largest_batch_that_fits_with_a_margin(model, budget, margin, expected) -> None:
    assert largest_batch(model, budget, margin) == expected
    if expected:
        assert model.peak_mb(expected) <= budget * (1 - margin)
        assert model.peak_mb(expected + 1) > budget * (1 - margin)


@pytest.mark.parametrize(
    ("device", "cap", "device_mb", "ram_mb", "expected"),
    [
        ("cpu", 512, None, 16000, (512, "hydra.sweeper.memory_cap_mb")),
        ("cuda", 512, 80000, 16000, (512, "hydra.sweeper.memory_cap_mb")),  # the cap wins
        ("cuda", None, 80000, 16000, (80000, "device memory")),
        ("cpu", None, None, 16000, (16000, "available RAM")),
        ("cuda", None, None, 16000, None),  # no device number: never the host's RAM
        ("cpu", None, None, None, None),
    ],
)
def test_memory_budget_sources(device, cap, device_mb, ram_mb, expected) -> None:
    budget = memory_budget(device, cap, device_mb, ram_mb)
    assert (None if budget is None else (budget.mb, budget.source)) == expected


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(32, 512, [32, 64, 128, 256, 512]), (32, 300, [32, 64, 128, 256]), (24, 100, [32, 64]),
     (1, 4, [1, 2, 4]), (64, 32, []), (8, 0, [])],
)  # fmt: skip
def test_powers_of_two(low, high, expected) -> None:
    assert powers_of_two(low, high) == expected


@pytest.mark.parametrize(
    ("preset", "max_batch", "choices", "dropped", "added"),
    [
        # a small device: the top of the preset does not fit
        ([32, 64, 128, 256, 512], 200, [32, 64, 128], [256, 512], []),
        # a large device: the axis grows past the preset (at most MAX_CHOICES, the largest ones)
        ([32, 64, 128, 256, 512], 5000, [32, 64, 128, 256, 512, 1024, 2048, 4096], [],
         [1024, 2048, 4096]),
        ([32, 64, 128, 256, 512], 10**6,
         [4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288], [32, 64, 128, 256, 512],
         [4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288]),
        # nothing predicted to fit: the smallest stays (its OOM teaches the sampler)
        ([32, 64, 128], 10, [32], [64, 128], []),
        # a preset choice that is not a power of two is rebuilt away
        ([32, 48, 64], 100, [32, 64], [48], []),
    ],
)  # fmt: skip
def test_batch_choices_from_the_largest_fitting_batch(
    preset, max_batch, choices, dropped, added
) -> None:
    axis = batch_choices(preset, max_batch, "memory")
    assert axis.choices == choices
    assert [c for c, _ in axis.dropped] == dropped
    assert axis.added == added


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (PRESET, [32, 64, 128, 256, 512]),
        ({"loader.batch_size": "range(32,512)"}, None),  # not a choice: left as written
        ({"loader.batch_size": "choice(a,b)"}, None),
        ({"loader.num_workers": "choice(0,1)"}, None),  # no batch key
    ],
)
def test_preset_batches(params, expected) -> None:
    assert preset_batches(params) == expected


# ---- the sweep's space (the probe stubbed: its points are what a CPU trial would measure) ------


def _stub_probe(monkeypatch, points, ram_mb=64000.0, error=None):
    calls = []

    def fake(config_path, batches, timeout_s=120.0, python=None):
        calls.append(tuple(batches))
        return MemoryProbe(points=points, available_ram_mb=ram_mb, error=error)

    monkeypatch.setattr(memory_axis, "run_probe", fake)
    monkeypatch.setattr(memory_axis, "write_config", lambda config, d, name: Path(d) / "c.yaml")
    return calls


def test_cpu_memory_cap_shrinks_the_batch_axis_and_says_why(monkeypatch, tmp_path, caplog) -> None:
    # 100 MiB fixed + 1 MiB/sample; cap 250 MiB, 15% margin -> 212 usable -> largest batch 112
    calls = _stub_probe(monkeypatch, [(32, 132.0), (128, 228.0)])
    settings = SweeperOptions(memory_cap_mb=250)
    with caplog.at_level(logging.INFO, logger="gpuopt.sweeper.memory_axis"):
        axis = plan_batch_axis(None, PRESET, [], "cpu", settings, tmp_path)
    assert calls == [(32, 128)]  # the preset's smallest and 4x it
    assert axis is not None and axis.choices == [32, 64]
    space = build_search_space(PRESET, [], None, grid=False, batch_axis=axis)
    assert space.distributions["loader.batch_size"] == CategoricalDistribution([32, 64])
    assert [(k, c) for k, c, _ in space.dropped] == [
        ("loader.batch_size", "128"),
        ("loader.batch_size", "256"),
        ("loader.batch_size", "512"),
    ]
    assert all("250 MiB (hydra.sweeper.memory_cap_mb)" in why for _, _, why in space.dropped)
    text = caplog.text
    assert "largest micro-batch that fits ~ 112" in text
    assert "dropped loader.batch_size=512" in text


def test_no_axis_on_cpu_without_a_cap_or_when_the_command_line_sweeps_the_batch(
    monkeypatch, tmp_path
) -> None:
    calls = _stub_probe(monkeypatch, [(32, 132.0), (128, 228.0)])
    assert plan_batch_axis(None, PRESET, [], "cpu", SweeperOptions(), tmp_path) is None
    cli = ["loader.batch_size=choice(8,16)"]
    assert plan_batch_axis(None, PRESET, cli, "cuda", SweeperOptions(), tmp_path) is None
    off = SweeperOptions(memory_axis=False, memory_cap_mb=100)
    assert plan_batch_axis(None, PRESET, [], "cpu", off, tmp_path) is None
    assert calls == []  # no probe process started for any of them


def test_a_failed_probe_keeps_the_preset_axis(monkeypatch, tmp_path, caplog) -> None:
    _stub_probe(monkeypatch, [], error="OutOfMemoryError: CUDA out of memory")
    with caplog.at_level(logging.WARNING, logger="gpuopt.sweeper.memory_axis"):
        axis = plan_batch_axis(None, PRESET, [], "cuda", SweeperOptions(), tmp_path)
    assert axis is None
    assert "batch axis off (the preset's stays): OutOfMemoryError" in caplog.text


def test_an_accelerator_grows_the_axis_to_its_memory(monkeypatch, tmp_path) -> None:
    points = [(32, 1032.0), (128, 1128.0)]  # 1000 MiB + 1 MiB/sample

    def fake(config_path, batches, timeout_s=120.0, python=None):
        return MemoryProbe(points=points, device_memory_mb=10000.0)

    monkeypatch.setattr(memory_axis, "run_probe", fake)
    monkeypatch.setattr(memory_axis, "write_config", lambda config, d, name: Path(d) / "c.yaml")
    axis = plan_batch_axis(None, PRESET, [], "cuda", SweeperOptions(), tmp_path)
    assert axis is not None and axis.choices[-1] == 4096  # 8500 - 1000 = 7500 -> 4096
    assert axis.added == [1024, 2048, 4096]


@pytest.mark.slow
def test_the_probe_measures_a_growing_peak_on_cpu(tmp_path) -> None:
    """The real probe, two fresh processes: the peak grows with the micro-batch. The sizes are far
    apart (~200 MiB of activations between them) because a CPU's peak RSS at one size varies by
    ~40 MiB between processes (allocator arenas, thread pools): at 32 vs 1024 the growth drowned."""
    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose(
            config_name="config",
            overrides=["device=cpu", "model.width=2048"],
            return_hydra_config=True,
        )
    path = write_config(cfg, tmp_path, "memory_probe.yaml")
    probe = memory_axis.run_probe(path, (32, 4096), timeout_s=300)
    assert probe.error is None, probe.error
    assert [b for b, _ in probe.points] == [32, 4096]
    # One process: no rank peaks (the distributed probe's: tests/test_memory_axis_distributed.py).
    assert probe.world_size == 1 and probe.rank_peaks == {} and probe.points[0][1] > 0
    model = fit(probe.points)
    assert model is not None and model.per_sample_mb > 0
    assert probe.available_ram_mb and probe.available_ram_mb > 0
