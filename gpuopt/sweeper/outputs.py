"""What a finished sweep leaves in its sweep dir (optimization_results.yaml, experiment/best.yaml,
experiment/best_same_training.yaml, summary.txt), and prints.

A worker whose study's result is made in another worker (`Pending`) writes the best known so far
with `pending: <worker>` and no best.yaml: a script reading the stock file never sees an empty
result. A pending file never replaces a final one of the same study."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import optuna
from omegaconf import OmegaConf

from gpuopt.core.limits import highest_limit
from gpuopt.core.metrics import goals
from gpuopt.study.experiment import (
    is_measurement_key,
    overrides_to_experiment,
    write_experiment,
)
from gpuopt.study.keys import (
    ATTR_BASELINE_SKIPPED,
    ATTR_OVERRIDES,
    STUDY_HARDWARE,
    STUDY_OBJECTIVES,
)
from gpuopt.study.noise import noise_view
from gpuopt.study.records import Confirmation
from gpuopt.study.rules import (
    global_batch_of,
    pick_baseline,
    pick_same_training,
    plain_names,
    status_counts,
    training_change,
)
from gpuopt.sweeper import global_batch
from gpuopt.sweeper.confirm.schedule import Pending
from gpuopt.sweeper.global_batch import DECLARE_HINT
from gpuopt.sweeper.objectives import utilization_note
from gpuopt.sweeper.open_study import EXPERIMENT_GROUP, SweepIdentity
from gpuopt.sweeper.profile_runs import best_of
from gpuopt.sweeper.race import policy as race_policy
from gpuopt.sweeper.space import parser
from gpuopt.sweeper.summary import (
    answers_lines,
    interference_note,
    render,
    repeats_lines,
    values_text,
)

log = logging.getLogger("gpuopt.sweeper")

INFEASIBLE_NOTE = (
    "infeasible trials (oom/diverged) are kept in the study with constraints > 0: samplers avoid "
    "that region"
)


def _utilization_note(study: optuna.Study, sweep: SweepIdentity) -> str | None:
    """Which utilization a sweep on an NVIDIA GPU optimized: util.gpu, or GPM's SM activity
    (the study's env probe says whether the GPU has GPM)."""
    if not sweep.metrics_named:
        return None
    hardware = study.user_attrs.get(STUDY_HARDWARE) or {}
    env = hardware.get("env") if isinstance(hardware, dict) else None
    return utilization_note(sweep.names, env if isinstance(env, dict) else None)


def write_outputs(
    study: optuna.Study,
    sweep: SweepIdentity,
    confirmation: Confirmation | None,
    elapsed_s: float,
    best_pending: Pending | None = None,
) -> str:
    """Write the files; returns the summary text (the caller prints it). `best_pending`: another
    worker confirms or still runs trials, so the best so far is written marked pending."""
    sweep.sweep_dir.mkdir(parents=True, exist_ok=True)
    all_trials = study.get_trials(deepcopy=False)
    labels = study.user_attrs.get(STUDY_OBJECTIVES)
    if plain_names(labels) and len(labels) == len(sweep.names) and not plain_names(sweep.names):
        # gpuopt's task returned plain values (study.relabel_plain_objectives)
        sweep = dataclasses.replace(sweep, names=list(labels), metrics_named=False)
    pool, pareto, best = best_of(study, all_trials, sweep.directions, confirmation)
    baseline = pick_baseline(all_trials)
    baseline = baseline if baseline in pool else None  # the summary shows a measured baseline
    counts = status_counts(all_trials)
    measured = any(name in goals() for name in sweep.names)  # gpuopt's metrics: noisy timings
    noisy = bool(pool) and sweep.metrics_named and measured  # an app's own values are exact

    write_stock_outputs(sweep, best, pareto, best_pending.worker if best_pending else None)
    # pending: gpuopt's answers, best.yaml and best_same_training.yaml come from the confirming worker
    so_far, best = best, None if best_pending else best
    best_yaml = write_best_config(sweep, best) if best is not None else None
    same = pick_same_training(pool, baseline, sweep.directions, confirmation) if best else None
    answers = answers_lines(
        sweep.names,
        baseline,
        best,
        same,
        training_change(baseline, best),
        confirmation,
        global_batch_of(baseline) if baseline is not None else None,
        all_trials,
        # no batch keys declared: how (else (a) is read from what each trial reports, afterwards)
        DECLARE_HINT
        if measured and baseline is not None and global_batch.read(study.user_attrs) is None
        else None,
    )
    if same is not None and baseline is not None and same.number != baseline.number:
        same_yaml = write_best_config(sweep, same, "best_same_training")
        answers.append(f"same-training config: {same_yaml}")
        answers.append(f"  reproduce: {sweep.reproduce_experiment('best_same_training')}")
    notes = [
        INFEASIBLE_NOTE if counts.get("oom") or counts.get("diverged") else None,
        _utilization_note(study, sweep),
        *repeats_lines(all_trials),
        interference_note(all_trials),
        race_policy.no_contender_note(all_trials),
    ]
    skipped = [s for t in all_trials if (s := t.user_attrs.get(ATTR_BASELINE_SKIPPED))]
    text = render(
        study_name=sweep.study_name,
        storage=sweep.storage if sweep.persisted else None,
        sweep_dir=str(sweep.sweep_dir),
        names=sweep.names,
        directions=sweep.directions,
        counts=counts,
        baseline=baseline,
        best=best,
        pareto=pareto,
        confirmation=confirmation,
        best_yaml=best_yaml,
        elapsed_s=elapsed_s,
        notes=[note for note in notes if note],
        reproduce=sweep.reproduce_experiment("best"),
        baseline_skipped=skipped[-1] if skipped and baseline is None else None,
        speedups=sweep.metrics_named,
        best_pending=_pending_text(best_pending, so_far, sweep.names),
        answers=answers,
        highest_limit=highest_limit((t.number, t.user_attrs) for t in pool),
        noise=noise_view(pool, sweep.names, sweep.directions) if noisy else None,
    )
    (sweep.sweep_dir / "summary.txt").write_text(text + "\n")
    return text


def _pending_text(pending: Pending | None, so_far: Any | None, names: list[str]) -> str | None:
    if pending is None:
        return None
    if so_far is None:
        return pending.text
    return f"{pending.text}; best so far #{so_far.number}: {values_text(names, so_far.values)}"


def write_stock_outputs(
    sweep: SweepIdentity, best: Any | None, pareto: list[Any], pending: str | None
) -> None:
    """hydra-optuna-sweeper's outputs: optimization_results.yaml in its shape plus gpuopt's keys
    (`pending`: the worker(s) the final result comes from), and its closing log lines, word for
    word (scripts parse them)."""
    path = sweep.sweep_dir / "optimization_results.yaml"
    single = len(sweep.directions) < 2
    ranked = [best] if single and best is not None else pareto
    if single:
        results = {"name": "optuna", "best_params": dict(ranked[0].params) if ranked else {}}
        results["best_value"] = ranked[0].value if ranked else None
    else:
        solutions = [{"params": dict(t.params), "values": list(t.values)} for t in ranked]
        results = {"name": "optuna", "solutions": solutions}
    results.update(
        study_name=sweep.study_name,
        storage=sweep.storage,
        objectives=sweep.names,
        directions=sweep.directions,
        best_trial=best.number if best is not None else None,
    )
    if pending:
        results["pending"] = pending
    # two workers sharing this sweep dir: the confirming one's final result stays
    if not (pending and _final_result_of(path, sweep.study_name)):
        OmegaConf.save(OmegaConf.create(json.loads(json.dumps(results, default=str))), path)
    if single:
        if best is not None:
            log.info(f"Best parameters: {best.params}")
            log.info(f"Best value: {best.value}")
        return
    log.info(f"Number of Pareto solutions: {len(pareto)}")
    for t in pareto:
        log.info(f"    Values: {t.values}, Params: {t.params}")


def _final_result_of(path: Path, study_name: str) -> bool:
    """Whether `path` holds a final (not pending) result of this study."""
    try:
        results = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # none, or unreadable: not a final result
        return False
    return (
        isinstance(results, dict)
        and results.get("study_name") == study_name
        and not results.get("pending")
    )


def training_notes(trial: Any) -> list[str]:
    """What the trial's training is: global batch, accumulation, LR scaling (best.yaml's header)."""
    config = trial.user_attrs.get("config") or {}
    optimizer = config.get("optimizer") or {}
    attrs = trial.user_attrs
    notes = []
    if attrs.get("global_batch"):
        notes.append(
            f"Training: global batch {attrs['global_batch']} = micro-batch "
            f"{attrs.get('micro_batch')} x {attrs.get('accumulation_steps')} accumulation step(s)"
        )
    rule = optimizer.get("lr_scaling")
    if rule and rule != "none":
        notes.append(
            f"LR scaling: {rule} relative to batch {optimizer.get('reference_batch')}: "
            f"lr {optimizer.get('lr')} x{attrs.get('lr_scale') or 1.0:.3g}"
        )
    return notes


def write_best_config(sweep: SweepIdentity, best: Any, name: str = "best") -> str:
    """experiment/<name>.yaml; returns its path."""
    overrides, base = _experiment_overrides(best.user_attrs.get(ATTR_OVERRIDES) or [], sweep)
    body, skipped = overrides_to_experiment(overrides, sweep.groups)
    if base is not None:  # best.yaml is itself an `experiment`: it extends the one the sweep ran
        body["defaults"] = [f"/{EXPERIMENT_GROUP}/{base}", *(body.get("defaults") or ["_self_"])]
        body = {"defaults": body.pop("defaults"), **body}
    values = ", ".join(f"{n}={v:.4g}" for n, v in zip(sweep.names, best.values, strict=False))
    header = [
        f"Best configuration of study {sweep.study_name} (trial #{best.number}): {values}",
        f"Reproduce: {sweep.reproduce_experiment(name)}",
        *training_notes(best),
    ]
    if skipped:
        header.append(f"Not expressible here (apply by hand): {' '.join(skipped)}")
    return str(write_experiment(sweep.sweep_dir / EXPERIMENT_GROUP / f"{name}.yaml", body, header))


def _experiment_overrides(overrides: list[str], sweep: SweepIdentity) -> tuple[list[str], Any]:
    """The trial's overrides best.yaml can hold, and the `experiment` option the sweep ran with.
    Left out: sweep-configuring groups and measurement settings. `experiment=X` becomes the first
    default `/experiment/X`: best.yaml is selected as `experiment=best`, so it cannot override it."""
    kept, base = [], None
    for line in overrides:
        override = parser().parse_override(line)
        key = override.key_or_group
        if key in sweep.sweep_groups or is_measurement_key(key):
            continue
        if key == EXPERIMENT_GROUP and EXPERIMENT_GROUP in sweep.groups:
            base = override.value()
            continue
        kept.append(line)
    return kept, base
