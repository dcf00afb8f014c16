"""Same training, faster: global batch and gradient accumulation, learning-rate scaling.

The accumulation proof: micro-batch 64 x 4 accumulated and batch 256 x 1 give the same parameters
after an optimizer step (fp32, float tolerance) in both engines.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpuopt.core.checks import check_composed
from gpuopt.core.errors import ConfigError
from gpuopt.core.result import Status
from gpuopt.engines._build import apply_policies, build_optimizer
from gpuopt.engines.native import build
from gpuopt.engines.registry import run_trial
from gpuopt.trial.context import Trial
from gpuopt.trial.prepare import load_spec
from tests.conftest import TINY_TRIAL

# A small MLP on the learnable synthetic vectors, SGD with momentum (its update is linear in the
# gradient: equal gradients give equal parameters to float rounding).
SMALL = [
    "model.width=32",
    "model.depth=1",
    "model.input_shape=[16]",
    "data.size=512",
    "data.sample_cost=0",
    "optimizer=sgd",
    "optimizer.lr=0.1",
    "device=cpu",
    "device.num_threads=1",
]


def _spec(compose_cfg, *overrides):
    return load_spec(compose_cfg(*SMALL, *overrides))


def _params_after_native_steps(spec, steps=2):
    device = torch.device("cpu")
    trial = Trial(spec, device)
    workload, feed = build(trial, apply_policies(spec, device))
    for _ in range(steps):
        workload.train_step(feed.next_step())
    feed.close()
    return [p.detach().clone() for p in workload.model.parameters()]


def test_accumulated_micro_batches_give_the_full_batch_step_native(compose_cfg):
    full = _spec(compose_cfg, "loader.batch_size=256")
    split = _spec(compose_cfg, "loader.batch_size=64", "train.global_batch=256")
    assert (split.micro_batch, split.accumulation_steps, split.global_batch) == (64, 4, 256)
    assert (full.micro_batch, full.accumulation_steps, full.global_batch) == (256, 1, 256)
    initial = _params_after_native_steps(full, steps=0)
    after_full, after_split = _params_after_native_steps(full), _params_after_native_steps(split)
    assert any(not torch.equal(a, b) for a, b in zip(initial, after_full, strict=True))
    for a, b in zip(after_full, after_split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Not accumulating (64 per optimizer step) is a different training: the test can tell.
    unscaled = _params_after_native_steps(_spec(compose_cfg, "loader.batch_size=64"))
    assert any(
        not torch.allclose(a, b, atol=1e-4) for a, b in zip(after_full, unscaled, strict=True)
    )


class _StopAfterOptimizerSteps:
    """A Lightning callback: stop the fit after `steps` optimizer steps."""

    def __init__(self, steps: int) -> None:
        import lightning.pytorch as pl

        class Stop(pl.Callback):
            def on_train_batch_end(self, trainer, *args):
                if trainer.global_step >= steps:
                    trainer.should_stop = True

        self.callback = Stop()


def _params_after_lightning_steps(spec, tmp_path, steps=2):
    pytest.importorskip("lightning")
    from gpuopt.engines.lightning.engine import build_lightning_workload, make_trainer

    device = torch.device("cpu")
    apply_policies(spec, device)
    module, fit_data = build_lightning_workload(spec, device, [])
    # build_loader shuffles with a seeded generator: the same sample order as the native engine.
    trainer = make_trainer(spec, device, [_StopAfterOptimizerSteps(steps).callback], None, tmp_path)
    trainer.fit(module, **fit_data)
    assert trainer.global_step == steps
    return [p.detach().clone() for p in module.model.parameters()]


def test_accumulated_micro_batches_give_the_full_batch_step_lightning(compose_cfg, tmp_path):
    pytest.importorskip("lightning")
    full = _spec(compose_cfg, "engine=lightning", "loader.batch_size=256")
    split = _spec(compose_cfg, "engine=lightning", "loader.batch_size=64", "train.global_batch=256")
    after_full = _params_after_lightning_steps(full, tmp_path / "full")
    after_split = _params_after_lightning_steps(split, tmp_path / "split")
    for a, b in zip(after_full, after_split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # ... and both engines train the same parameters.
    native = _params_after_native_steps(_spec(compose_cfg, "loader.batch_size=256"))
    for a, b in zip(after_full, native, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("engine", ["native", "lightning"])
def test_results_carry_the_batches_and_a_timed_step_is_an_optimizer_step(compose_cfg, engine):
    if engine == "lightning":
        pytest.importorskip("lightning")
    cfg = compose_cfg(
        *TINY_TRIAL,
        f"engine={engine}",
        "train.global_batch=32",
        "measure.ceiling=false",
        "guard.enabled=false",
    )
    result = run_trial(load_spec(cfg), device=torch.device("cpu"))
    assert result.status is Status.OK, result.reason
    m = result.metrics
    assert (m.global_batch, m.micro_batch, m.accumulation_steps) == (32, 8, 4)
    # samples/s over the window: each timed step is one optimizer step of 32 samples.
    assert m.throughput == pytest.approx(m.timed_steps * 32 / m.timed_seconds)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["loader.batch_size=64", "train.global_batch=250"], "train.global_batch"),
        (["loader.batch_size=64", "train.global_batch=0"], "train.global_batch"),
        (["optimizer.lr_scaling=cubic"], "optimizer.lr_scaling"),
        (["guard.loss_tolerance=0"], "guard.loss_tolerance"),
    ],
)
def test_bad_batch_and_scaling_settings_are_one_line_errors_before_torch(
    compose_cfg, overrides, key
):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as info:
        check_composed(cfg)  # torch-free: the sweeping process runs it
    assert info.value.key == key and "\n" not in str(info.value)
    if key == "train.global_batch":
        assert "multiple of loader.batch_size (64)" in str(info.value)


def test_lightning_accumulation_must_agree_with_the_global_batch(compose_cfg):
    pytest.importorskip("lightning")
    cfg = compose_cfg(
        "engine=lightning",
        "loader.batch_size=8",
        "train.global_batch=32",
        "engine.accumulate_grad_batches=2",
    )
    with pytest.raises(ConfigError, match=r"engine\.accumulate_grad_batches"):
        check_composed(cfg)


@pytest.mark.parametrize(
    ("rule", "reference", "scale"),
    [("none", 32, 1.0), ("linear", 32, 8.0), ("sqrt", 32, 8**0.5), ("linear", None, 1.0)],
)
def test_lr_scaling_scales_the_optimizer_lr(compose_cfg, rule, reference, scale):
    overrides = ["loader.batch_size=64", "train.global_batch=256", f"optimizer.lr_scaling={rule}"]
    if reference is not None:
        overrides.append(f"optimizer.reference_batch={reference}")
    spec = _spec(compose_cfg, *overrides)
    assert spec.lr_scale == pytest.approx(scale)
    optimizer = build_optimizer(spec, torch.nn.Linear(2, 2).parameters())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * scale)


def test_spec_defaults_keep_todays_training(compose_cfg):
    spec = _spec(compose_cfg, "loader.batch_size=32")
    assert (spec.global_batch, spec.accumulation_steps, spec.lr_scale) == (32, 1, 1.0)
    assert dataclasses.asdict(spec.guard)["enabled"] is True


# ---- the two answers: schema rules and an end-to-end sweep --------------------------------------


def test_same_training_preset_holds_the_baseline_batch_and_searches_its_divisors():
    from omegaconf import OmegaConf

    from gpuopt.study.rules import same_training_params

    config = OmegaConf.create(
        {
            "loader": {"batch_size": 16},
            "train": {"global_batch": 64},
            "optimizer": {"lr_scaling": "sqrt", "reference_batch": None},
        }
    )
    preset = {"train.global_batch": "baseline", "loader.batch_size": "divisors", "x": "choice(1,2)"}
    out = same_training_params(preset, config)
    assert out["train.global_batch"] == "64"
    assert out["loader.batch_size"] == "choice(1,2,4,8,16,32,64)"
    assert out["optimizer.reference_batch"] == "64" and out["x"] == "choice(1,2)"
    # the default preset: nothing held; the LR reference still the baseline's batch
    plain = OmegaConf.create({"loader": {"batch_size": 32}, "optimizer": {"lr_scaling": "none"}})
    assert same_training_params({"loader.batch_size": "choice(32,64)"}, plain) == {
        "loader.batch_size": "choice(32,64)"
    }
    # gpuopt's own task: the guard checks every trial's math changes at the baseline's batch,
    # unless the user chose a batch for it
    guarded = OmegaConf.create({"loader": {"batch_size": 32}, "guard": {"global_batch": None}})
    assert same_training_params({}, guarded) == {"guard.global_batch": "32"}
    chosen = OmegaConf.create({"loader": {"batch_size": 32}, "guard": {"global_batch": 8}})
    assert same_training_params({}, chosen) == {}


def _frozen(number, batch, value, numerics=0.0, baseline=False, workers=0):
    import optuna

    choices = optuna.distributions.CategoricalDistribution
    return optuna.trial.create_trial(
        value=value,
        params={"loader.batch_size": batch, "loader.num_workers": workers},
        distributions={
            "loader.batch_size": choices([32, 64, 256]),
            "loader.num_workers": choices([0, 1, 2]),
        },
        user_attrs={
            "baseline": baseline,
            "config": {"loader": {"batch_size": batch}, "optimizer": {"lr": 1e-3}},
        },
        constraints={"oom": 0.0, "diverged": 0.0, "numerics": numerics},
    )


def test_same_training_classification_and_the_change_advice():
    from gpuopt.study.rules import pick_same_training, same_training, training_change
    from gpuopt.sweeper.confirm.schedule import with_same_training_pick

    trials = [
        _frozen(0, 32, 10.0, baseline=True),
        _frozen(1, 256, 80.0),
        _frozen(2, 32, 30.0, numerics=1.0, workers=1),
        _frozen(3, 32, 20.0, workers=2),  # another configuration at the baseline's batch
    ]
    for number, trial in enumerate(trials):
        trial.number = number
    base = trials[0]
    assert [same_training(t, base) for t in trials] == [True, False, False, True]
    assert pick_same_training(trials, base, ["maximize"], None).number == 3
    assert training_change(base, trials[1]) == (
        "global batch 32 -> 256 (x8): scale the learning rate and re-validate; linear rule: "
        "lr x8, square-root rule: x2.83"
    )
    assert training_change(base, trials[3]) is None
    ranked, top_k = with_same_training_pick([trials[1], trials[2], trials[3]], base, 1)
    assert [t.number for t in ranked[:2]] == [1, 3] and top_k == 2


def test_a_math_change_the_guard_did_not_check_is_not_the_same_training(compose_cfg):
    """bf16 at the baseline's batch, the guard unable to run (no map-style dataset to draw its
    fixed batches from): the trial records why, and the rules never call it the same training."""
    from gpuopt.core.result import result_user_attrs
    from gpuopt.engines.registry import run_trial
    from gpuopt.study.rules import same_training, training_change

    spec = _spec(
        compose_cfg,
        "precision=bf16",
        "measure=quick",
        "measure.ceiling=false",
        "data._target_=tests.helpers.numerics_models.SampleStream",
        "trust=[tests.*]",
    )
    result = run_trial(spec)
    assert result.numerics["passed"] is None and "NotGuarded" in result.numerics["not_run"]
    assert result.numerics["changes"] == ["precision bf16"]
    base = _frozen(0, 32, 10.0, baseline=True)
    trial = _frozen(1, 32, 20.0)
    trial.user_attrs.update(result_user_attrs(result))
    trial.user_attrs["config"] = {"loader": {"batch_size": 32}, "optimizer": {"lr": 1e-3}}
    base.number, trial.number = 0, 1
    assert not same_training(trial, base)
    assert training_change(base, trial).startswith("numerics not checked (the guard did not run: ")


def _reported(number, batch, reported, value, baseline=False):
    """A trial of a task of its own (MeasureCallback-style config): its global batch and lr in
    its metrics when `reported`, else nothing says what it trains on."""
    import optuna

    metrics = {"global_batch": batch, "micro_batch": batch, "lr": 1e-3} if reported else {}
    trial = optuna.trial.create_trial(
        value=value,
        params={"data.batch_size": batch, "data.num_workers": 0 if baseline else 1},
        distributions={
            "data.batch_size": optuna.distributions.CategoricalDistribution([64, 256]),
            "data.num_workers": optuna.distributions.CategoricalDistribution([0, 1]),
        },
        user_attrs={
            "baseline": baseline,
            "config": {"engine": {"name": "lightning_callback"}},
            "global_batch": None,
            "lr": None,
            **metrics,
        },
        constraints={"oom": 0.0, "diverged": 0.0, "numerics": 0.0},
    )
    trial.number = number
    return trial


def test_another_compute_dtype_no_guard_checked_is_not_the_same_training():
    """A Trainer's `bf16=true` at the baseline's global batch and lr (a task of its own: no
    numerics guard runs there) trains in another dtype: no evidence it trains the same thing. The
    same dtype is, and so is a dtype change the guard checked and passed."""
    from gpuopt.study.rules import pick_same_training, same_training, training_change

    base, fp32, bf16 = (
        _reported(n, 64, True, v, baseline=n == 0) for n, v in enumerate((10, 12, 20))
    )
    base.user_attrs["compute_dtype"] = fp32.user_attrs["compute_dtype"] = "fp32"
    bf16.user_attrs["compute_dtype"] = "bf16"
    assert same_training(fp32, base) and not same_training(bf16, base)
    assert training_change(base, bf16) == (
        "computes in another dtype (fp32 -> bf16) and no numerics guard checked it (gpuopt's "
        "guard runs in its own app): re-validate the training"
    )
    assert pick_same_training([base, fp32, bf16], base, ["maximize"], None) is fp32
    bf16.user_attrs["numerics"] = {"passed": True, "changes": ["precision bf16"]}
    assert same_training(bf16, base)
    base.user_attrs["compute_dtype"] = None  # an older study: nothing to compare
    bf16.user_attrs.pop("numerics")
    assert same_training(bf16, base)


def test_an_unreported_global_batch_is_unknown_never_the_same_training():
    """Issue 22: null == null is no evidence; the answers say so and name the changed keys."""
    from gpuopt.study.answers import Shown, TwoAnswers, two_answers
    from gpuopt.study.rules import (
        pick_same_training,
        same_training,
        training_change,
        unknown_training,
    )

    base, wide = _reported(0, 64, False, 10.0, baseline=True), _reported(1, 256, False, 30.0)
    assert not same_training(wide, base) and same_training(base, base)
    assert unknown_training(base) == "the task did not report its global batch"
    change = training_change(base, wide)
    assert change == (
        "unknown: the task did not report its global batch; it changes data.batch_size "
        "(64 -> 256), data.num_workers (0 -> 1)"
    )
    same = pick_same_training([base, wide], base, ["maximize"], None)
    said = two_answers(TwoAnswers("the baseline's global batch", Shown(1, "[256]"),
                                  Shown(same.number, "[64]"), 0, None, change,
                                  unknown_training(base)))  # fmt: skip
    assert said[1] == "  (a) same training: unknown: the task did not report its global batch"
    assert said[3] == f"      changes the training: {change}"
    # Reported by the task (measure_step(optimizer=...) / MeasureCallback): the rules apply.
    base, wide = _reported(0, 64, True, 10.0, baseline=True), _reported(1, 256, True, 30.0)
    same_batch = _reported(2, 64, True, 20.0)
    assert [same_training(t, base) for t in (wide, same_batch)] == [False, True]
    assert training_change(base, wide).startswith("global batch 64 -> 256 (x4)")
    assert unknown_training(base) is None


@pytest.mark.slow
def test_sweep_summary_and_report_give_both_answers_and_best_reproduces(tmp_path):
    from tests.test_sweep_e2e import _compose, fake, load, ok, sweep_dir

    proc = ok(
        fake(
            tmp_path,
            "~search",
            "hydra/launcher=basic",
            "hydra/sweeper/sampler=grid",
            "hydra.sweeper.device_aware=false",
            "hydra.sweeper.n_trials=6",
            "loader.batch_size=choice(32,256)",
            "loader.num_workers=choice(0,1,2)",
            "optimizer.lr_scaling=linear",
            "hydra.sweeper.confirm.top_k=1",
            "hydra.sweeper.confirm.rounds=2",
            "hydra.sweeper.confirm.max_share=1.0",
        )
    )
    out = proc.stdout
    assert "two answers (same training = global batch 32" in out
    assert "(a) same training: #" in out and "[loader.batch_size=32 loader.num_workers=2]" in out
    assert "(b) best overall: #" in out and "global batch 32 -> 256 (x8)" in out
    assert out.count("confirmed ") >= 2  # each answer with its own confirmation
    folder = sweep_dir(tmp_path)
    study = load(tmp_path, optuna_study_name(tmp_path))
    configs = study.user_attrs["confirmation"]["configs"]
    assert [c["same_training"] for c in configs] == [True, False, True]

    # the exported configs reproduce global batch, accumulation and LR scaling
    from omegaconf import OmegaConf

    from gpuopt.trial.prepare import load_spec

    for name, batch in (("best", 256), ("best_same_training", 32)):
        composed = _compose([f"+experiment={name}", f"hydra.searchpath=[file://{folder}]"])
        spec = load_spec(OmegaConf.create(composed))
        assert (spec.global_batch, spec.accumulation_steps) == (batch, 1)
        assert spec.optimizer.lr_scaling == "linear" and spec.optimizer.reference_batch == 32
        assert spec.lr_scale == pytest.approx(batch / 32)

    from gpuopt.report.cli import main as report_main

    assert "Two answers" in _report_text(report_main, tmp_path, study.study_name)


def optuna_study_name(tmp_path):
    import optuna

    (summary,) = optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'gpuopt.db'}")
    return summary.study_name


def _report_text(report_main, tmp_path, name):
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            report_main(["--study", name, "--storage", f"sqlite:///{tmp_path / 'gpuopt.db'}"])
        except SystemExit as exc:
            assert not exc.code
    return buffer.getvalue()


# ---- both answers confirmed and said first, each with its change to apply (issue 34) -------------


def _trial(number, params, value, baseline=False, state=None, race=None, drift=0.0):
    """A stored trial of gpuopt's own task: its params, overrides, resolved batch and lr."""
    import optuna

    batch = params["loader.batch_size"]
    attrs = {
        "baseline": baseline,
        "overrides": [f"{k}={v}" for k, v in params.items()],
        "config": {"loader": {"batch_size": batch}, "optimizer": {"lr": 1e-3}},
        **({"race": race} if race else {}),
    }
    dist = optuna.distributions.CategoricalDistribution
    trial = optuna.trial.create_trial(
        state=state or optuna.trial.TrialState.COMPLETE,
        value=None if state else value,
        params=params,
        distributions={"loader.batch_size": dist([32, 256]), "loader.num_workers": dist([0, 1, 2])},
        user_attrs=attrs,
        constraints={"oom": 0.0, "diverged": 0.0, "numerics": drift},
    )
    trial.number = number
    return trial


