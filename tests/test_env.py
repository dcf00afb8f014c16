"""Devices, fingerprint, capabilities (the sweeper's poor-choice list), device checks, allocator env."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gpuopt import env
from gpuopt.config import ConfigError, validate
from gpuopt.policies import apply_allocator_env

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def test_cpu_capabilities_shape_for_the_sweeper():
    caps = env.detect_capabilities("cpu")
    assert caps["device"] == "cpu"
    poor = caps["poor_choices"]
    json.dumps(caps)  # JSON-friendly
    # Values are override strings; group keys mirror the mode keys.
    assert "tf32" in poor["precision.mode"] and poor["precision"] == poor["precision.mode"]
    assert ("bf16" in poor["precision.mode"]) == (not env.cpu_bf16_native())
    assert (
        set(poor["compile"])
        == {"default", "reduce-overhead", "max-autotune"}
        == set(poor["compile.mode"])
    )
    assert "true" in poor["loader.pin_memory"]
    cores = env.usable_cpus()
    assert poor["device.num_threads"] and all(int(n) > cores for n in poor["device.num_threads"])
    assert str(cores) not in poor["device.num_threads"]
    assert all(isinstance(v, str) for values in poor.values() for v in values.values())


def test_fingerprint_names_machine_and_software():
    fp = env.fingerprint(torch.device("cpu"))
    assert fp["torch"] == torch.__version__ and fp["device"] == "cpu"
    assert fp["cpu_count"] == os.cpu_count() and fp["hostname"] and fp["cpu_model"]
    assert fp["gpuopt"] == __import__("gpuopt").__version__


@no_cuda
def test_env_json_cli_reports_devices_capabilities_and_why_no_accelerator():
    out = subprocess.run(
        [sys.executable, "-m", "gpuopt.env", "--json"], capture_output=True, text=True, check=True
    )
    data = json.loads(out.stdout)
    assert data["device"] == "cpu" and data["devices"][0]["device"] == "cpu"
    assert data["fingerprint"]["torch"] == torch.__version__
    assert "precision.mode" in data["poor_choices"]
    if torch.version.cuda is None:
        assert "CPU-only build" in data["accelerator"]["why"]
        assert "pip install torch" in data["accelerator"]["what_to_do"]


def test_env_human_output(capsys):
    assert env.main([]) == 0
    text = capsys.readouterr().out
    assert "Devices gpuopt sees" in text and "Environment fingerprint" in text


def test_colab_without_gpu_says_how_to_get_one(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without an accelerator")
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab-test")
    assert "Change runtime type" in env.why_no_accelerator()["what_to_do"]


@no_cuda
def test_cuda_requested_without_a_gpu_is_a_config_error(compose_cfg):
    spec = validate(compose_cfg("device=cuda"))
    with pytest.raises(ConfigError) as info:
        env.check_device_support(spec)
    assert (info.value.key, info.value.value) == ("device.type", "cuda")
    assert "cpu" in info.value.allowed


def test_allocator_settings_apply_before_torch_is_imported():
    code = (
        "import os, sys\n"
        "from gpuopt.policies import apply_allocator_env\n"
        "assert 'torch' not in sys.modules\n"
        "assert apply_allocator_env('expandable_segments:True', True) == []\n"
        "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'], os.environ['PYTORCH_ALLOC_CONF'], os.environ['THP_MEM_ALLOC_ENABLE'])\n"
    )
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "THP_MEM_ALLOC_ENABLE")
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean, check=True
    )
    assert out.stdout.split() == ["expandable_segments:True", "expandable_segments:True", "1"]


def test_allocator_settings_after_torch_import_warn_instead_of_silently_failing(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    warnings = apply_allocator_env("expandable_segments:True", True)
    assert len(warnings) == 2 and all("did not apply" in w for w in warnings)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # not pretending it applied
    assert apply_allocator_env(None, False) == []  # nothing asked, nothing to warn about
