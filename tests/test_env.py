"""Devices, fingerprint, capabilities (the sweeper's poor-choice list), device checks, allocator env."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gpuopt import env
from gpuopt.core import knobs
from gpuopt.core.errors import ConfigError
from gpuopt.core.host import usable_cpus
from gpuopt.trial import devices, matmul_peak
from gpuopt.trial.policies import apply_allocator_env
from gpuopt.trial.prepare import load_spec

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def test_cpu_capabilities_shape_for_the_sweeper():
    caps = devices.detect_capabilities("cpu")
    assert caps["device"] == "cpu"
    json.dumps(caps)  # JSON-friendly: the facts the sweeper judges choices by

    def poor(key: str, values: tuple) -> set:
        return {str(v) for v in values if knobs.judge(key, v, caps)}

    modes, compiles = ("fp32", "tf32", "bf16", "fp16"), ("off", "default", "reduce-overhead", "max-autotune")  # fmt: skip
    # Values are override strings; group keys mirror the mode keys.
    assert "tf32" in poor("precision.mode", modes) and poor("precision", modes) == poor("precision.mode", modes)  # fmt: skip
    assert ("bf16" in poor("precision.mode", modes)) == (not devices.cpu_native("bf16"))
    assert (
        poor("compile", compiles)
        == {"default", "reduce-overhead", "max-autotune"}
        == poor("compile.mode", compiles)
    )
    assert "true" in poor("loader.pin_memory", ("true", "false"))
    cores = usable_cpus()
    threads = poor("device.num_threads", range(1, 4 * cores + 1))
    assert threads and all(int(n) > cores for n in threads)
    assert str(cores) not in threads
    assert all(isinstance(row["why"], str) for row in knobs.poor_rows(caps))


def test_fingerprint_names_machine_and_software():
    fp = devices.fingerprint(torch.device("cpu"))
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
    assert "precision.mode" in {row["key"] for row in data["poor_choices"]}  # one row per rule
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
    assert "Change runtime type" in devices.why_no_accelerator()["what_to_do"]


@no_cuda
def test_cuda_requested_without_a_gpu_is_a_config_error(compose_cfg):
    spec = load_spec(compose_cfg("device=cuda"))
    with pytest.raises(ConfigError) as info:
        devices.trial_device(spec)
    assert (info.value.key, info.value.value) == ("device.type", "cuda")
    assert "cpu" in info.value.allowed


def test_allocator_settings_apply_before_torch_is_imported():
    code = (
        "import os, sys\n"
        "from gpuopt.trial.policies import apply_allocator_env\n"
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


# -- the measured peak: probe, cache per hardware fingerprint -------------------------------------
def test_peak_probe_is_short_and_cached_per_fingerprint(tmp_path):
    import time

    cache = tmp_path / "peak_flops.json"
    cpu = torch.device("cpu")
    fp = devices.fingerprint(cpu)
    # Short: the CPU time of this thread, where the probe runs (one compute thread on CPU). Its
    # stop rule reads the wall clock, so other processes on the cores only shorten the CPU time
    # it spends; one that ignored its budget would run its 2048-wide matmuls (seconds).
    started = time.thread_time()
    first = matmul_peak.probed_peak_flops(cpu, "fp32", fp, cache=cache)
    assert time.thread_time() - started < 1.0
    # Per-core rate x usable cores; a plausible CPU (> 0.1 GFLOP/s per core).
    assert first is not None and first > 1e8 * usable_cpus()
    # A probe writes its cache entry: one entry, this machine's fp32 with this torch.
    stored = json.loads(cache.read_text())
    (key,) = stored
    assert json.loads(key)["mode"] == "fp32" and json.loads(key)["torch"] == torch.__version__
    # The second call reads the cache file: no probe (the file as it was), the same number.
    written = cache.stat().st_mtime_ns, cache.read_bytes()
    assert matmul_peak.probed_peak_flops(cpu, "fp32", fp, cache=cache) == first
    assert (cache.stat().st_mtime_ns, cache.read_bytes()) == written
    # Another machine (fingerprint), dtype or torch version misses the cache and probes again.
    matmul_peak.probed_peak_flops(cpu, "fp32", {**fp, "cpu_model": "another CPU"}, cache=cache)
    matmul_peak.probed_peak_flops(cpu, "fp32", {**fp, "torch": "9.9"}, cache=cache)
    matmul_peak.probed_peak_flops(cpu, "fp16", fp, cache=cache)
    assert len(json.loads(cache.read_text())) == 4
    assert matmul_peak.probed_peak_flops(cpu, "int8", fp, cache=cache) is None


def test_probe_restores_threads_and_matmul_precision(tmp_path):
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    matmul_peak.probed_peak_flops(torch.device("cpu"), "bf16", cache=tmp_path / "c.json")
    assert torch.get_num_threads() == threads
    assert torch.get_float32_matmul_precision() == precision


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUOPT_CACHE_DIR", str(tmp_path / "mine"))
    assert matmul_peak.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("GPUOPT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert matmul_peak.cache_dir() == tmp_path / "xdg" / "gpuopt"


@no_cuda
def test_env_cli_shows_the_measured_peak_per_dtype(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "gpuopt.env", "--json", "--device", "cpu"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "GPUOPT_CACHE_DIR": str(tmp_path)},
    )
    data = json.loads(out.stdout)
    peaks = data["peak_flops"]
    assert set(peaks) == {"fp32", "bf16", "fp16"} and all(v > 0 for v in peaks.values())
    assert (tmp_path / "peak_flops.json").exists()
    # a low precision the probe measured no faster than fp32 is a poor choice here, named so; one
    # measured faster is none, unless the CPU lacks it natively (a reason of its own)
    for mode in ("bf16", "fp16"):
        slow = peaks[mode] < knobs.LOW_PRECISION_GAIN * peaks["fp32"]
        poor = knobs.judge("precision", mode, data)
        assert poor == knobs.judge("precision.mode", mode, data)
        if data[f"{mode}_native"]:
            assert (poor is not None and "measured matmul peak" in poor) == slow, (mode, poor)
        else:
            assert poor is not None and "no native" in poor, (mode, poor)


def test_a_low_precision_measured_no_faster_than_fp32_is_a_poor_choice() -> None:
    """AVX512-FP16 without AMX-FP16: native fp16 instructions, fp16 matmul at fp32's speed."""
    peaks = {"fp32": 3.6e11, "bf16": 2.0e12, "fp16": 3.6e11}
    native = {"device": "cpu", "bf16_native": True, "fp16_native": True, "tf32": False}

    def slow(facts: dict) -> dict:
        modes = ("bf16", "fp16")
        return {m: why for m in modes if (why := knobs.judge("precision.mode", m, facts))}

    assert set(slow({**native, "peak_flops": peaks})) == {"fp16"}
    assert "1.00x fp32's" in slow({**native, "peak_flops": peaks})["fp16"]
    data = {**native, "peak_flops": peaks}
    judged = {m for m in ("tf32", "fp16", "bf16") if knobs.judge("precision", m, data)}
    assert judged == {"tf32", "fp16"}
    assert all(knobs.judge("precision.mode", m, data) == knobs.judge("precision", m, data) for m in judged)  # fmt: skip
    # a reason already given (no native fp16 at all) is kept; a GPU's fast fp16 is no poor choice
    kept = {**native, "fp16_native": False, "peak_flops": peaks}
    assert "no native fp16" in knobs.judge("precision", "fp16", kept)
    gpu = {"device": "cuda", "bf16_native": True, "tf32": True}
    assert slow({**gpu, "peak_flops": {"fp32": 6.7e13, "bf16": 9.9e14, "fp16": 9.9e14}}) == {}
    assert slow({**native, "peak_flops": {"fp32": 3.6e11}}) == {}  # nothing measured: nothing said
