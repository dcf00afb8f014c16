"""Which configurations hold the baseline's global batch (gpuopt/sweeper/global_batch.py): the rule
from the knob catalogue (gpuopt's own task) or an app's `hydra.sweeper.batch_keys`, and an app of
its own with gradient accumulation swept by a real `-m` run: seeded, confirmed and answered at its
global batch (issue 34, item 4)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from omegaconf import OmegaConf

from gpuopt.core.errors import ConfigError
from gpuopt.study.keys import ATTR_BASELINE, STUDY_BATCH_RULE, STUDY_CONFIRMATION
from gpuopt.study.records import Confirmation
from gpuopt.sweeper import global_batch
from gpuopt.sweeper.global_batch import BatchRule, gpuopt_rule, keeps_training
from gpuopt.sweeper.options import SweeperOptions

MICRO, STEPS = "data.batch_size", "trainer.accumulate_grad_batches"


def test_gpuopts_rule_is_the_knob_catalogues() -> None:
    """The micro-batch and the ranks multiply; train.global_batch, set, is the global batch, which
    the micro-batches must divide (the rest is accumulation)."""
    plain = gpuopt_rule({"loader.batch_size": 32})
    assert plain.keys == ("loader.batch_size", "distributed.nproc_per_node", "train.global_batch")
    assert plain.held == 32 and plain.holds({"loader.batch_size": 32, "loader.num_workers": 2})
    assert not plain.holds({"loader.batch_size": 256})
    accumulating = gpuopt_rule({"loader.batch_size": 32, "train.global_batch": 128})
    assert [accumulating.of({"loader.batch_size": b}) for b in (64, 128, 256)] == [128, 128, None]
    choices = {"loader.batch_size": [32, 64, 128, 256, 512]}
    assert accumulating.combinations(choices) == [
        {"loader.batch_size": 128},  # the largest micro-batch first: the fewest steps
        {"loader.batch_size": 64},
        {"loader.batch_size": 32},
    ]


def test_an_apps_keys_multiply_and_a_learning_rate_change_is_not_the_same_training() -> None:
    rule = BatchRule((MICRO, STEPS), baseline={MICRO: 32, STEPS: 4})
    choices = {MICRO: [32, 64, 128, 256], STEPS: [1, 2, 4]}
    assert rule.held == 128
    assert rule.combinations(choices) == [
        {MICRO: 128, STEPS: 1},
        {MICRO: 64, STEPS: 2},
        {MICRO: 32, STEPS: 4},
    ]
    base = {MICRO: 32, STEPS: 4, "optimizer.lr": 0.001}
    assert keeps_training(rule, {MICRO: 64, STEPS: 2, "data.num_workers": 2}, base)
    assert not keeps_training(rule, {MICRO: 64, STEPS: 4}, base)  # global batch 256
    assert not keeps_training(rule, {MICRO: 64, STEPS: 2, "optimizer.lr": 0.01}, base)
    assert BatchRule.from_attr(rule.to_attr()) == rule


def test_batch_keys_are_read_from_the_config_and_checked_before_anything_runs() -> None:
    config = OmegaConf.create(
        {"data": {"batch_size": 32}, "trainer": {"accumulate_grad_batches": 4}}
    )
    rule = global_batch.for_sweep([MICRO, STEPS], False, config, {}, [MICRO])
    assert rule is not None and rule.baseline == {MICRO: 32, STEPS: 4} and rule.held == 128
    # no keys, not gpuopt's task: no rule (same training is read from what trials report)
    assert global_batch.for_sweep(None, False, config, {}, []) is None
    with pytest.raises(ConfigError, match=r"hydra.sweeper.batch_keys=.*trainer.accumulate"):
        global_batch.for_sweep([MICRO, "trainer.accumulate"], False, config, {}, [])
    assert SweeperOptions.build(batch_keys=[MICRO, STEPS]).batch_keys == (MICRO, STEPS)
    with pytest.raises(ConfigError, match="a list of config keys"):
        SweeperOptions.build(batch_keys=MICRO)


# ---- an app of its own with accumulation, swept for real (a Hydra multirun, its own task) --------

# A task of its own, without torch (fixed speeds by construction): the throughput grows with the
# micro-batch and the loader workers, accumulation only divides the work; it reports its global
# batch and learning rate as MeasureCallback does for a Lightning Trainer.
SCRIPT = """
import hydra


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg):
    micro, steps = cfg.data.batch_size, cfg.trainer.accumulate_grad_batches
    return {
        "status": "ok",
        "throughput": 10.0 * micro + 40.0 * cfg.data.num_workers,
        "global_batch": micro * steps,
        "micro_batch": micro,
        "accumulation_steps": steps,
        "lr": 0.001,
    }


