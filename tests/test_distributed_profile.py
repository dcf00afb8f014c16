"""The profiled window of a distributed trial (`distributed=ddp | fsdp2` with `profile=on`): every
rank profiles the same steps, its trace kept in the trial's run directory, and the communication
share of the step read from it (gpuopt.trial.trace.comm_time): one real 2-rank gloo DDP trial whose
rank 1 is slow (its peer must wait for it: exposed communication on rank 0), and the trace reading
on hand-made events where the interval arithmetic, not the machine, is under test."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.trial.profiled_window import RUN_DIR_ENV, TEMP_PREFIX, TRACE_FILE, ProfileSummary
from gpuopt.trial.ranks import merge_ranks
from gpuopt.trial.trace import STEP_SPAN, collective_name, comm_time
from tests.conftest import TINY_TRIAL
from tests.helpers.cli import run_cli

BOUND_S = 240
# Rank 1's extra time in each forward: rank 0 reaches each all-reduce that much earlier and waits
# there, rank 1 waits only for a rank 0 that fell more than this behind in one step. A sleep, so
# other processes on the cores (a CPU burner, other tests) do not shorten it; long beside the
# steps' few ms of compute, so that they would have to stall rank 0 for 0.1 s a step to reverse it.
SLEEP_S = 0.1


class SlowOnRank(nn.Module):
    """A small MLP whose rank `slow_rank` sleeps `sleep_s` in each forward: its peers reach the
    gradient all-reduce first and wait there for it."""

    def __init__(self, features: int, classes: int, slow_rank: int, sleep_s: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))
        self.slow_rank, self.sleep_s = slow_rank, sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if int(os.environ.get("RANK", "-1")) == self.slow_rank:
            time.sleep(self.sleep_s)
        return self.net(x)


# -- one real distributed profiled trial --------------------------------------------------------------
def _slow_rank_model(tmp_path: Path) -> list[str]:
    folder = tmp_path / "conf" / "model"
    folder.mkdir(parents=True)
    (folder / "slow.yaml").write_text(
        f"_target_: {__name__}.SlowOnRank\n"
        "input: vectors\ninput_shape: [12]\nnum_classes: 3\n"
        "features: ${.input_shape[0]}\nclasses: ${.num_classes}\n"
        f"slow_rank: 1\nsleep_s: {SLEEP_S}\n"
    )
    return ["--config-dir", str(tmp_path / "conf"), "model=slow", f"trust=[{__name__}.*]"]


@pytest.mark.slow  # starts real gloo ranks in subprocesses
def test_every_rank_profiles_and_the_slow_ranks_peer_waits_in_the_all_reduce(tmp_path):
    assert RUN_DIR_ENV not in os.environ  # the ranks find the run dir themselves
    overrides = [
        *_slow_rank_model(tmp_path),
        "distributed=ddp",
        *TINY_TRIAL,
        "distributed.nproc_per_node=2",
        "train.global_batch=16",  # 8 per rank, one micro-batch a step
        "guard.enabled=false",
        "profile=on",
        "profile.steps=3",
    ]
    proc = run_cli(tmp_path, *overrides, timeout=BOUND_S)
    assert proc.returncode == 0, proc.stderr
    (path,) = (tmp_path / "outputs" / "runs").glob("*/*/result.json")
    result, run_dir = TrialResult.load(path), path.parent
    assert result.status is Status.OK, result.reason
    assert not any("not profiled" in w for w in result.warnings)
    assert "communication" in proc.stdout

    # Each rank's trace, moved from the rank's temporary directory into the run directory.
    profile = result.profile
    assert profile["trace_path"] == str(run_dir / TRACE_FILE)
    assert profile["rank_traces"] == {
        "0": str(run_dir / TRACE_FILE),
        "1": str(run_dir / "trace_rank1.json.gz"),
    }
    for trace in profile["rank_traces"].values():
        with gzip.open(trace, "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert STEP_SPAN in names and "gloo:all_reduce" in names

    # Rank 0 waits for rank 1 in every step's all-reduce: exposed, by about rank 1's sleep.
    summary = ProfileSummary.from_dict(profile)
    comm = summary.comm
    assert summary.steps == 3 and comm is not None and comm.basis == "host"
    assert comm.exposed_s >= 0.5 * SLEEP_S, comm
    assert comm.by_collective_s["all_reduce"] >= comm.exposed_s * 0.9
    assert comm.exposed_s + comm.overlapped_s == pytest.approx(comm.comm_s)
    rank0, rank1 = result.ranks
    assert rank0["comm_exposed"] == pytest.approx(comm.exposed_pct)
    assert rank1["comm_exposed"] < rank0["comm_exposed"]  # the slow rank waits for nobody
    m = result.metrics
    for name in ("comm_share", "comm_exposed", "comm_overlapped"):
        assert getattr(m, name) == pytest.approx((rank0[name] + rank1[name]) / 2)
    assert m.comm_share == pytest.approx(m.comm_exposed + m.comm_overlapped)
    assert 0 < m.comm_exposed <= m.comm_share <= 100


# -- the trace reading, on hand-made events -----------------------------------------------------------
MAIN, GLOO_A, GLOO_B, STREAM = 1, 2, 3, 7


def _event(name: str, ts: float, dur: float, tid: int = MAIN, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 10, "tid": tid}


def _host_trace() -> list[dict]:
    """One step [0, 100) on the training thread, two gloo worker threads:

    forward op [5, 30); a backward op [30, 60) whose FSDP-style copy-out waits [40, 50) with no op
    inside; the enqueue `c10d::allreduce_` [60, 62); DDP-style wait [62, 90) with no op; the
    optimizer op [90, 98). Collectives: all_reduce [35, 55) and all_gather [36, 45) on the two
    workers, all_reduce [62, 90); a barrier [-20, -5) before the step (not counted)."""
    return [
        _event(STEP_SPAN, 0, 100, cat="user_annotation"),
        _event("aten::addmm", 5, 25),
        _event("autograd::engine::evaluate_function: AddmmBackward0", 30, 30),
        _event("aten::mm", 31, 5),
        _event("FSDP::all_gather_copy_out (0)", 40, 10, cat="user_annotation"),
        _event("c10d::allreduce_", 60, 2),
        _event("aten::view", 60.5, 0.5),  # inside the collective's own op: still communication
        _event("Optimizer.step#SGD.step", 90, 8, cat="user_annotation"),
        _event("aten::add_", 90, 8),
        _event("gloo:all_reduce", 35, 20, tid=GLOO_A, cat="user_annotation"),
        _event("gloo:all_gather", 36, 9, tid=GLOO_B, cat="user_annotation"),
        _event("gloo:all_reduce", 62, 28, tid=GLOO_B, cat="user_annotation"),
        _event("gloo:barrier", -20, 15, tid=GLOO_A, cat="user_annotation"),
        {"ph": "M", "name": "thread_name", "pid": 10, "tid": GLOO_A},
    ]


def test_host_split_counts_waits_with_no_operator_running_as_exposed():
    comm = comm_time(_host_trace())
    assert comm is not None and comm.basis == "host"
    # in flight: [35, 55) + [60, 62) (the enqueue) + [62, 90) = 50 us of the 100 us step
    assert comm.comm_s == pytest.approx(50e-6) and comm.comm_pct == pytest.approx(50.0)
    # exposed: the copy-out wait [40, 50), the enqueue [60, 62) and the DDP wait [62, 90)
    assert comm.exposed_s == pytest.approx(40e-6) and comm.exposed_pct == pytest.approx(40.0)
    # overlapped: the all-reduce beside the backward's op, [35, 40) and [50, 55)
    assert comm.overlapped_s == pytest.approx(10e-6) and comm.overlapped_pct == pytest.approx(10.0)
    assert comm.by_collective_s == pytest.approx({"all_gather": 9e-6, "all_reduce": 48e-6})


def test_host_split_is_per_step_and_none_without_collectives():
    two_steps = _host_trace() + [
        {**e, "ts": e["ts"] + 1000} for e in _host_trace() if e.get("ph") == "X"
    ]
    comm = comm_time(two_steps)
    assert comm is not None and comm.exposed_s == pytest.approx(40e-6)  # per step
    assert comm.exposed_pct == pytest.approx(40.0)
    single = [e for e in _host_trace() if not e["name"].startswith(("gloo:", "c10d::"))]
    assert comm_time(single) is None  # a single-process trace
    assert comm_time([e for e in _host_trace() if e["name"] != STEP_SPAN]) is None


def test_gpu_split_is_nccl_kernels_against_the_other_gpu_work():
    """On CUDA the device's view: NCCL kernel time with no compute kernel or copy beside it."""
    events = [
        _event(STEP_SPAN, 0, 40, cat="user_annotation"),
        _event("ampere_sgemm_128x64_nn", 0, 20, tid=STREAM, cat="kernel"),
        _event(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            10,
            20,
            tid=STREAM + 1,
            cat="kernel",
        ),
        _event("Memcpy DtoD (Device -> Device)", 25, 3, tid=STREAM, cat="gpu_memcpy"),
        _event("gloo:broadcast", 5, 30, tid=GLOO_A, cat="user_annotation"),  # host agreement
    ]
    comm = comm_time(events)
    assert comm is not None and comm.basis == "gpu"
    assert comm.comm_s == pytest.approx(20e-6) and comm.comm_pct == pytest.approx(50.0)
    assert comm.overlapped_s == pytest.approx(13e-6)  # [10, 20) beside the gemm, [25, 28) the copy
    assert comm.exposed_pct == pytest.approx(17.5)
    assert comm.by_collective_s == pytest.approx({"all_reduce": 20e-6})


