"""Distributed trials (`distributed=ddp | fsdp2`) with real gloo process groups of world size 2 on
this CPU, started by the trial's own process through torch.distributed's elastic launcher: failures
of one rank as the trial's status (never a hang), no rank left behind a killed trial, and the
distributed group's bad input as one line. One result for the whole job, printed once, with each
kind's knobs: tests/test_distributed_numerics.py (the same job's numerics)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gpuopt.core.checks import check_composed, check_device_facts
from gpuopt.core.errors import ConfigError
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.core.spec import register_schemas
from gpuopt.trial.ranks import RankFailure, merge_ranks
from tests.conftest import TINY_TRIAL
from tests.helpers.cli import run_cli

REPO = Path(__file__).resolve().parents[1]
# Two ranks of a tiny MLP; each rank one thread (the launcher shares out the cores otherwise).
WORLD_2 = [*TINY_TRIAL, "distributed.nproc_per_node=2"]
MLP = ["model.width=32", "model.depth=2"]
# Subprocess bound: a trial that waited out a collective timeout of 600 s would overrun it.
BOUND_S = 240
# CPU seconds each rank has spent when the kill -9 test below kills their trial.
RANK_CPU_S = 5.0


def _cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_cli(tmp_path, *overrides, timeout=BOUND_S)


def _result(tmp_path: Path) -> TrialResult:
    (path,) = (tmp_path / "outputs" / "runs").glob("*/*/result.json")
    return TrialResult.load(path)


@pytest.mark.slow  # starts real gloo ranks in subprocesses
@pytest.mark.parametrize(
    "how,status,says",
    [
        ("raise", Status.ERROR, "rank 1: ValueError: a bug on rank 1"),
        ("oom", Status.OOM, "rank 1: RuntimeError"),
        ("kill", Status.ERROR, "rank 1 ended without a result (killed by SIGKILL)"),
    ],
)
def test_one_failing_rank_is_the_trials_status_and_the_others_do_not_wait(
    tmp_path, how, status, says
):
    """The collective timeout is 600 s: only the launcher ending the other rank at once lets
    the trial finish within the subprocess bound."""
    conf = _failing_model(tmp_path, how)
    proc = _cli(tmp_path, *conf, *WORLD_2, "distributed.timeout_s=600")
    assert proc.returncode == 0, proc.stderr
    result = _result(tmp_path)
    assert result.status is status and result.reason.startswith(says), result.reason
    if how == "kill":  # its stderr's lines, from the launcher's log of that rank
        assert "rank 1 is about to be killed" in result.reason
        (log,) = (tmp_path / "outputs" / "runs").glob("*/*/ranks/rank_1.stderr.log")
        assert "rank 1 is about to be killed" in log.read_text()  # kept with the run
    if how == "oom":
        assert "can't allocate memory" in result.reason


@pytest.mark.slow  # starts real gloo ranks in subprocesses
def test_a_hanging_rank_fails_the_trial_at_the_collective_timeout(tmp_path):
    proc = _cli(tmp_path, *_failing_model(tmp_path, "hang"), *WORLD_2, "distributed.timeout_s=3")
    assert proc.returncode == 0, proc.stderr
    result = _result(tmp_path)
    assert result.status is Status.ERROR and result.reason.startswith("rank 0: "), result.reason
    assert "timeout" in result.reason.lower() or "timed out" in result.reason.lower()


def _failing_model(tmp_path: Path, how: str) -> list[str]:
    folder = tmp_path / "conf" / "model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "failing.yaml").write_text(
        "_target_: tests.helpers.rank_models.FailingOnRank\n"
        "input: vectors\ninput_shape: [12]\nnum_classes: 3\n"
        "features: ${.input_shape[0]}\nclasses: ${.num_classes}\n"
        f"fail_rank: 1\nhow: {how}\nat_call: 5\n"
    )
    return [
        "--config-dir",
        str(tmp_path / "conf"),
        "model=failing",
        "trust=[tests.helpers.rank_models.*]",
        "distributed=ddp",
    ]


def _ranks_of(pid: int) -> list[int]:
    """The launcher's rank processes under `pid` (spawned: multiprocessing.spawn in their command)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if int(stat[1]) == pid and b"spawn_main" in cmdline:  # not the resource tracker
            found.append(int(entry.name))
    return found


def _cpu_seconds(pid: int) -> float:
    """user + system CPU time of `pid` so far (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow  # starts real gloo ranks in subprocesses
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)
def test_kill_9_of_the_trial_leaves_no_rank_behind(tmp_path):
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path / "outputs")}
    long_window = [
        "measure.time_budget_s=300",
        "measure.max_steps=1000000",
        "measure.min_time_s=300",
    ]
    trial = subprocess.Popen(
        [sys.executable, "-m", "gpuopt.run", "distributed=ddp", *WORLD_2, *MLP, *long_window],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + BOUND_S
        while len(ranks) < 2 and time.monotonic() < deadline and trial.poll() is None:
            time.sleep(0.5)
            ranks = _ranks_of(trial.pid)
        assert len(ranks) == 2, "the trial did not start two ranks"
        # Killed once both ranks run (past their imports, into the trial), not while starting:
        # a rank of a whole short trial of this job (imports, rendezvous, warm-up, window, extra
        # passes) spends ~3.7 CPU s here, so at RANK_CPU_S this one is in its long window.
        while min(map(_cpu_seconds, ranks)) < RANK_CPU_S and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_alive(pid) for pid in ranks)
        os.kill(trial.pid, signal.SIGKILL)
        trial.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), "a rank outlived its trial"
    finally:
        if trial.poll() is None:
            trial.kill()


# -- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,key,allowed",
    [
        (["distributed=ddp", "distributed.nproc_per_node=0"], "distributed.nproc_per_node", ">= 1"),
        (
            ["distributed=ddp", "distributed.backend=mpi"],
            "distributed.backend",
            "auto | gloo | nccl",
        ),
        (["distributed=fsdp2", "distributed.param_dtype=fp8"], "distributed.param_dtype", "fp32"),
        (["distributed=ddp", "distributed.timeout_s=0"], "distributed.timeout_s", "seconds > 0"),
        (  # several nodes need a place to meet (docs/distributed.md, "Several nodes")
            ["distributed=ddp", "distributed.nnodes=2"],
            "distributed.nnodes",
            "distributed.rdzv_endpoint=host:port",
        ),
        (
            ["distributed=ddp", "distributed.rdzv_endpoint=nohost"],
            "distributed.rdzv_endpoint",
            "host:port",
        ),
        (["distributed=ddp", "train.global_batch=24"], "train.global_batch", "x 2 ranks: 16, 32"),
    ],
)
def test_bad_distributed_values_are_one_config_error(compose_cfg, overrides, key, allowed):
    with pytest.raises(ConfigError) as info:
        check_composed(compose_cfg(*overrides, "loader.batch_size=8"), cpus=2)
    assert info.value.key == key and allowed in info.value.allowed, info.value


CPU_FACTS = {"devices": [{"device": "cpu"}], "cpus": 2}
OLD_GPU = {"devices": [{"device": "cpu"}, {"device": "cuda:0", "compute_capability": "7.5"}]}


@pytest.mark.parametrize(
    "overrides,facts,key,allowed",
    [
        (["device=cpu", "distributed.backend=nccl"], CPU_FACTS, "distributed.backend", "NCCL needs"),
        (["device=cuda", "distributed.nproc_per_node=2"], OLD_GPU, "distributed.nproc_per_node", "1 to 1"),
        (["device=cuda", "distributed.nproc_per_node=1", "distributed.reduce_dtype=bf16"], OLD_GPU,
         "distributed.reduce_dtype", "no bf16"),
    ],
)  # fmt: skip
def test_what_the_device_cannot_run_is_one_config_error(
    compose_cfg, overrides, facts, key, allowed
):
    cfg = compose_cfg("distributed=fsdp2", *overrides)
    with pytest.raises(ConfigError) as info:
        check_device_facts(cfg, facts)
    assert info.value.key == key and allowed in info.value.allowed, info.value


def test_a_bad_distributed_value_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    proc = _cli(tmp_path, "distributed=ddp", "device=cpu", "distributed.backend=nccl")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "distributed.backend" in line and "nccl" in line and "NCCL needs CUDA GPUs" in line
    assert not (tmp_path / "outputs").exists()


def test_the_default_is_one_process(compose_cfg):
    cfg = compose_cfg()
    assert OmegaConf.select(cfg, "distributed.kind") == "none"


# -- the merge, pure ---------------------------------------------------------------------------------
def _rank(
    throughput: float, seconds: float, step_ms: float, peak: float, wait: float
) -> TrialResult:
    metrics = Metrics(
        throughput=throughput,
        timed_seconds=seconds,
        step_time_ms=step_ms,
        peak_memory_mb=peak,
        data_wait=wait,
        timed_steps=10,
    )
    return TrialResult(Status.OK, metrics=metrics, env={"rank": 0})


def test_the_job_reads_the_slowest_window_the_straggler_and_the_worst_wait():
    merged = merge_ranks(
        {0: _rank(100.0, 2.0, 10.0, 50.0, 5.0), 1: _rank(80.0, 2.5, 12.5, 70.0, 20.0)},
        {},
        "gloo",
        3.0,
    )
    m = merged.metrics
    assert merged.status is Status.OK and m.world_size == 2
    assert m.throughput == pytest.approx((200 + 200) / 2.5)  # all samples over the slowest window
    assert (m.straggler_rank, m.step_time_ms, m.step_time_spread) == (1, 12.5, 25.0)
    assert (m.peak_memory_mb, m.peak_memory_spread_mb, m.data_wait) == (70.0, 20.0, 20.0)


def test_the_rank_that_failed_first_is_the_reason_and_a_silent_crash_keeps_its_stderr():
    first = TrialResult(Status.OOM, reason="OutOfMemoryError: x", env={"failed_at": 1.0})
    after = TrialResult(Status.ERROR, reason="RuntimeError: peer closed", env={"failed_at": 2.0})
    merged = merge_ranks({0: after, 1: first}, {}, "gloo", 1.0)
    assert (merged.status, merged.reason) == (Status.OOM, "rank 1: OutOfMemoryError: x")

    crash = RankFailure("killed by SIGKILL", None, "head\n...\ntail", 0.0)
    merged = merge_ranks({0: _rank(1.0, 1.0, 1.0, 1.0, 1.0)}, {1: crash}, "gloo", 1.0)
    assert merged.status is Status.ERROR and merged.metrics.world_size == 2
    assert (
        merged.reason
        == "rank 1 ended without a result (killed by SIGKILL); its stderr:\nhead\n...\ntail"
    )


def test_the_search_drops_what_this_cpu_cannot_run_from_the_distributed_knobs():
    from gpuopt.core.host import usable_cpus
    from gpuopt.core.knobs import judge
    from gpuopt.sweeper.space import drop_poor_choices
    from gpuopt.trial.devices import detect_capabilities

    facts = detect_capabilities("cpu")
    params = {
        "distributed.backend": "choice(gloo,nccl)",
        "distributed.nproc_per_node": f"choice(1,2,{2 * usable_cpus()})",
    }
    kept = drop_poor_choices(params, lambda key, value: judge(key, value, facts)).params
    assert kept == {
        "distributed.backend": "choice(gloo)",
        "distributed.nproc_per_node": "choice(1,2)",
    }


def test_the_distributed_search_preset_composes_and_confirms_in_fresh_processes():
    from hydra import compose, initialize_config_module

    from gpuopt.sweeper.race.policy import shareable

    register_schemas()

    with initialize_config_module("gpuopt.conf"):
        cfg = compose("config", overrides=["search=distributed"], return_hydra_config=True)
    assert cfg.distributed.kind == "ddp" and "distributed" in cfg.hydra.sweeper.params
    one = {"engine": {"name": "native"}, "loader": {"batch_size": 8}}
    ranks = {**one, "distributed": {"kind": "ddp"}}
    assert shareable(one, {**one, "loader": {"batch_size": 16}}) is None
    assert shareable(ranks, ranks) == "a distributed trial starts its own ranks"


# -- on CUDA (skipped without a GPU): NCCL, one rank per GPU ------------------------------------------
def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_on_cuda_every_visible_gpu_is_one_nccl_rank(tmp_path, kind):
    world = _gpus()
    extra = ["distributed.param_dtype=bf16"] if kind == "fsdp2" else []
    proc = _cli(
        tmp_path,
        f"distributed={kind}",
        "device=cuda",
        f"distributed.nproc_per_node={world}",
        "measure=quick",
        *MLP,
        *extra,
    )
    assert proc.returncode == 0, proc.stderr
    result = _result(tmp_path)
    assert result.status is Status.OK, result.reason
    assert result.metrics.world_size == world and result.env["backend"] == "nccl"
    assert len(result.ranks) == world and result.metrics.peak_memory_mb > 0


@pytest.mark.slow
def test_a_sweep_over_the_distributed_knobs_stores_one_trial_per_job(tmp_path):
    """`-m search=distributed`, tiny: the baseline (DDP on 2 ranks) alone, one study trial carrying
    the job's world size and its ranks' rows (every trial of the sweep is one such job). Without the measurement's
    extra passes (ceiling, FLOP count, peak probe, loader cost: a quarter of the CPU time here),
    which a distributed trial runs as the single trials above do."""
    import optuna

    proc = subprocess.run(
        [
            sys.executable, "-m", "gpuopt.run", "-m", "search=distributed", "device=cpu",
            "hydra.sweeper.n_trials=1", "hydra.sweeper.confirm.rounds=0", *TINY_TRIAL, *MLP,
            "measure.ceiling=false", "measure.count_flops=false", "measure.peak_probe=false",
            "measure.loader_cost=false",
        ],
        cwd=REPO,
        env={**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
        timeout=2 * BOUND_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    storage = f"sqlite:///{tmp_path / 'gpuopt.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).trials
    assert len(trials) == 1
    for trial in trials:
        attrs = trial.user_attrs
        assert attrs["status"] == "ok", attrs.get("reason")
        assert attrs["world_size"] == 2 and [row["rank"] for row in attrs["ranks"]] == [0, 1]
        assert attrs["global_batch"] == 2 * attrs["micro_batch"] * attrs["accumulation_steps"]
        # the guard ran in the ranks on the job's math; its reference is the sweep's (cached)
        assert " x 2 ranks" in attrs["numerics"]["changes"][-1], attrs["numerics"]
    assert list(tmp_path.glob("**/.numerics/*.json")), "no reference cached in the sweep dir"


@pytest.mark.slow  # starts real gloo ranks in subprocesses
def test_run_trial_in_process_measures_the_job_and_leaves_the_signal_handlers_as_they_were(
    compose_cfg,
):
    """The API route (`gpuopt.engines.registry.run_trial`) in this very process: the launcher's
    own signal handlers do not outlive the trial. Its job is FSDP2 on GPT-2 (tiny, from its
    config), each GPT2Block a shard of its own: one job of ranks for both checks, not two (the
    command line's distributed route is the tests' above)."""
    from gpuopt.engines.registry import run_trial
    from gpuopt.trial.prepare import load_spec

    hf = importlib.util.find_spec("transformers") is not None  # the `hf` extra; else the MLP
    model = ["model=hf_gpt2_tiny", "distributed.shard_modules=[GPT2Block]"] if hf else MLP
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    spec = load_spec(compose_cfg("distributed=fsdp2", *WORLD_2, *model))
    result = run_trial(spec)
    assert result.status is Status.OK, result.reason
    assert result.metrics.world_size == 2 and result.config["distributed"]["kind"] == "fsdp2"
    assert result.metrics.flops_per_sample > 0
    if hf:
        assert result.config["model"]["architecture"] == "GPT2LMHeadModel"
        assert result.config["distributed"]["shard_modules"] == ["GPT2Block"]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_the_guards_reference_is_one_process_on_the_jobs_global_batch(compose_cfg):
    from gpuopt.trial.numerics import reference_spec
    from gpuopt.trial.prepare import load_spec

    overrides = ["loader.batch_size=8", "train.global_batch=32", "optimizer.lr_scaling=linear"]
    spec = load_spec(compose_cfg("distributed=ddp", *overrides))
    reference = reference_spec(spec)
    assert (spec.world_size, spec.accumulation_steps, spec.global_batch) == (2, 2, 32)
    assert (reference.world_size, reference.global_batch) == (1, 32)
    assert reference.lr_scale == spec.lr_scale == 1.0
