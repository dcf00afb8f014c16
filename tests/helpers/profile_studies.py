"""Profiled trials for the report tests: the CPU loader study of `report_studies` with a profiled
window's summary (`gpuopt.trial.profiled_window.ProfileSummary`, as a dict) on the baseline and the best, set
as the `profile` user attribute the sweeper records from `TrialResult.profile`."""

from __future__ import annotations

from typing import Any

import optuna

from gpuopt.study.keys import ATTR_PROFILE
from gpuopt.trial.trace import PHASES
from tests.helpers.report_studies import CPU_STUDY, build_cpu_study

# Baseline (#0): input-bound; best (#5): the loader hidden by workers, the optimizer now stands out.
BASELINE_PHASES = {"data_wait": 53.0, "h2d_copy": 1.0, "forward": 16.0, "backward": 20.0,
                   "optimizer": 8.0, "other": 2.0}  # fmt: skip
BEST_PHASES = {"data_wait": 3.0, "h2d_copy": 1.0, "forward": 30.0, "backward": 44.0,
               "optimizer": 18.0, "other": 4.0}  # fmt: skip


def profile_summary(phases_pct: dict[str, float], step_s: float, gpu: Any = None) -> dict[str, Any]:
    assert list(phases_pct) == list(PHASES)
    return {
        "steps": 5,
        "step_s": step_s,
        "window_s": 5 * step_s * 1.02,
        "phases_s": {k: v / 100 * step_s for k, v in phases_pct.items()},
        "phases_pct": dict(phases_pct),
        "top_ops": [{"name": "aten::mm", "self_s": 0.3 * step_s, "share": 30.0, "device_s": None}],
        "gpu": gpu,
        "trace_path": "outputs/sweeps/test/trial_0/trace.json.gz",
        "cost_s": 6 * step_s * 1.3,
        "device_type": "cpu",
        "split_by": "gpuopt",
    }


# #1 is the confirmed best when the study carries `report_studies.confirmation_record()`.
PROFILES = {
    0: profile_summary(BASELINE_PHASES, 0.064),
    1: profile_summary(BEST_PHASES, 0.036),
    5: profile_summary(BEST_PHASES, 0.051),
}


def build_profiled_cpu_study(
    storage: optuna.storages.BaseStorage,
    name: str = CPU_STUDY,
    study_attrs: dict[str, Any] | None = None,
) -> None:
    """The CPU study written into `storage`, with PROFILES set on its trials (finished trials
    cannot be updated: the study is built in memory, then copied trial by trial)."""
    memory = optuna.storages.InMemoryStorage()
    build_cpu_study(memory, name, study_attrs=study_attrs)
    source = optuna.load_study(study_name=name, storage=memory)
    target = optuna.create_study(study_name=name, storage=storage, directions=source.directions)
    for key, value in source.user_attrs.items():
        target.set_user_attr(key, value)
    for trial in source.get_trials():
        if trial.number in PROFILES:
            trial.user_attrs = {**trial.user_attrs, ATTR_PROFILE: PROFILES[trial.number]}
        target.add_trial(trial)