if __name__ == "__main__":
    main()
"""

CONFIG = """
defaults:
  - override hydra/sweeper: gpuopt
  - override hydra/launcher: basic
  - _self_
data:
  batch_size: 32
  num_workers: 0
trainer:
  accumulate_grad_batches: 4
hydra:
  sweeper:
    objectives: [throughput]
    storage: ${gpuopt.sqlite:gpuopt.db}
    study_name: accumulating
    n_trials: 8
    env_timeout_s: 60
    confirm:
      rounds: 2
    params:
      data.batch_size: choice(32, 64, 128, 256)
      trainer.accumulate_grad_batches: choice(1, 2, 4)
      data.num_workers: choice(0, 1, 2)
"""


def _sweep(folder: Path, *args: str) -> str:
    (folder / "conf").mkdir(exist_ok=True)
    (folder / "train.py").write_text(SCRIPT)
    (folder / "conf" / "config.yaml").write_text(CONFIG)
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", *args],
        cwd=folder, env={**os.environ, "HYDRA_FULL_ERROR": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _study(folder: Path) -> optuna.Study:
    storage = f"sqlite:///{folder / 'gpuopt.db'}"
    return optuna.load_study(study_name="accumulating", storage=storage)


@pytest.mark.slow
def test_an_app_with_accumulation_and_batch_keys_gets_a_confirmed_answer_at_its_global_batch(
    tmp_path,
):
    """Micro-batch 32 x 4 steps: the sweep asks 128 x 1 and 64 x 2 (the same global batch 128, in
    fewer, larger steps), confirms the best of them beside the best overall, and answers (a) with
    it, its interval and its change to apply; (b), a larger global batch, says what it changes."""
    out = _sweep(tmp_path, f"hydra.sweeper.batch_keys=[{MICRO},{STEPS}]")
    study = _study(tmp_path)
    assert study.user_attrs[STUDY_BATCH_RULE]["factors"] == [MICRO, STEPS]
    held = {
        (t.params[MICRO], t.params[STEPS])
        for t in study.get_trials()
        if not t.user_attrs.get(ATTR_BASELINE)
    }
    assert {(128, 1), (64, 2)} <= held, held  # seeded at the baseline's global batch
    confirmation = Confirmation.from_attr(study.user_attrs[STUDY_CONFIRMATION])
    same = [c for c in confirmation.configs[1:] if c.same_training]
    assert same and all(c.params[MICRO] * c.params[STEPS] == 128 for c in same)
    winner = study.trials[confirmation.same_training_winner]
    assert winner.user_attrs["global_batch"] == 128 and winner.params[MICRO] == 128
    level = f"{100 * confirmation.comparisons[0].level:.0f}%"  # a user app: fresh processes, 98%
    line = re.search(rf"\(a\) same training: #(\d+) .*: confirmed (\S+)x \[{level} CI", out)
    assert line and int(line.group(1)) == winner.number, out[-3000:]
    assert f"change to apply: {MICRO}=128 {STEPS}=1" in out
    assert "changes the training: global batch 128 -> " in out


@pytest.mark.slow
def test_without_batch_keys_the_sweep_takes_the_searched_ones_named_so_and_says_it(tmp_path):
    out = _sweep(tmp_path, "hydra.sweeper.n_trials=3", "hydra.sweeper.confirm.rounds=0")
    rule = BatchRule.from_attr(_study(tmp_path).user_attrs[STUDY_BATCH_RULE])
    assert rule is not None and rule.factors == (MICRO, STEPS)
    assert f"batch_keys not set: ['{MICRO}', '{STEPS}']" in out
