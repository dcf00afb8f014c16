import pytest

from gpuopt.secrets import mask_secrets


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
