"""Config composition and validation: the real conf/ tree through Hydra's compose, then validate()."""

from __future__ import annotations

import pytest
from omegaconf import open_dict

from gpuopt.config import ConfigError, validate


def test_default_config_validates_and_shapes_follow_the_model(compose_cfg):
    spec = validate(compose_cfg("model.input_shape=[64]", "model.num_classes=7"))
    assert spec.model["in_features"] == 64 and spec.model["out_features"] == 7
    assert spec.data["shape"] == [64] and spec.data["num_classes"] == 7
    assert spec.data["kind"] == spec.model["input"] == "vectors"


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("cnn", {"in_channels": 1, "out_features": 5}),
        ("transformer", {"seq_len": 1, "vocab_size": 5}),
    ],
)
def test_each_family_interpolates_its_constructor_arguments(compose_cfg, model, expected):
    shape = "[1,8,8]" if model == "cnn" else "[1]"
    spec = validate(
        compose_cfg(f"model={model}", f"model.input_shape={shape}", "model.num_classes=5")
    )
    assert {k: spec.model[k] for k in expected} == expected
    assert spec.data["kind"] == spec.model["input"]


@pytest.mark.parametrize(
    ("overrides", "key", "value", "allowed_part"),
    [
        (["loader.batch_size=0"], "loader.batch_size", 0, ">= 1"),
        (["loader.batch_size=-5"], "loader.batch_size", -5, ">= 1"),
        (["loader.num_workers=-1"], "loader.num_workers", -1, ">= 0"),
        (["precision.mode=fp8"], "precision.mode", "fp8", "bf16"),
        (["compile.mode=turbo"], "compile.mode", "turbo", "max-autotune"),
        (["cache.empty_cache=always"], "cache.empty_cache", "always", "trial_end"),
        (["optimizer.name=lion"], "optimizer.name", "lion", "adamw"),
        (["device.type=tpu"], "device.type", "tpu", "cuda:N"),
        (["measure.stability_target=3"], "measure.stability_target", 3.0, "fraction"),
        (["optimizer.fused=true", "optimizer.foreach=true"], "optimizer.fused", True, "pick one"),
        (["data.kind=tokens"], "data.kind", "tokens", "vectors"),
        (["+model.channels_last=true"], "model.channels_last", True, "images"),
    ],
)
def test_invalid_values_name_key_value_and_what_is_allowed(
    compose_cfg, overrides, key, value, allowed_part
):
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(*overrides))
    error = info.value
    assert (error.key, error.value) == (key, value)
    assert allowed_part in error.allowed
    message = str(error)
    assert "\n" not in message and key in message and repr(value) in message


def test_untrusted_target_is_refused_with_how_to_trust_it(compose_cfg):
    cfg = compose_cfg("model._target_=tests.helpers.user_models.TinyNet")
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert info.value.key == "model._target_"
    assert "trust=[tests.helpers.user_models.*]" in info.value.allowed


def test_dangerous_target_is_refused(compose_cfg):
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg("data._target_=os.system"))
    assert (info.value.key, info.value.value) == ("data._target_", "os.system")


def test_target_that_does_not_import_is_refused(compose_cfg):
    cfg = compose_cfg("model._target_=tests.helpers.no_such_module.Net", "trust=[tests.*]")
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert info.value.key == "model._target_"
    assert "importable" in info.value.allowed


def test_user_model_with_own_arguments_validates_when_trusted(compose_cfg):
    cfg = compose_cfg("trust=[tests.*]")
    with open_dict(cfg):
        cfg.model = {"_target_": "tests.helpers.user_models.TinyNet", "input": "vectors",
                     "input_shape": [8], "num_classes": 3, "features": 8, "classes": 3}  # fmt: skip
    spec = validate(cfg)
    assert spec.model["features"] == 8 and "tests.*" in spec.trusted_targets
    assert spec.data["shape"] == [8]  # the synthetic data still follows the model
