"""A configuration a known library bug would crash is refused with the bug named, before it runs
(gpuopt.trial.library_bugs); a process torch aborts anyway says so in the trial's reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gpuopt.core.shared_protocol import Drop, Failure
from gpuopt.sweeper.launchers.results import fatal_error
from gpuopt.sweeper.shared_process import SharedProcess
from gpuopt.trial import library_bugs

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("conv", "crashes"),
    [
        (nn.Conv2d(4, 8, 1, stride=2), True),  # the CNN's width-4 shortcut
        (nn.Conv2d(2, 8, 1, stride=3), True),
        (nn.Conv2d(8, 16, 1, stride=2), False),  # a whole AVX2 channel block
        (nn.Conv2d(1, 8, 1, stride=2), False),
        (nn.Conv2d(4, 8, 1, stride=1), False),
        (nn.Conv2d(4, 8, 3, stride=2), False),
        (nn.Conv2d(16, 16, 1, stride=2, groups=4), True),  # 4 input channels per group
    ],
)
def test_the_convolutions_the_avx2_kernel_crashes_on(conv, crashes):
    model = nn.Sequential(nn.Conv2d(3, conv.in_channels, 3, padding=1), conv)
    assert bool(library_bugs.crashing_convolutions(model)) is crashes
    conv.weight.requires_grad_(False)  # a frozen weight has no backward by weights
    assert not library_bugs.crashing_convolutions(model)


@pytest.mark.parametrize(
    ("device", "precision", "below_avx512", "refused"),
    [
        ("cpu", "fp32", True, True),
        ("cpu", "bf16", True, False),  # autocast runs the convolution in another kernel
        ("cpu", "fp32", False, False),  # AVX-512's kernel (brgconv)
        ("meta", "fp32", True, False),
    ],
)
def test_channels_last_is_refused_only_where_the_bug_is(
    monkeypatch, device, precision, below_avx512, refused
):
    monkeypatch.setattr(library_bugs, "onednn_below_avx512", lambda: below_avx512)
    model = nn.Conv2d(4, 8, 1, stride=2)
    if refused:
        with pytest.raises(library_bugs.KnownLibraryBug, match=r"model.channels_last=true .*4->8"):
            library_bugs.check_channels_last(model, torch.device(device), precision)
    else:
        library_bugs.check_channels_last(model, torch.device(device), precision)


@pytest.mark.parametrize(("cap", "below"), [("AVX2", True), ("avx2_vnni", True), ("SSE41", True)])
def test_a_capped_onednn_counts_as_a_cpu_without_avx512(monkeypatch, cap, below):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert library_bugs.onednn_below_avx512() is below
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    capability = torch.backends.cpu.get_cpu_capability()
    assert library_bugs.onednn_below_avx512() is (not capability.startswith("AVX512"))


@pytest.mark.slow
def test_a_trial_that_would_crash_torch_ends_with_the_bug_named(tmp_path):
    """The product, as run: oneDNN capped at AVX2 (as on a CPU without AVX-512), a CNN whose
    1x1 shortcuts take 4 channels, channels_last. Unguarded, torch aborted in 6 of 6 such runs."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "GPUOPT_OUTPUT_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "gpuopt.run", "device=cpu", "measure=quick", "model=cnn",
         "model.width=4", "model.depth=1", "model.input_shape=[3,8,8]", "model.channels_last=true",
         f"hydra.run.dir={tmp_path / 'run'}"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "error"
    assert "KnownLibraryBug" in result["reason"] and "oneDNN" in result["reason"]


def test_a_shared_process_torch_aborts_says_so_in_its_reason(tmp_path):
    log = tmp_path / "interleave.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", "import faulthandler, os; faulthandler.enable(); os.abort()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    shared = SharedProcess(process, "throughput", log)
    answer = shared.command(Drop("candidate1"), 30)
    assert isinstance(answer, Failure)
    assert "killed by signal SIGABRT" in answer.reason
    assert "Fatal Python error: Aborted" in answer.reason
    assert fatal_error(Path(log)) in answer.reason
