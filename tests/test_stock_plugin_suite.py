"""hydra-optuna-sweeper's own test suite, run on gpuopt's sweeper.

The stock plugin's `tests/test_optuna_sweeper_plugin.py`, its test configs and its example apps
(tests/third_party/, verbatim at their commit) are assembled into a plugin root in tmp_path, as
the stock repository lays them out (`chdir_plugin_root` looks for setup.py), then changed the way a
user migrates: `python -m gpuopt.migrate` on the folder (every `override hydra/sweeper: optuna`)
and the test's own `hydra/sweeper=optuna` override changed to `gpuopt`. Those are the only edits
(tests/third_party/README.md). The suite then runs with pytest in a subprocess, from the plugin
root: its module-level `chdir_plugin_root()` changes the working directory of the process that
imports it, and its apps run under `python -Werror` (a deprecation warning fails them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

THIRD_PARTY = Path(__file__).parent / "third_party"
SUITE = THIRD_PARTY / "hydra_optuna_sweeper_tests"
TEST_FILE = "tests/test_optuna_sweeper_plugin.py"
# The tests that run a sweeper (and its discovery). The others test the stock plugin's own parsing
# functions, which gpuopt imports as they are: not run here (at this commit, 5 of them fail against
# the installed hydra-optuna-sweeper 1.4.0rc3 with or without gpuopt).
SWEEPS = [
    "test_discovery",
    "test_launch_jobs",
    "test_optuna_example[True]",
    "test_optuna_example[False]",
    "test_example_with_grid_sampler[10]",
    "test_example_with_grid_sampler[1]",
    "test_optuna_multi_objective_example[True]",
    "test_optuna_multi_objective_example[False]",
    "test_optuna_custom_search_space_example",
    "test_failure_rate[0.5]",
    "test_failure_rate[1.0]",
    "test_example_with_removed_motpe",
]


def plugin_root(tmp_path: Path) -> Path:
    """The stock plugin's layout (setup.py, example/, tests/), migrated to gpuopt."""
    root = tmp_path / "hydra_optuna_sweeper"
    shutil.copytree(SUITE, root)
    shutil.copytree(THIRD_PARTY / "hydra_optuna_example", root / "example")
    migrate = subprocess.run(
        [sys.executable, "-m", "gpuopt.migrate", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert migrate.returncode == 0, migrate.stderr
    test = root / TEST_FILE
    text = test.read_text()
    assert text.count('"hydra/sweeper=optuna"') == 1
    test.write_text(text.replace('"hydra/sweeper=optuna"', '"hydra/sweeper=gpuopt"'))
    for conf in [*root.glob("example/*/config.yaml"), *root.glob("tests/conf/*.yaml")]:
        assert "hydra/sweeper: gpuopt" in conf.read_text(), conf  # migrated
    return root


def test_the_stock_plugins_own_suite_passes_on_gpuopt(tmp_path):
    root = plugin_root(tmp_path)
    env = {
        k: v for k, v in os.environ.items() if k not in ("GPUOPT_OUTPUT_DIR", "HYDRA_FULL_ERROR")
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rA",
            "-q",
            *(f"{TEST_FILE}::{name}" for name in SWEEPS),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    out = proc.stdout + proc.stderr
    passed = set(re.findall(r"^PASSED \S+::(\S+)", out, re.MULTILINE))
    assert passed == set(SWEEPS), out[-6000:]
    assert proc.returncode == 0, out[-6000:]
