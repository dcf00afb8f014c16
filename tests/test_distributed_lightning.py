"""Distributed trials under the Lightning engine (`engine=lightning distributed=ddp | fsdp2`): the
ranks are gpuopt's own (torch.distributed's elastic launcher, real gloo world size 2 on this CPU),
each rank's Trainer joins them through Lightning's TorchElasticEnvironment with DDPStrategy or
ModelParallelStrategy; the knob mapping; and what cannot be mapped as one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuopt.core.checks import check_composed
from gpuopt.core.errors import ConfigError
from gpuopt.core.result import Status, TrialResult
from gpuopt.core.spec import DistributedConf
from gpuopt.trial.prepare import check_lightning_module_sharding
from tests.conftest import TINY_TRIAL

pytest.importorskip("lightning")

from gpuopt.engines._distributed import ddp_kwargs
from gpuopt.engines.lightning.engine import lightning_strategy, trainer_devices
from gpuopt.trial.prepare import load_spec

REPO = Path(__file__).resolve().parents[1]
HELPERS = "tests.helpers.lightning_models"
# Two ranks of a tiny MLP under Lightning, global batch 32 = micro-batch 8 x accumulation 2 x 2.
WORLD_2 = [
    "engine=lightning",
    *TINY_TRIAL,
    "distributed.nproc_per_node=2",
    "model.width=32",
    "model.depth=2",
    "train.global_batch=32",
]
BOUND_S = 240  # a trial waiting out a collective timeout would overrun it
FACTS = "lightning facts: "  # what _inspected_rank saw, as a note of its rank's result


@pytest.mark.slow  # starts real gloo ranks in subprocesses
def test_lightning_ddp_prints_one_result_for_the_job_and_starts_no_process_of_its_own(tmp_path):
    """`python -m gpuopt.run engine=lightning distributed=ddp`: gpuopt's launcher starts the two
    ranks, Lightning's DDP joins them instead of re-running the command (which would leave more
    Hydra run directories, more ranks than two, or more than one result)."""
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path / "outputs")}
    proc = subprocess.run(
        [sys.executable, "-m", "gpuopt.run", "distributed=ddp", *WORLD_2],
        cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=BOUND_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("gpuopt trial: ok") == 1 and "2 (gloo)" in proc.stdout
    (run,) = (tmp_path / "outputs" / "runs").glob("*/*")  # one Hydra run: nothing re-ran argv
    assert sorted(p.name for p in (run / "ranks").glob("rank_*.json")) == [
        "rank_0.json",
        "rank_1.json",
    ]
    result = TrialResult.load(run / "result.json")
    m = result.metrics
    assert result.status is Status.OK and result.config["engine"]["name"] == "lightning"
    assert (m.world_size, m.global_batch, m.micro_batch, m.accumulation_steps) == (2, 32, 8, 2)
    rows = result.ranks
    assert rows[0]["timed_steps"] == rows[1]["timed_steps"] == m.timed_steps  # aligned window
    samples = sum(row["throughput"] * row["timed_seconds"] for row in rows)
    assert m.timed_seconds == max(row["timed_seconds"] for row in rows)
    assert m.throughput == pytest.approx(samples / m.timed_seconds)
    # Each rank drew 8 x 2 samples per optimizer step: the job's throughput counts both.
    assert samples == pytest.approx(m.timed_steps * 32)
    assert "ddp x 2 ranks" in result.numerics["changes"]


def _inspected_rank(spec: Any, device: Any) -> TrialResult:
    """A rank measuring through the Lightning engine, noting what its Trainer was built with."""
    from torch.distributed.tensor import DTensor

    from gpuopt.engines._lifecycle import run_measured
    from gpuopt.engines.registry import load_engine

    seen: dict[str, Any] = {}
    result = run_measured(spec, load_engine("lightning"), device, inspect=seen.__setitem__)
    trainer = seen["trainer"]
    params = list(trainer.lightning_module.model.parameters())
    facts = {
        "strategy": type(trainer.strategy).__name__,
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "sharded": all(isinstance(p, DTensor) for p in params),
        "mesh": [list(p.device_mesh.shape) for p in params if isinstance(p, DTensor)][:1],
        "world": trainer.world_size,
    }
    result.warnings.append(FACTS + json.dumps(facts, sort_keys=True))
    return result


@pytest.mark.slow  # starts real gloo ranks in subprocesses
def test_lightning_fsdp2_shards_the_model_with_model_parallel_strategy_in_the_ranks(compose_cfg):
    from gpuopt.trial.distributed import launch_ranks

    cfg = compose_cfg(
        "distributed=fsdp2", *WORLD_2, "distributed.shard_modules=[Linear]", "guard.enabled=false"
    )
    spec = load_spec(cfg)
    import torch

    result = launch_ranks(spec, torch.device("cpu"), _inspected_rank)
    assert result.status is Status.OK, result.reason
    # Both ranks saw the same (the job's notes keep each distinct note once).
    (note,) = [w for w in result.warnings if w.startswith(FACTS)]
    assert json.loads(note[len(FACTS) :]) == {
        "strategy": "ModelParallelStrategy",
        "environment": "TorchElasticEnvironment",
        "sharded": True,
        "mesh": [[2]],  # the data-parallel dimension: world size 2, no tensor parallelism
        "world": 2,
    }
    assert [row["timed_steps"] for row in result.ranks] == [result.metrics.timed_steps] * 2


# -- the knob mapping -------------------------------------------------------------------------------
def test_the_ddp_knobs_are_distributed_data_parallels_own_arguments(compose_cfg):
    knobs = ["distributed.bucket_cap_mb=1", "distributed.gradient_as_bucket_view=true"]
    knobs += ["distributed.static_graph=true", "distributed.find_unused_parameters=true"]
    spec = load_spec(compose_cfg("distributed=ddp", *WORLD_2, *knobs))
    strategy = lightning_strategy(spec)
    assert type(strategy).__name__ == "DDPStrategy"
    expected = {
        "bucket_cap_mb": 1.0,
        "gradient_as_bucket_view": True,
        "static_graph": True,
        "find_unused_parameters": True,
    }
    assert strategy._ddp_kwargs == ddp_kwargs(spec.distributed) == expected
    assert strategy._timeout.total_seconds() == spec.distributed.timeout_s


def test_fsdp2_is_model_parallel_strategy_on_a_data_parallel_mesh_of_the_world(compose_cfg):
    import torch

    spec = load_spec(compose_cfg("distributed=fsdp2", *WORLD_2))
    strategy = lightning_strategy(spec)
    assert type(strategy).__name__ == "ModelParallelStrategy"  # FSDP2's fully_shard, not FSDP1
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 1)
    devices = trainer_devices(spec, torch.device("cpu"))
    assert (devices["devices"], devices["num_nodes"]) == (2, 1)
    assert [type(p).__name__ for p in devices["plugins"]] == ["TorchElasticEnvironment"]


def test_one_process_keeps_engine_strategy_and_one_device(compose_cfg):
    import torch

    spec = load_spec(compose_cfg("engine=lightning", *TINY_TRIAL))
    assert lightning_strategy(spec) == "auto"
    assert trainer_devices(spec, torch.device("cpu")) == {"accelerator": "cpu", "devices": 1}


# -- what cannot be mapped: one line each -----------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,key,allowed",
    [
        (["distributed=ddp", "engine.strategy=ddp_spawn"], "engine.strategy", "auto with distributed=ddp"),
        (["distributed=fsdp2", "engine.accumulate_grad_batches=4"], "engine.accumulate_grad_batches",
         "1 or 2 (train.global_batch / loader.batch_size x world size)"),
    ],
)  # fmt: skip
def test_what_lightning_cannot_take_with_a_distributed_kind_is_one_config_error(
    compose_cfg, overrides, key, allowed
):
    cfg = compose_cfg(*overrides, *WORLD_2)
    with pytest.raises(ConfigError) as info:
        check_composed(cfg, cpus=2)
    assert info.value.key == key and allowed in info.value.allowed, info.value


def test_lightning_with_ddp_and_fsdp2_passes_the_checks(compose_cfg):
    for kind in ("ddp", "fsdp2"):
        check_composed(compose_cfg(f"distributed={kind}", *WORLD_2), cpus=2)


def test_a_lightning_module_without_configure_model_cannot_be_fsdp2(compose_cfg):
    cfg = compose_cfg(
        "engine=lightning", "distributed=fsdp2", "device=cpu", f"trust=[{HELPERS}.*]", "~data"
    )
    cfg.model = {"_target_": f"{HELPERS}.TinyClassifier"}
    with pytest.raises(ConfigError) as info:
        load_spec(cfg)
    assert info.value.key == "distributed.kind" and "configure_model" in info.value.allowed


@pytest.mark.parametrize(
    "knob,value",
    [("reshard_after_forward", False), ("param_dtype", "bf16"), ("shard_modules", ["Block"])],
)
def test_gpuopts_fsdp2_knobs_cannot_reach_a_lightning_modules_own_sharding(knob, value):
    dist = DistributedConf(kind="fsdp2", nproc_per_node=2, **{knob: value})
    with pytest.raises(ConfigError) as info:
        check_lightning_module_sharding(dist, "mypkg.Module", own_configure_model=True)
    assert info.value.key == f"distributed.{knob}" and "configure_model" in info.value.allowed
    check_lightning_module_sharding(DistributedConf(kind="fsdp2"), "mypkg.Module", True)
    check_lightning_module_sharding(DistributedConf(kind="ddp"), "mypkg.Module", False)