@pytest.mark.parametrize(
    "name,collective",
    [
        ("gloo:all_gather", "all_gather"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", "all_gather"),
        ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "broadcast"),
    ],
)  # fmt: skip
def test_collective_names(name, collective):
    assert collective_name(name) == collective


def test_summary_round_trips_its_comm_split():
    comm = comm_time(_host_trace())
    summary = ProfileSummary(
        steps=1,
        step_s=1e-4,
        window_s=1e-4,
        phases_s={},
        phases_pct={},
        top_ops=[],
        gpu=None,
        trace_path=None,
        cost_s=0.0,
        comm=comm,
        rank_traces={"0": "a", "1": "b"},
    )
    again = ProfileSummary.from_dict(json.loads(json.dumps(summary.to_dict())))
    assert again == summary


# -- the merge ----------------------------------------------------------------------------------------
def _rank_result(trace: Path, share: float, exposed: float) -> TrialResult:
    metrics = Metrics(
        throughput=100.0,
        timed_seconds=1.0,
        step_time_ms=10.0,
        comm_share=share,
        comm_exposed=exposed,
        comm_overlapped=share - exposed,
    )
    return TrialResult(Status.OK, metrics=metrics, profile={"trace_path": str(trace), "steps": 3})


def _written(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(b"trace")
    return path


def test_merge_moves_each_ranks_trace_into_the_run_dir_and_averages_the_shares(
    tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    rank0 = _written(tmp_path / f"{TEMP_PREFIX}a", TRACE_FILE)
    rank1 = _written(tmp_path / f"{TEMP_PREFIX}b", "trace_rank1.json.gz")
    results = {0: _rank_result(rank0, 40.0, 30.0), 1: _rank_result(rank1, 20.0, 4.0)}
    merged = merge_ranks(results, {}, "gloo", 1.0)
    assert merged.status is Status.OK
    assert merged.profile["trace_path"] == str(run_dir / TRACE_FILE)
    assert merged.profile["rank_traces"]["1"] == str(run_dir / "trace_rank1.json.gz")
    assert (run_dir / TRACE_FILE).read_bytes() == b"trace" and not rank0.exists()
    assert not rank1.parent.exists()  # the rank's emptied temporary directory is gone
    m = merged.metrics
    assert (m.comm_share, m.comm_exposed, m.comm_overlapped) == (30.0, 17.0, 13.0)
    assert [row["comm_exposed"] for row in merged.ranks] == [30.0, 4.0]


def test_merge_leaves_traces_in_place_without_a_run_dir_and_no_share_for_a_partial_profile(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    rank0 = _written(tmp_path, TRACE_FILE)
    results = {0: _rank_result(rank0, 40.0, 30.0), 1: TrialResult(Status.OK, Metrics(1.0))}
    merged = merge_ranks(results, {}, "gloo", 1.0)
    assert merged.profile["rank_traces"] == {"0": str(rank0)} and rank0.exists()
    assert merged.metrics.comm_share is None  # rank 1 has none: no mean over half the job


def test_the_report_cites_the_communication_share_beside_the_phases():
    from gpuopt.report.evidence import Facts, phase_evidence

    profile = {"phases_pct": {"forward": 20.0, "backward": 70.0, "other": 10.0}}
    metrics = {"comm_share": 40.0, "comm_exposed": 30.0, "profile": profile}
    lines = phase_evidence(Facts.of(metrics, "ok", "cpu", {}))
    assert lines[-1] == (
        "profiled communication: 40% of the step, 30 points exposed, 10 overlapped "
        "(mean over ranks)"
    )
    one_process = phase_evidence(Facts.of({"profile": profile}, "ok", "cpu", {}))
    assert not any("communication" in line for line in one_process)
