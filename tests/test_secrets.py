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
        # the password in the query string, as SQLAlchemy and libpq take it
        (
            "postgresql+psycopg://u@h:5432/db?password=s3cr3t&sslmode=require",
            "postgresql+psycopg://u@h:5432/db?password=***&sslmode=require",
        ),
        (
            "postgresql://u@h/db?sslmode=require&PASSWORD=s%40c%26t",
            "postgresql://u@h/db?sslmode=require&PASSWORD=***",
        ),
        (
            "mysql+pymysql://u@h/db?passwd=x1&charset=utf8",
            "mysql+pymysql://u@h/db?passwd=***&charset=utf8",
        ),
        ("mssql://h/db?UID=u;PWD=x1;Encrypt=yes", "mssql://h/db?UID=u;PWD=***;Encrypt=yes"),
        ("postgresql://u@h/db?sslpassword=x1", "postgresql://u@h/db?sslpassword=***"),
        # both forms at once, and the whole URL percent-encoded inside another one's query
        ("postgresql://u:a@h/db?password=b", "postgresql://u:***@h/db?password=***"),
        (
            "https://p/?to=postgresql%3A%2F%2Fu%3Apw%40h%2Fdb%3Fpassword%3Dx1%26a%3D1",
            "https://p/?to=postgresql%3A%2F%2Fu%3A***%40h%2Fdb%3Fpassword%3D***%26a%3D1",
        ),
        # token names
        (
            "https://h/x?token=t1&access_token=t2&api_key=k1&apikey=k2&api-key=k3&client_secret=c",
            "https://h/x?token=***&access_token=***&api_key=***&apikey=***&api-key=***&client_secret=***",
        ),
        (
            "s3://b/k?X-Amz-Security-Token=t&X-Amz-Signature=s",
            "s3://b/k?X-Amz-Security-Token=***&X-Amz-Signature=***",
        ),
        # a bare `key` only when its value is an opaque token (an API key); paths and names stay
        ("https://h/v1?key=AIzaSyA1b2C3d4E5f6G7h8I9&q=1", "https://h/v1?key=***&q=1"),
        (
            "https://h/v1?key=train&sslkey=/etc/client.key",
            "https://h/v1?key=train&sslkey=/etc/client.key",
        ),
        (
            "postgresql://u@h/db?sslcert=/c.pem&sslkey=/k.pem",
            "postgresql://u@h/db?sslcert=/c.pem&sslkey=/k.pem",
        ),
        # Hydra overrides and error lines, libpq conninfo, SQLAlchemy's error lines
        ("+db.password=hunter2 +db.user=me", "+db.password=*** +db.user=me"),
        (
            "hydra.sweeper.storage='postgresql://u@h/db?password=x1'; allowed: Hydra's override grammar",
            "hydra.sweeper.storage='postgresql://u@h/db?password=***'; allowed: Hydra's override grammar",
        ),
        ("host=h port=5432 password='a b' user=u", "host=h port=5432 password='***' user=u"),
        (
            "(psycopg.OperationalError) invalid dsn: password=x1 host=h",
            "(psycopg.OperationalError) invalid dsn: password=*** host=h",
        ),
        # masked text masked again is unchanged (a line built from masked parts is masked too)
        (
            "cannot connect to postgresql://u@h/db?password=***: refused",
            "cannot connect to postgresql://u@h/db?password=***: refused",
        ),
        ("postgresql://u@h/db?password=p:q: refused", "postgresql://u@h/db?password=*** refused"),
        # words that only look like credential names
        (
            "passage=1 monkey=AIzaSyA1b2C3d4E5f6G7h8I9 max_tokens=5",
            "passage=1 monkey=AIzaSyA1b2C3d4E5f6G7h8I9 max_tokens=5",
        ),
        ("loader.batch_size=64 model=mlp", "loader.batch_size=64 model=mlp"),
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


def test_env_set_secrets_reach_trials_through_the_environment_only(monkeypatch):
    """A secret in hydra.job.env_set (a task needs it): Hydra resolves env_set into every job's
    .hydra/hydra.yaml and result pickle, so it moves to the sweeping process's environment (every
    trial process inherits it) and out of the config Hydra composes jobs from: its override is
    dropped, and a value a config file set is deleted there (`~`)."""
    import os

    from omegaconf import OmegaConf

    from gpuopt.core.secrets import mask_config_secrets

    for name in ("GPUOPT_T_DSN", "GPUOPT_T_API_TOKEN", "PLAIN"):
        monkeypatch.setenv(name, "before")  # restored (unset) after the test
        monkeypatch.delenv(name)
    config = OmegaConf.create(
        {
            "hydra": {
                "job": {
                    "env_set": {
                        "GPUOPT_T_DSN": "postgresql://u:pw@h/db",  # from the command line
                        "GPUOPT_T_API_TOKEN": "abc123",  # from a config file
                        "PLAIN": "1",
                    }
                },
                "overrides": {
                    "hydra": [
                        "+hydra.job.env_set.GPUOPT_T_DSN=postgresql://u:pw@h/db",
                        "hydra.job.env_set.PLAIN=1",
                    ]
                },
            }
        }
    )
    mask_config_secrets(config)
    assert dict(config.hydra.job.env_set) == {"PLAIN": "1"}
    assert os.environ["GPUOPT_T_DSN"] == "postgresql://u:pw@h/db"
    assert os.environ["GPUOPT_T_API_TOKEN"] == "abc123"
    assert "PLAIN" not in os.environ
    assert list(config.hydra.overrides.hydra) == [
        "hydra.job.env_set.PLAIN=1",
        "~hydra.job.env_set.GPUOPT_T_API_TOKEN",
    ]
    assert "pw" not in OmegaConf.to_yaml(config) and "abc123" not in OmegaConf.to_yaml(config)