def _confirmed(trials, again):
    """The confirmation record of `trials` (the baseline first), re-measured as `again` says:
    built by the sweeper's own code (gpuopt/sweeper/confirm/)."""
    from gpuopt.study.records import Confirmation
    from gpuopt.sweeper.confirm.schedule import confirmed_configs
    from gpuopt.sweeper.confirm.verdicts import compare

    configs = confirmed_configs(trials)
    for config, values in zip(configs, again, strict=True):
        config.confirm_values = list(values)
    record = {"configs": [vars(c) for c in configs], **compare(configs, "maximize")}
    return Confirmation.from_attr(record)


def _answers(trials, confirmation):
    from gpuopt.study.rules import pick_best, pick_same_training, training_change
    from gpuopt.sweeper.summary import answers_lines

    pool = [t for t in trials if t.values]
    base = trials[0]
    best = pick_best(pool, [], ["maximize"], confirmation)
    same = pick_same_training(pool, base, ["maximize"], confirmation)
    change = training_change(base, best)
    return answers_lines(["throughput"], base, best, same, change, confirmation, 32, trials)


def test_the_summary_gives_both_confirmed_answers_each_with_its_change_to_apply():
    """Issue 34's cnn sweep: (a), batch 32 with 2 workers, confirmed faster beside (b), batch
    256; each with its interval and what to apply, (b) with what it changes in the training."""
    trials = [
        _trial(0, {"loader.batch_size": 32, "loader.num_workers": 0}, 100.0, baseline=True),
        _trial(1, {"loader.batch_size": 256, "loader.num_workers": 1}, 212.0),
        _trial(2, {"loader.batch_size": 32, "loader.num_workers": 2}, 123.0),
    ]
    confirmation = _confirmed(trials, [[100, 101, 99, 100], [210, 212, 208, 211],
                                       [121, 124, 120, 123]])  # fmt: skip
    lines = _answers(trials, confirmation)
    assert lines[1].startswith("  (a) same training: #2 throughput=123")
    assert lines[1].endswith(": confirmed 1.220x [95% CI 1.204-1.237, +-1.4%, 4 pairs]")
    assert lines[2] == "      change to apply: loader.num_workers=2"
    assert lines[3].startswith("  (b) best overall: #1 ") and "confirmed 2.1" in lines[3]
    assert lines[4] == "      change to apply: loader.batch_size=256 loader.num_workers=1"
    assert lines[5].startswith("      changes the training: global batch 32 -> 256 (x8)")


