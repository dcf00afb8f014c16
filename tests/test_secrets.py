import pytest

from gpuopt.core.secrets import mask_secrets


@pytest.mark.parametrize(
    "text, expected",
    [
        ("postgresql://gpu:s3cr%40t@db:5432/optuna", "postgresql://gpu:***@db:5432/optuna"),
        ("postgresql+psycopg://u:p@127.0.0.1/x", "postgresql+psycopg://u:***@127.0.0.1/x"),
        ("storage: mysql://root:hunter2@h/db failed", "storage: mysql://root:***@h/db failed"),
        ("sqlite:////abs/outputs/gpuopt.db", "sqlite:////abs/outputs/gpuopt.db"),
        ("postgresql://user@host/db", "postgresql://user@host/db"),  # no password: unchanged
        ("outputs/journal.log", "outputs/journal.log"),
    ],
)
def test_mask_secrets_hides_only_passwords(text, expected):
    assert mask_secrets(text) == expected


def test_config_secrets_are_masked_in_place_and_interpolations_kept(monkeypatch):
    """The sweep's hydra node is copied into every trial's .hydra/*.yaml: its literal storage URLs
    are masked; an interpolation (${oc.env:...}) is kept as written, never resolved into a secret."""
    from omegaconf import OmegaConf

    from gpuopt.core.secrets import mask_config_secrets

    monkeypatch.setenv("GPUOPT_TEST_STORAGE", "postgresql://u:envpass@h/db")
    config = OmegaConf.create(
        {
            "hydra": {
                "sweeper": {
                    "storage": "postgresql://u:pw@h/db",
                    "from_env": "${oc.env:GPUOPT_TEST_STORAGE}",
                    "missing": "???",
                },
                "overrides": {"task": ["a=1", "hydra.sweeper.storage=mysql://r:hunter2@h/x"]},
            },
            "model": {"url": "postgresql://u:pw@h/db"},  # not the hydra node: left alone
        }
    )
    OmegaConf.set_readonly(config, True)
    mask_config_secrets(config)
    hydra_node = config.hydra
    assert hydra_node.sweeper.storage == "postgresql://u:***@h/db"
    assert OmegaConf.to_container(hydra_node.sweeper)["from_env"] == "${oc.env:GPUOPT_TEST_STORAGE}"
    assert OmegaConf.is_missing(hydra_node.sweeper, "missing")
    assert list(hydra_node.overrides.task) == ["a=1", "hydra.sweeper.storage=mysql://r:***@h/x"]
    assert config.model.url == "postgresql://u:pw@h/db"
    assert OmegaConf.is_readonly(config)
