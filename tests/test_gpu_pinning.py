"""Which GPUs parallel trials get (issue 17 item 9), without a GPU: the assignment tables with
`gpus_per_node`, the sharing warning, UUID pinning when CUDA_VISIBLE_DEVICES is unset (NVML's
indices are PCI order, CUDA's default order is fastest first), and the launcher's plan."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from gpuopt.sweeper.launchers import gpus
from gpuopt.sweeper.launchers.fresh_process import FreshProcessLauncher

FOUR = ["0", "1", "2", "3"]


@pytest.mark.parametrize(
    ("visible", "n_jobs", "per_job", "expected"),
    [
        (FOUR, 2, 2, ["0,1", "2,3"]),  # disjoint, not 0,1 for both
        (FOUR, 2, 1, ["0", "1"]),  # two GPUs left over, unused
        (FOUR, 1, 2, ["0,1"]),
        (["4", "7", "9"], 3, 1, ["4", "7", "9"]),  # this process's ids, not 0..k-1
        (FOUR, 3, 2, ["0,1", "2,3", "0,1"]),  # too few: wraps round (shared, warned)
        (["0", "1"], 2, 3, ["0,1", "0,1"]),  # more per job than visible: all of them
        (FOUR, 2, 0, ["", ""]),  # gpus_per_node=0: no GPU, as submitit
        ([], 2, 1, ["", ""]),
    ],
)
def test_gpus_per_node_gives_parallel_jobs_disjoint_gpus(visible, n_jobs, per_job, expected):
    assert [gpus.assign(visible, n_jobs, k, per_job) for k in range(n_jobs)] == expected


@pytest.mark.parametrize(
    ("count", "n_jobs", "per_job", "shared"),
    [
        (4, 2, 2, False),
        (4, 3, 2, True),
        (2, 1, 3, True),  # asks for more than there are
        (4, 4, None, False),
        (2, 3, None, True),
        (0, 3, None, False),  # nothing to pin: nothing to warn about
    ],
)
def test_sharing_is_warned(count, n_jobs, per_job, shared):
    warning = gpus.sharing_warning(count, n_jobs, per_job)
    assert (warning is not None) == shared
    if shared:
        assert f"{count} GPU(s)" in warning


class FakeNvml:
    """NVML's device list in PCI bus order: index -> UUID."""

    def __init__(self, uuids):
        self.uuids, self.shut = uuids, False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, handle):
        return self.uuids[handle].encode()  # older pynvml returns bytes


def test_unset_visible_devices_pins_by_nvml_uuid_and_set_ones_are_kept():
    nvml = FakeNvml(["GPU-aaa", "GPU-bbb"])
    assert gpus.nvml_uuids(nvml) == ["GPU-aaa", "GPU-bbb"] and nvml.shut
    assert gpus.pinnable_gpus({}, lambda: ["GPU-aaa", "GPU-bbb"]) == ["GPU-aaa", "GPU-bbb"]
    assert gpus.pinnable_gpus({}, lambda: []) is None  # no driver: nothing to pin
    # The user's ids mean what they mean to the user's CUDA_DEVICE_ORDER: handed out unchanged.
    assert gpus.pinnable_gpus({"CUDA_VISIBLE_DEVICES": "3,1"}, lambda: ["GPU-x"]) == ["3", "1"]

    class Broken(FakeNvml):
        def nvmlInit(self):
            raise OSError("NVML Shared Library Not Found")

    assert gpus.nvml_uuids(Broken([])) == []


def _launcher(**params):
    return FreshProcessLauncher(timeout_s=60, **params)


@pytest.fixture
def machine(monkeypatch):
    """Four GPUs seen through NVML, CUDA_VISIBLE_DEVICES unset."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    uuids = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]
    monkeypatch.setattr(gpus, "nvml_uuids", lambda nvml=None: list(uuids))
    return SimpleNamespace(uuids=uuids)


def test_launcher_plan_with_gpus_per_node_is_disjoint(machine, caplog):
    with caplog.at_level(logging.WARNING):
        assert _launcher(gpus_per_node=2)._device_plan(2) == ["GPU-0,GPU-1", "GPU-2,GPU-3"]
        assert _launcher(gpus_per_node=1)._device_plan(1) == ["GPU-0"]
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert _launcher(gpus_per_node=2)._device_plan(3)[2] == "GPU-0,GPU-1"
    assert "share GPUs" in caplog.text


def test_launcher_plan_without_gpus_per_node(machine, monkeypatch, caplog):
    assert _launcher()._device_plan(2) == ["GPU-0,GPU-1", "GPU-2,GPU-3"]
    assert _launcher()._device_plan(1) == [None]  # one job: this process's setting (unset)
    assert _launcher(pin_gpus=False)._device_plan(2) == [None, None]
    assert _launcher(pin_gpus=False, gpus_per_node=1)._device_plan(2) == ["<submitit>"] * 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    with caplog.at_level(logging.WARNING):
        assert _launcher()._device_plan(3) == ["5", "7", "5"]
    assert "3 parallel trials on 2 GPU(s)" in caplog.text


def test_launcher_plan_without_any_gpu_leaves_submitit_its_rule(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpus, "nvml_uuids", lambda nvml=None: [])
    assert _launcher(gpus_per_node=1)._device_plan(2) == ["<submitit>"] * 2
    assert _launcher()._device_plan(2) == [None, None]
