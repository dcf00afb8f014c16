"""The memory-aware batch axis of a distributed config (docs/distributed.md): the probe runs the
job's ranks (real gloo, world size 2 on this CPU), each at the per-rank micro-batch, and its peak
is the largest rank's; the sweeper side reads the probe's line (world size, per-rank peaks, a
failed job) and says in its log that the peak is per rank."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

from gpuopt.sweeper import memory_axis
from gpuopt.sweeper.memory_axis import (
    MemoryProbe,
    peak_label,
    plan_batch_axis,
    probe_failure,
    read_probe_line,
    run_probe,
)
from gpuopt.sweeper.options import SweeperOptions
from gpuopt.sweeper.shared_process import write_config

PRESET = {"loader.batch_size": "choice(32,64,128,256,512)"}


# ---- the sweeper side: the probe's JSON line ---------------------------------------------------


def test_the_probe_line_is_the_last_json_object_of_stdout() -> None:
    assert read_probe_line('launcher noise\n{"peak_mb": 5.0, "world_size": 2}\n') == {
        "peak_mb": 5.0,
        "world_size": 2,
    }
    assert read_probe_line("  \n") == {}
    with pytest.raises(json.JSONDecodeError):
        read_probe_line("[1, 2]")  # JSON, not an object: no answer


def test_a_distributed_line_adds_the_largest_ranks_peak_and_every_ranks() -> None:
    probe = MemoryProbe()
    line = {"peak_mb": 210.0, "rank_peaks_mb": [200.0, 210.0], "world_size": 2}
    probe.add(8, {**line, "available_ram_mb": 9000.0})
    probe.add(32, {"peak_mb": 260.0, "rank_peaks_mb": [260.0, 255.0], "world_size": 2})
    assert probe.points == [(8, 210.0), (32, 260.0)]
    assert probe.rank_peaks == {8: [200.0, 210.0], 32: [260.0, 255.0]}
    assert probe.world_size == 2
    single = MemoryProbe()
    single.add(8, {"peak_mb": 100.0})  # one process (also an older probe without world_size)
    assert single.world_size == 1 and single.rank_peaks == {}


@pytest.mark.parametrize(
    ("returncode", "data", "stderr", "expected"),
    [
        (0, {"peak_mb": 1.0, "world_size": 2}, "", None),
        (0, {"error": "oom (distributed=fsdp2): rank 1: OutOfMemoryError", "world_size": 2}, "",
         "exited 0 (2 ranks): oom (distributed=fsdp2): rank 1: OutOfMemoryError"),
        (0, {"world_size": 2}, "", "exited 0 (2 ranks): no output"),  # no peak
        (1, {}, "Traceback\nImportError: x", "exited 1: ImportError: x"),
        (0, {"error": "ValueError: v", "world_size": 1}, "", "exited 0: ValueError: v"),
    ],
)  # fmt: skip
def test_probe_failure_says_why_and_the_jobs_size(returncode, data, stderr, expected) -> None:
    assert probe_failure(returncode, data, stderr) == expected


def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for `python -m gpuopt.processes.memory_probe CONFIG BATCH`: a real
    subprocess whose stdout is what a probe of a 2-rank job prints ($4 is the batch)."""
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_run_probe_reads_a_distributed_probe_per_batch(tmp_path) -> None:
    python = _fake_python(
        tmp_path,
        'echo "rank noise"\n'
        'echo "{\\"batch\\": $4, \\"world_size\\": 2, \\"peak_mb\\": $((100 + $4)), '
        '\\"rank_peaks_mb\\": [$((90 + $4)), $((100 + $4))], \\"available_ram_mb\\": 8000}"\n',
    )
    probe = run_probe(tmp_path / "c.yaml", (8, 32), python=python)
    assert probe.error is None, probe.error
    assert probe.points == [(8, 108.0), (32, 132.0)] and probe.world_size == 2
    assert probe.rank_peaks == {8: [98.0, 108.0], 32: [122.0, 132.0]}


