"""Probe configs for the shared process of an interleaved confirmation or a race, and the live
members of its process group (tests/test_interleave.py, tests/test_race.py)."""

from __future__ import annotations

from pathlib import Path

from gpuopt.sweeper.shared_process import write_config

# A tiny CPU trial: each arm's overrides are added to these.
TINY = [
    "device=cpu",
    "model.width=16",
    "model.depth=1",
    "model.input_shape=[12]",
    "measure.warmup_steps=2",
    "data.sample_cost=0.1",
]


def probe_configs(tmp_path: Path, arms: dict[str, list[str]]) -> dict[str, Path]:
    """Each arm's composed config (TINY + its overrides, with its hydra node) written as the probe
    config file the shared process reads; label -> path."""
    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401 - registers the schemas

    paths = {}
    for label, overrides in arms.items():
        with initialize_config_module(config_module="gpuopt.conf"):
            cfg = compose("config", overrides=[*TINY, *overrides], return_hydra_config=True)
        paths[label] = write_config(cfg, tmp_path, f"{label}.yaml")
    return paths


def group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (the shared process and its DataLoader workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids
