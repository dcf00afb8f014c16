"""The knob catalogue (gpuopt/core/knobs.py): its records name real keys, its rules print one row
each, its Lightning mapping names real Trainer arguments, and what it says changes the numerics is
what the guard checks (its records' checks are the guard's list)."""

from __future__ import annotations

import dataclasses

import pytest

from gpuopt.core import knobs
from gpuopt.core.spec import GpuoptConf, ModelMetaConf
from gpuopt.trial import numerics
from gpuopt.trial.prepare import load_spec

CPU_2 = {"device": "cpu", "cpus": 2, "bf16_native": False, "fp16_native": False, "tf32": False}


def _schema_keys() -> set[str]:
    keys = {f"model.{f.name}" for f in dataclasses.fields(ModelMetaConf)}
    for group in dataclasses.fields(GpuoptConf):
        if dataclasses.is_dataclass(group.default_factory):  # type: ignore[arg-type]
            keys |= {f"{group.name}.{f.name}" for f in dataclasses.fields(group.default_factory)}  # type: ignore[arg-type]
    return keys


def test_every_record_names_a_key_or_group_of_the_schema() -> None:
    keys = _schema_keys()
    for knob in knobs.KNOBS:
        if knob.key.endswith("."):
            assert any(k.startswith(knob.key) for k in keys), knob.key
        else:
            assert knob.key in keys, knob.key
        assert knob.group is None or knob.key.startswith(knob.group + ".")
    assert len({k.key for k in knobs.KNOBS}) == len(knobs.KNOBS)


def test_a_key_finds_its_own_record_else_its_groups() -> None:
    assert knobs.find("loader.pin_memory") is knobs.PIN_MEMORY
    assert knobs.find("+precision") is knobs.PRECISION  # a group's name: the key its options set
    assert knobs.find("loader.drop_last").key == "loader."
    assert knobs.find("model.width").key == "model." and knobs.find("x") is None


def test_one_rule_one_row_whatever_the_values() -> None:
    rows = knobs.poor_rows(CPU_2)
    threads = [row for row in rows if row["key"] == "device.num_threads"]
    assert threads == [
        {
            "key": "device.num_threads",
            "values": "> 2",
            "why": "only 2 usable CPU core(s): more threads than cores oversubscribe",
        }
    ]
    applying = [r for k in knobs.KNOBS for r in k.poor if r.reason(CPU_2)]
    assert len(rows) == len(applying)
    # the rows judge values: every count above the cores, none at or below
    assert [
        knobs.judge("distributed.nproc_per_node", n, CPU_2) is None for n in (1, 2, 3, 128)
    ] == [
        True,
        True,
        False,
        False,
    ]
    assert knobs.poor_rows({}) == [] and knobs.judge("precision", "bf16", {}) is None


def test_the_env_command_prints_one_row_per_rule(capsys) -> None:
    from gpuopt import env

    assert env.main(["--no-probe"]) == 0
    text = capsys.readouterr().out
    assert text.count("device.num_threads") == 1 and text.count("loader.num_workers") == 1


def test_the_global_batch_and_the_guards_questions_are_answered_from_the_catalogue() -> None:
    assert set(knobs.keys(knobs.GLOBAL_BATCH)) == {
        "loader.batch_size",
        "train.global_batch",
        "distributed.nproc_per_node",
    }
    assert {"precision.mode", "compile.mode", "optimizer.fused"} <= set(knobs.keys(knobs.NUMERICS))
    assert not set(knobs.keys(knobs.NUMERICS)) & {"loader.num_workers", "device.num_threads"}


def test_what_the_catalogue_says_changes_the_numerics_is_what_the_guard_checks(compose_cfg):
    """The guard's math changes are the NUMERICS records' checks (`Knob.numerics`): a record
    flagged NUMERICS without one (or with one and no flag) is refused, and a configuration that
    makes every kind of change has each named once (a change of several keys: once)."""
    with pytest.raises(ValueError, match="x_y"):
        knobs.Knob("x_y", training=(knobs.NUMERICS,))
    with pytest.raises(ValueError, match="x_y"):
        knobs.Knob("x_y", numerics=lambda spec: None)
    assert numerics.math_changes(load_spec(compose_cfg("loader.batch_size=16"))) == []
    every = ["engine=lightning", "engine.precision=bf16-mixed", "precision=bf16", "compile=default"]
    every += ["loader.batch_size=16", "train.global_batch=64", "optimizer.fused=true", "model=cnn"]
    every += ["model.channels_last=true", "distributed=fsdp2", "distributed.param_dtype=bf16"]
    assert numerics.math_changes(load_spec(compose_cfg(*every))) == [
        "accumulation 2 x 16",
        "precision bf16",
        "compile default",
        "optimizer kernels fused=True foreach=None",
        "channels_last",
        "engine.precision bf16-mixed",
        "fsdp2 x 2 ranks (param bf16)",
    ]


def test_shareable_keys_and_groups() -> None:
    assert knobs.shareable("loader") and knobs.shareable("~precision")
    assert not knobs.shareable("optimizer") and not knobs.shareable("seed")
    assert knobs.shareable("measure.time_budget_s") and not knobs.shareable("cache.empty_cache")
