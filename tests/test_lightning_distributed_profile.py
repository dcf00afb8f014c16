"""The profiled window of a distributed trial under the Lightning engine (`engine=lightning
distributed=ddp profile=on`): every rank fits the same profiled optimizer steps after a barrier,
each writes its trace, the trial's process moves them into its run directory and averages the
ranks' communication shares (one real 2-rank gloo trial of a user's LightningModule with its own
train_dataloader); and the numerics guard on such a module, which says in one line why it cannot
run (it was a ZeroDivisionError: no data to draw its fixed batches from)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gpuopt.core.result import Status, TrialResult
from gpuopt.trial.profiled_window import TEMP_PREFIX, TRACE_FILE, ProfiledSteps, ProfileSummary
from gpuopt.trial.trace import STEP_SPAN
from tests.conftest import TINY_TRIAL
from tests.helpers.cli import run_cli

pytest.importorskip("lightning")

from gpuopt.core.spec import ProfileConf
from gpuopt.engines._guard import check, fixed_batches, guard_numerics
from gpuopt.engines.lightning.fit_profile import ProfileWindow
from gpuopt.trial.context import Trial
from gpuopt.trial.numerics import NotGuarded
from gpuopt.trial.prepare import load_spec
from tests.helpers.lightning_specs import user_spec as _user_spec

HELPERS = "tests.helpers.lightning_models"
BOUND_S = 240  # a trial waiting out a collective timeout would overrun it
NOT_RUN = "numerics guard not run: "
OWN_STEP = "TinyClassifier trains through its own training_step"


def _user_module_config(tmp_path: Path) -> list[str]:
    """`model=tiny`: the user's LightningModule with its own train_dataloader (no data group)."""
    folder = tmp_path / "conf" / "model"
    folder.mkdir(parents=True)
    (folder / "tiny.yaml").write_text(f"_target_: {HELPERS}.TinyClassifier\nsize: 128\n")
    return ["--config-dir", str(tmp_path / "conf"), "model=tiny", "~data", f"trust=[{HELPERS}.*]"]


def _trace_events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


@pytest.mark.slow  # starts real gloo ranks in subprocesses
def test_every_rank_profiles_the_same_optimizer_steps_and_the_job_averages_the_shares(tmp_path):
    steps = 2
    overrides = [
        *_user_module_config(tmp_path),
        "engine=lightning",
        "distributed=ddp",
        *TINY_TRIAL[:5],  # the measure group (not the data group's keys: no data group)
        "loader.batch_size=8",  # the micro-batch the job is sized by (the module's loader is 8)
        "device=cpu",
        "device.num_threads=1",
        "distributed.nproc_per_node=2",
        "train.global_batch=32",  # 8 per micro-batch x accumulation 2 x 2 ranks
        "measure.ceiling=false",
        "profile=on",
        f"profile.steps={steps}",
    ]
    proc = run_cli(tmp_path, *overrides, timeout=BOUND_S)
    assert proc.returncode == 0, proc.stderr
    (path,) = (tmp_path / "outputs" / "runs").glob("*/*/result.json")
    result, run_dir = TrialResult.load(path), path.parent
    assert result.status is Status.OK, result.reason
    assert not any("not profiled" in w for w in result.warnings), result.warnings
    assert result.metrics.accumulation_steps == 2 and result.metrics.world_size == 2

    # Each rank's trace, moved from the rank's temporary directory into the run directory.
    profile = result.profile
    traces = {"0": str(run_dir / TRACE_FILE), "1": str(run_dir / "trace_rank1.json.gz")}
    assert profile["trace_path"] == traces["0"] and profile["rank_traces"] == traces
    assert not any(p.name.startswith(TEMP_PREFIX) for p in run_dir.iterdir())
    for trace in traces.values():
        events = _trace_events(trace)
        names = [e.get("name") for e in events]
        # The same optimizer steps on every rank, each two micro-batches (one forward each), the
        # gradient all-reduce in them: a step is an optimizer step, as in the native engine.
        assert names.count(STEP_SPAN) == steps, trace
        assert names.count("gpuopt:forward") == 2 * steps, trace
        assert "gloo:all_reduce" in names, trace

    # Rank 0's summary carries its communication split; the job's shares are the ranks' mean.
    summary = ProfileSummary.from_dict(profile)
    comm = summary.comm
    assert summary.steps == steps and comm is not None and comm.basis == "host"
    assert comm.by_collective_s["all_reduce"] > 0
    assert comm.exposed_s + comm.overlapped_s == pytest.approx(comm.comm_s)
    rank0, rank1 = result.ranks
    assert rank0["comm_share"] == pytest.approx(comm.comm_pct)
    m = result.metrics
    for name in ("comm_share", "comm_exposed", "comm_overlapped"):
        assert rank1[name] is not None
        assert getattr(m, name) == pytest.approx((rank0[name] + rank1[name]) / 2)
    assert 0 < m.comm_share <= 100 and m.comm_share == pytest.approx(
        m.comm_exposed + m.comm_overlapped
    )
    assert "communication" in proc.stdout

    # The guard on the module's own loader: one line saying why, once for the job.
    not_run = [w for w in result.warnings if w.startswith(NOT_RUN)]
    assert len(not_run) == 1 and OWN_STEP in not_run[0], result.warnings
    assert "ZeroDivisionError" not in proc.stdout + proc.stderr


