"""Config composition and validation: the real conf/ tree through Hydra's compose, then load_spec()."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import open_dict

from gpuopt.core.checks import (
    check_composed,
    check_device_facts,
    check_writable_path,
    per_cpu_limit,
)
from gpuopt.core.errors import ConfigError
from gpuopt.trial.prepare import load_spec

REPO = Path(__file__).resolve().parents[1]


def test_default_config_validates_and_shapes_follow_the_model(compose_cfg):
    spec = load_spec(compose_cfg("model.input_shape=[64]", "model.num_classes=7"))
    assert spec.model["in_features"] == 64 and spec.model["out_features"] == 7
    assert spec.data["shape"] == [64] and spec.data["num_classes"] == 7
    assert spec.data["kind"] == spec.model["input"] == "vectors"


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("cnn", {"in_channels": 1, "out_features": 5}),
        ("transformer", {"seq_len": 1, "vocab_size": 5}),
    ],
)
def test_each_family_interpolates_its_constructor_arguments(compose_cfg, model, expected):
    shape = "[1,8,8]" if model == "cnn" else "[1]"
    spec = load_spec(
        compose_cfg(f"model={model}", f"model.input_shape={shape}", "model.num_classes=5")
    )
    assert {k: spec.model[k] for k in expected} == expected
    assert spec.data["kind"] == spec.model["input"]


@pytest.mark.parametrize(
    ("overrides", "key", "value", "allowed_part"),
    [
        (["loader.batch_size=0"], "loader.batch_size", 0, ">= 1"),
        (["loader.batch_size=-5"], "loader.batch_size", -5, ">= 1"),
        (["loader.num_workers=-1"], "loader.num_workers", -1, ">= 0"),
        (["precision.mode=fp8"], "precision.mode", "fp8", "bf16"),
        (["compile.mode=turbo"], "compile.mode", "turbo", "max-autotune"),
        (["cache.empty_cache=always"], "cache.empty_cache", "always", "trial_end"),
        (["optimizer.name=lion"], "optimizer.name", "lion", "adamw"),
        (["device.type=tpu"], "device.type", "tpu", "cuda:N"),
        (["measure.stability_target=3"], "measure.stability_target", 3.0, "fraction"),
        (["optimizer.fused=true", "optimizer.foreach=true"], "optimizer.fused", True, "pick one"),
        (["data.kind=tokens"], "data.kind", "tokens", "vectors"),
        (["+model.channels_last=true"], "model.channels_last", True, "images"),
    ],
)
def test_invalid_values_name_key_value_and_what_is_allowed(
    compose_cfg, overrides, key, value, allowed_part
):
    with pytest.raises(ConfigError) as info:
        load_spec(compose_cfg(*overrides))
    error = info.value
    assert (error.key, error.value) == (key, value)
    assert allowed_part in error.allowed
    message = str(error)
    assert "\n" not in message and key in message and repr(value) in message


def test_untrusted_target_is_refused_with_how_to_trust_it(compose_cfg):
    cfg = compose_cfg("model._target_=tests.helpers.user_models.TinyNet")
    with pytest.raises(ConfigError) as info:
        load_spec(cfg)
    assert info.value.key == "model._target_"
    assert "trust=[tests.helpers.user_models.*]" in info.value.allowed


def test_dangerous_target_is_refused(compose_cfg):
    with pytest.raises(ConfigError) as info:
        load_spec(compose_cfg("data._target_=os.system"))
    assert (info.value.key, info.value.value) == ("data._target_", "os.system")


def test_target_that_does_not_import_is_refused(compose_cfg):
    cfg = compose_cfg("model._target_=tests.helpers.no_such_module.Net", "trust=[tests.*]")
    with pytest.raises(ConfigError) as info:
        load_spec(cfg)
    assert info.value.key == "model._target_"
    assert "importable" in info.value.allowed


def test_user_model_with_own_arguments_validates_when_trusted(compose_cfg):
    cfg = compose_cfg("trust=[tests.*]")
    with open_dict(cfg):
        cfg.model = {"_target_": "tests.helpers.user_models.TinyNet", "input": "vectors",
                     "input_shape": [8], "num_classes": 3, "features": 8, "classes": 3}  # fmt: skip
    spec = load_spec(cfg)
    assert spec.model["features"] == 8 and "tests.*" in spec.trusted_targets
    assert spec.data["shape"] == [8]  # the synthetic data still follows the model


# ---- check_composed: the torch-free checks the single run and the sweeper call first -------------


@pytest.mark.parametrize(
    ("overrides", "key", "value", "allowed_part"),
    [
        (["model.depth=-2"], "model.depth", -2, ">= 1"),
        (["model.depth=0"], "model.depth", 0, ">= 1"),
        (["model.width=0"], "model.width", 0, ">= 1"),
        (["model.num_classes=0"], "model.num_classes", 0, ">= 1"),
        (["model.input_shape=[0]"], "model.input_shape", [0], "1 dimension(s) >= 1"),
        (["model.input_shape=[4,4]"], "model.input_shape", [4, 4], "vectors"),
        (["model=cnn", "model.input_shape=[3,32]"], "model.input_shape", [3, 32], "images"),
        (["model=cnn", "model.depth=-1"], "model.depth", -1, ">= 1"),
        (["model=transformer", "model.heads=3"], "model.heads", 3, "divisor of model.width"),
        (["model=transformer", "model.heads=0"], "model.heads", 0, ">= 1"),
        (["model=transformer", "model.width=96", "model.heads=5"], "model.heads", 5, "96"),
        (["+model.widht=3"], "model.widht", 3, "width"),
        (["data.size=0"], "data.size", 0, ">= 1"),
        (["data.size=31"], "data.size", 31, "loader.batch_size (32)"),
        (["data.sample_cost=-0.5"], "data.sample_cost", -0.5, ">= 0"),
        (["+data.bogus=1"], "data.bogus", 1, "sample_cost"),
        (["+foo=1"], "foo", 1, "loader"),
        (["loader.num_workers=1000"], "loader.num_workers", 1000, "per usable CPU core"),
        (["device.num_threads=1000"], "device.num_threads", 1000, "per usable CPU core"),
        (["device.num_threads=0"], "device.num_threads", 0, ">= 1"),
        (["seed=-1"], "seed", -1, ">= 0"),
        (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay", -0.1, ">= 0"),
        (["optimizer.momentum=-1"], "optimizer.momentum", -1.0, ">= 0"),
        (["measure.nvml_interval_s=0"], "measure.nvml_interval_s", 0.0, "> 0"),
        (
            ["cache.cuda_alloc_conf=expandable_segments"],
            "cache.cuda_alloc_conf",
            "expandable_segments",
            "key:value",
        ),
        (["model._target_=os.system"], "model._target_", "os.system", "trust="),
        (["loss=hinge"], "loss", "hinge", "cross_entropy"),
    ],
)
def test_check_composed_names_key_value_and_what_is_allowed(
    compose_cfg, overrides, key, value, allowed_part
):
    with pytest.raises(ConfigError) as info:
        check_composed(compose_cfg(*overrides), cpus=2)
    error = info.value
    assert (error.key, error.value) == (key, value)
    assert allowed_part in error.allowed
    assert "\n" not in str(error)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model=cnn"],
        ["model=transformer", "model.heads=8"],
        ["loader.num_workers=8", "device.num_threads=8"],
        ["data.size=32"],
        ["loader.drop_last=false", "data.size=1"],
        ["cache=expandable"],
        ["model._target_=tests.helpers.no_such_module.Net", "trust=[tests.*]"],  # not imported
    ],
)
def test_check_composed_accepts_valid_configs(compose_cfg, overrides):
    check_composed(compose_cfg(*overrides), cpus=2)


def test_worker_cap_follows_the_cores(compose_cfg):
    cfg = compose_cfg("loader.num_workers=32")
    check_composed(cfg, cpus=8)
    with pytest.raises(ConfigError, match="<= 16"):
        check_composed(cfg, cpus=4)
    assert per_cpu_limit(1) == 8 and per_cpu_limit(16) == 64


def test_check_composed_imports_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from hydra import compose, initialize_config_module\n"
        "from gpuopt.core.checks import check_composed\nfrom gpuopt.core.errors import ConfigError\nfrom gpuopt.core.spec import register_schemas\n"
        "register_schemas()\n"
        "with initialize_config_module('gpuopt.conf'):\n"
        "    check_composed(compose('config'))\n"
        "    try:\n"
        "        check_composed(compose('config', overrides=['model.depth=-2']))\n"
        "    except ConfigError as exc:\n"
        "        assert exc.key == 'model.depth'\n"
        "    else:\n"
        "        raise SystemExit('no ConfigError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---- check_device_facts: device checks against `python -m gpuopt.env --json` facts ---------------

CPU_ONLY = {
    "devices": [{"device": "cpu", "name": "x86", "cores": 2}],
    "accelerator": {"why": "torch 2.13.0+cpu is a CPU-only build", "what_to_do": "..."},
    "cpus": 2,
}
TWO_GPUS = {
    "devices": [
        {"device": "cpu", "name": "x86", "cores": 16},
        {"device": "cuda:0", "name": "H200", "compute_capability": "9.0"},
        {"device": "cuda:1", "name": "H200", "compute_capability": "9.0"},
    ],
    "accelerator": None,
    "cpus": 16,
}
OLD_GPU = {
    "devices": [{"device": "cpu"}, {"device": "cuda:0", "compute_capability": "7.5"}],
    "cpus": 4,
}


@pytest.mark.parametrize(
    ("facts", "overrides", "key", "allowed_part"),
    [
        (CPU_ONLY, ["device.type=cuda"], "device.type", "CPU-only build"),
        (CPU_ONLY, ["device.type=cuda:0"], "device.type", "cpu | auto here"),
        (CPU_ONLY, ["device.type=mps"], "device.type", "MPS is not available"),
        (CPU_ONLY, ["precision=tf32"], "precision.mode", "on cpu"),
        (CPU_ONLY, ["loader.num_workers=9"], "loader.num_workers", "<= 8"),
        (TWO_GPUS, ["device.type=cuda:2"], "device.type", "cuda:0 | cuda:1"),
        (TWO_GPUS, ["device=cpu", "precision=tf32"], "precision.mode", "on cpu"),
        (TWO_GPUS, ["device.num_threads=65"], "device.num_threads", "<= 64"),
        (OLD_GPU, ["precision=tf32"], "precision.mode", "compute capability >= 8.0"),
        (OLD_GPU, ["device=cuda", "precision=tf32"], "precision.mode", "on cuda:0"),
    ],
)
def test_device_facts_reject_what_the_device_cannot_run(
    compose_cfg, facts, overrides, key, allowed_part
):
    with pytest.raises(ConfigError) as info:
        check_device_facts(compose_cfg(*overrides), facts)
    assert info.value.key == key and allowed_part in info.value.allowed


@pytest.mark.parametrize(
    ("facts", "overrides"),
    [
        (CPU_ONLY, []),
        (CPU_ONLY, ["device=cpu", "precision=bf16"]),
        (TWO_GPUS, ["device.type=cuda:1", "precision=tf32"]),
        (TWO_GPUS, ["precision=tf32"]),  # auto resolves to cuda:0
        (TWO_GPUS, ["loader.num_workers=64"]),
        (OLD_GPU, ["device=cuda", "precision=fp16"]),
        ({"devices": [{"device": "cpu"}, {"device": "mps"}]}, ["device.type=mps"]),
    ],
)
def test_device_facts_accept_what_the_device_runs(compose_cfg, facts, overrides):
    check_device_facts(compose_cfg(*overrides), facts)


def test_device_facts_from_gpuopt_env_json_are_accepted_as_they_are(compose_cfg):
    """The sweeper passes `python -m gpuopt.env --json` unchanged: the keys must line up."""
    proc = subprocess.run(
        [sys.executable, "-m", "gpuopt.env", "--json"],
        capture_output=True, text=True, check=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    facts = json.loads(proc.stdout)
    check_device_facts(compose_cfg("device=cpu"), facts)
    if not any(d["device"].startswith("cuda") for d in facts["devices"]):
        with pytest.raises(ConfigError, match=r"device\.type='cuda'"):
            check_device_facts(compose_cfg("device=cuda"), facts)


# ---- check_writable_path: output paths checked before any work, nothing created ---------------


def test_writable_path_checks_create_nothing(tmp_path):
    check_writable_path("--html", tmp_path / "new" / "deeper" / "r.html")
    check_writable_path("hydra.run.dir", tmp_path / "runs" / "x", directory=True)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_writable_path("--html", tmp_path / "file" / "r.html")
    with pytest.raises(ConfigError, match="this is a directory"):
        check_writable_path("--html", tmp_path)
    with pytest.raises(ConfigError, match="this is a file"):
        check_writable_path("hydra.run.dir", tmp_path / "file", directory=True)
    with pytest.raises(ConfigError, match="not writable"):
        check_writable_path("--html", "/proc/gpuopt/r.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