def test_keep_your_configuration_says_what_the_search_saw_of_the_same_training():
    import optuna

    base = _trial(0, {"loader.batch_size": 32, "loader.num_workers": 0}, 100.0, baseline=True)
    best = _trial(1, {"loader.batch_size": 256, "loader.num_workers": 1}, 212.0)
    # screened below the race's floor at the baseline's batch, pruned
    race = {"ratio": 0.77, "floor": 0.9, "same_training": True}
    pruned = _trial(2, {"loader.batch_size": 32, "loader.num_workers": 1}, None,
                    state=optuna.trial.TrialState.PRUNED, race=race)  # fmt: skip
    confirmation = _confirmed([base, best], [[100, 101, 99, 100], [210, 212, 208, 211]])
    lines = _answers([base, best, pruned], confirmation)
    assert lines[1] == (
        "  (a) same training: no same-training configuration is measurably faster: keep your "
        "configuration"
    )
    assert lines[2] == (
        "      (no same-training candidate screened at the race's floor of 0.9x or faster: the "
        "closest, #2, 0.77x)"
    )
    # re-measured and no faster: the confirmation's own verdict is the evidence
    same = _trial(3, {"loader.batch_size": 32, "loader.num_workers": 2}, 104.0)
    trials = [base, best, same]
    again = _confirmed(trials, [[100, 101, 99, 100], [210, 212, 208, 211], [99, 102, 100, 101]])
    lines = _answers(trials, again)
    assert "keep your configuration" in lines[1] and "same-training #3 re-measured 1.0" in lines[2]
    # nothing at the baseline's global batch at all
    assert "(no trial held global batch 32)" in _answers([base, best], None)[2]
    # the same-training finalist's bf16 drifted: the guard said no
    bf16 = _trial(4, {"loader.batch_size": 32, "loader.num_workers": 2}, 150.0, drift=1.0,
                  race={"ratio": 1.4, "floor": 0.9, "same_training": True})  # fmt: skip
    assert _answers([base, best, bf16], confirmation)[2] == (
        "      (#4 held the global batch: numerics drift from the fp32 reference over the "
        "tolerance: not the same training)"
    )


