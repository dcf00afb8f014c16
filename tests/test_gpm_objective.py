"""The utilization objective means work: on a GPU with GPM (a scripted Hopper) the default sweep
optimizes `sm_active`, util.gpu kept beside it; elsewhere `utilization`, and one line says which."""

from __future__ import annotations

import logging

import pytest
import torch

from gpuopt.core import metrics
from gpuopt.sweeper import task
from gpuopt.sweeper.objectives import DEFAULT_OBJECTIVES, on_this_device, utilization_note
from gpuopt.sweeper.options import SweeperOptions
from gpuopt.trial import devices, gpm, monitor
from tests.test_gpm import ScriptedGpm

HOPPER = {"device": "cuda", "compute_capability": "9.0", "gpm": True}
AMPERE_WHY = f"GPM is not supported on this GPU (Hopper and newer have it): {gpm.NULL_NOTE}"
AMPERE = {"device": "cuda", "compute_capability": "8.0", "gpm": False, "gpm_why": AMPERE_WHY}


def test_the_catalogue_says_sm_active_stands_in_for_utilization_where_gpm_is_there():
    assert metrics.metric("sm_active").instead_of == ("utilization", "gpm")
    assert metrics.on_device("utilization", HOPPER) == "sm_active"
    assert metrics.on_device("utilization", AMPERE) == "utilization"
    assert metrics.on_device("utilization", {}) == "utilization"
    assert metrics.on_device("throughput_amortized", HOPPER) == "throughput_amortized"
    assert metrics.goals()["sm_active"] == metrics.goals()["utilization"] == "maximize"


def test_the_default_objectives_on_a_hopper_and_elsewhere():
    assert on_this_device(DEFAULT_OBJECTIVES, HOPPER) == ["throughput_amortized", "sm_active"]
    assert on_this_device(DEFAULT_OBJECTIVES, AMPERE) == list(DEFAULT_OBJECTIVES)
    assert on_this_device(DEFAULT_OBJECTIVES, {"device": "cpu"}) == list(DEFAULT_OBJECTIVES)
    assert on_this_device(DEFAULT_OBJECTIVES, None) == list(DEFAULT_OBJECTIVES)


def test_the_sweep_says_which_utilization_it_optimizes(caplog):
    gpuopt_task = SweeperOptions(gpuopt_task=True)
    with caplog.at_level(logging.INFO, logger="gpuopt.sweeper"):
        names = task.device_objectives(gpuopt_task, list(DEFAULT_OBJECTIVES), HOPPER)
    assert names == ["throughput_amortized", "sm_active"]
    assert caplog.messages == [
        "utilization objective: sm_active (GPM: the share of SMs busy); utilization (NVML "
        "util.gpu: a kernel was running) recorded beside it as evidence"
    ]
    assert utilization_note(list(DEFAULT_OBJECTIVES), AMPERE) == (
        "utilization objective: utilization (NVML util.gpu: a kernel was running), not "
        f"sm_active: {AMPERE_WHY}"
    )
    assert utilization_note(list(DEFAULT_OBJECTIVES), {"device": "cpu"}) is None
    assert utilization_note(["throughput"], HOPPER) is None


def test_objectives_the_user_names_and_another_apps_stay_as_they_are():
    named = SweeperOptions(gpuopt_task=True, objectives=["throughput", "utilization"])
    assert task.device_objectives(named, ["throughput", "utilization"], HOPPER) == [
        "throughput",
        "utilization",
    ]
    other_app = SweeperOptions(gpuopt_task=False)
    assert task.device_objectives(other_app, ["value"], HOPPER) == ["value"]


@pytest.mark.parametrize(
    ("nvml", "has", "why"),
    [(ScriptedGpm(), True, None), (ScriptedGpm(supported=0), False, AMPERE_WHY)],
    ids=["hopper", "ampere"],
)
def test_the_env_probe_says_whether_the_gpu_has_gpm(monkeypatch, nvml, has, why):
    monkeypatch.setattr(monitor, "nvml_handle", lambda nvml, device: "handle-0")
    monkeypatch.setattr(monitor, "import_nvml", lambda: nvml)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(devices, "device_name", lambda device: "NVIDIA H200")
    facts = devices.detect_capabilities(torch.device("cuda", 0))
    assert facts["gpm"] is has and facts.get("gpm_why") == why
    assert on_this_device(DEFAULT_OBJECTIVES, facts)[1] == ("sm_active" if has else "utilization")
    assert nvml.allocated == nvml.freed  # the probe's sample freed


def test_no_nvml_is_no_gpm_never_an_error(monkeypatch):
    def no_nvml():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(monitor, "import_nvml", no_nvml)
    has, why = gpm.device_support(torch.device("cuda", 0))
    assert has is False and why.startswith("NVML unavailable (ImportError")