def test_a_failed_distributed_probe_turns_the_axis_off_not_the_sweep(
    tmp_path, monkeypatch, caplog
) -> None:
    python = _fake_python(
        tmp_path,
        'echo \'{"error": "oom (distributed=fsdp2): rank 1: OutOfMemoryError: CUDA out of '
        'memory", "world_size": 2}\'\n',
    )
    real = memory_axis.run_probe
    monkeypatch.setattr(
        memory_axis,
        "run_probe",
        lambda path, batches, timeout_s: real(path, batches, timeout_s, python),
    )
    monkeypatch.setattr(memory_axis, "write_config", lambda config, d, name: Path(d) / "c.yaml")
    with caplog.at_level(logging.WARNING, logger="gpuopt.sweeper.memory_axis"):
        axis = plan_batch_axis(None, PRESET, [], "cuda", SweeperOptions(), tmp_path)
    assert axis is None
    assert "batch axis off (the preset's stays)" in caplog.text
    assert "(2 ranks): oom (distributed=fsdp2): rank 1: OutOfMemoryError" in caplog.text


def test_the_axis_log_says_the_peak_is_per_rank_of_the_world_size(
    tmp_path, monkeypatch, caplog
) -> None:
    # The largest rank: 100 MiB fixed + 1 MiB/sample; cap 250 MiB per rank -> 212 usable -> 112.
    probe = MemoryProbe(
        points=[(32, 132.0), (128, 228.0)],
        world_size=2,
        rank_peaks={32: [120.0, 132.0], 128: [228.0, 210.0]},
    )
    monkeypatch.setattr(memory_axis, "run_probe", lambda *args, **kwargs: probe)
    monkeypatch.setattr(memory_axis, "write_config", lambda config, d, name: Path(d) / "c.yaml")
    with caplog.at_level(logging.INFO, logger="gpuopt.sweeper.memory_axis"):
        axis = plan_batch_axis(None, PRESET, [], "cpu", SweeperOptions(memory_cap_mb=250), tmp_path)
    assert axis is not None and axis.choices == [32, 64]
    assert "memory-aware: peak per rank of 2 ~ 100 MiB + 1.000 MiB/sample" in caplog.text
    assert "largest micro-batch that fits ~ 112" in caplog.text
    assert [choice for choice, _ in axis.dropped] == [128, 256, 512]
    assert all(why.startswith("predicted peak per rank of 2 213+ MiB") for _, why in axis.dropped)
    assert peak_label(1) == "peak"  # one process's log line stays as it was


# ---- the probe of a real 2-rank job --------------------------------------------------------------


def _probe_config(tmp_path: Path, name: str, *overrides: str) -> Path:
    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose(
            config_name="config",
            # Each layer 3072 x 3072 fp32 (36 MiB, over glibc's 32 MiB mmap threshold: a freed
            # all-gather buffer leaves the RSS, where a smaller layer's stays in the heap and the
            # peak RSS). Parameters + gradients + AdamW's two states ~ 4 x 146 MiB in one process.
            overrides=[
                "device=cpu",
                "device.num_threads=1",
                "model.width=3072",
                "model.depth=4",
                "data.size=64",
                *overrides,
            ],
            return_hydra_config=True,
        )
    return write_config(cfg, tmp_path, f"{name}.yaml")


@pytest.mark.slow  # starts a probe process with two real gloo ranks
def test_an_fsdp2_probe_measures_every_rank_and_its_shard_holds_less(tmp_path) -> None:
    """The probe of a distributed config runs its ranks and reports each rank's peak, the largest
    as the job's (the budget is per device). Whether a shard holds less than one process is not
    asserted: peak RSS growth on the CPU varies by hundreds of MiB between runs (one process of
    this config read 752 MiB and, in a clean-clone CI run, 490 MiB; each FSDP2 rank 514-536 MiB),
    so it says what the allocator kept, not only what FSDP2 sharded (docs/distributed.md). A
    single-process probe (no rank peaks) is tests/test_memory_axis.py's real probe."""
    fsdp2 = _probe_config(
        tmp_path, "fsdp2", "distributed=fsdp2", "distributed.shard_modules=[Linear]"
    )
    sharded = run_probe(fsdp2, (8,), timeout_s=300)
    assert sharded.error is None, sharded.error
    assert sharded.world_size == 2
    ((batch, peak),) = sharded.points
    ranks = sharded.rank_peaks[batch]
    assert batch == 8 and len(ranks) == 2 and all(mb > 0 for mb in ranks)
    assert peak == max(ranks)  # the budget is per device: the largest rank's