def test_the_confirmation_keeps_both_answers_in_fewer_rounds_where_the_cap_is_tight():
    """An app's 8-trial sweep in fresh processes (cap 8 runs): 4 rounds of the baseline and two
    candidates do not fit, so the plan used to drop the second, the same-training one; now both
    stay, in 2 rounds (Stein's second stage has the rest)."""
    from gpuopt.sweeper.confirm.schedule import answers_among, plan

    base = _trial(0, {"loader.batch_size": 32, "loader.num_workers": 0}, 100.0, baseline=True)
    best = _trial(1, {"loader.batch_size": 256, "loader.num_workers": 1}, 212.0)
    same = _trial(2, {"loader.batch_size": 32, "loader.num_workers": 2}, 123.0)
    assert answers_among([best, same], base) == 2 and answers_among([best], base) == 1
    assert plan(2, 4, 1.0, 8, 2, keep=2).top_k == 2 and plan(2, 4, 1.0, 8, 2, keep=2).rounds == 2
    assert plan(2, 4, 1.0, 8, 2).top_k == 1  # nothing to keep: the weakest goes, as before
    assert plan(2, 4, 1.0, 5, 2, keep=2).top_k == 1  # not even 2 rounds of both: the best stays


def test_a_same_training_finalist_below_the_floor_after_the_screen_is_the_evidence_for_keep():
    """The race kept #1 (batch 32, bf16) as its same-training finalist; its read over the
    baseline after the screen found it below the race's floor, so it was pruned without a whole
    trial: answer (a) is the baseline, and the evidence says why with the floor it missed."""
    from optuna.trial import TrialState

    from gpuopt.study.answers import same_training_evidence

    base, finalist = _frozen(0, 32, 10.0, baseline=True), _frozen(1, 32, 8.0)
    base.number, finalist.number = 0, 1
    finalist.state, finalist.values = TrialState.PRUNED, None
    paired = {"windows": 20, "throughput": {"ratio": 0.85, "ci": [0.83, 0.87], "pairs": 20}}
    finalist.user_attrs.update(
        race={"same_training": True, "floor": 0.9, "ratio": 1.02, "paired": paired}
    )
    evidence = same_training_evidence([base, finalist], base, None, "global batch 32")
    assert evidence == "same-training #1 read below 0.9x the baseline after the screen"