# -- the guard on a module that brings its own data ---------------------------------------------------


def test_the_guard_of_a_module_with_its_own_loader_says_why_in_one_line(compose_cfg):
    """bf16 changes the math, so the guard is asked for; TinyClassifier has no data group."""
    spec = _user_spec(compose_cfg, {"_target_": f"{HELPERS}.TinyClassifier"}, "precision=bf16")
    assert spec.data == {}
    with pytest.raises(NotGuarded, match=r"no data\._target_"):
        fixed_batches(spec, 2)  # was: ZeroDivisionError (an empty config's len is 0)
    with pytest.raises(NotGuarded, match=OWN_STEP):
        check(spec, torch.device("cpu"))
    trial = Trial(spec, torch.device("cpu"))
    guard_numerics(trial)
    assert trial.warnings == [
        f"{NOT_RUN}NotGuarded: {OWN_STEP} (the guard trains gpuopt's step on data._target_'s "
        "samples)"
    ]


def test_fixed_batches_name_a_datamodule_they_cannot_draw_from(compose_cfg):
    data = {"_target_": f"{HELPERS}.TinyDataModule"}
    spec = _user_spec(compose_cfg, {"_target_": f"{HELPERS}.TinyClassifier"}, data=data)
    with pytest.raises(NotGuarded, match="is a TinyDataModule, not a map-style Dataset"):
        fixed_batches(spec, 2)


def test_fixed_batches_of_a_dataset_are_global_batches_in_order(compose_cfg):
    spec = load_spec(compose_cfg(*TINY_TRIAL, "train.global_batch=16"))
    batches = fixed_batches(spec, 5)  # data.size=64: the fifth batch wraps to the first samples
    assert [len(inputs) for inputs, _ in batches] == [16] * 5
    assert torch.equal(batches[4][0], batches[0][0])
    assert not torch.equal(batches[1][0], batches[0][0])


# -- the window's steps are optimizer steps ---------------------------------------------------------
def test_the_profile_window_ends_a_step_only_when_the_optimizer_stepped(tmp_path):
    conf = ProfileConf(enabled=True, steps=2, warmup_steps=1)
    steps = ProfiledSteps(torch.device("cpu"), conf, tmp_path / TRACE_FILE)
    spans = SimpleNamespace(active=False)
    window = ProfileWindow(steps, spans)  # type: ignore[arg-type]
    trainer = SimpleNamespace(global_step=0, should_stop=False)
    window.on_train_start(trainer, None)  # type: ignore[arg-type]
    assert spans.active
    for optimizer_step in range(1, 4):
        window.on_train_batch_end(trainer, None)  # type: ignore[arg-type]  # accumulates only
        assert steps.index == optimizer_step - 1 and not trainer.should_stop
        trainer.global_step = optimizer_step  # the second micro-batch stepped the optimizer
        window.on_train_batch_end(trainer, None)  # type: ignore[arg-type]
        assert steps.index == optimizer_step
    assert steps.finished and trainer.should_stop and not spans.active
    assert (tmp_path / TRACE_FILE).exists()
