"""gpuopt installed beside a Hydra app changes nothing in how it runs (gpuopt.hydra_interop): Hydra
1.4's `_partial_` factories pickle as on Hydra 1.3 (Lightning's hparams keep them), and its
execution-whitelist deprecation is one warning per process. The template's own commands run in
tests/test_third_party_apps.py."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import warnings

import lightning.pytorch as pl
import pytest
import torch
from hydra.errors import HydraDeprecationError
from hydra.utils import instantiate
from omegaconf import OmegaConf

import gpuopt.hydra_interop  # noqa: F401  (as Hydra's plugin discovery imports it)

ADAM = {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.01}


def _factory(**whitelist):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return instantiate(OmegaConf.create(ADAM), **whitelist)


def test_a_partial_factory_pickles_and_builds_what_it_did():
    factory = _factory(_execution_whitelist_=["torch.optim.*"])
    again = pickle.loads(pickle.dumps(factory))
    assert type(again) is type(factory) and again.keywords == {"lr": 0.01}
    # The whitelist it was made under travels with it: a call is authorized as before.
    assert again._hydra_execution_whitelist == factory._hydra_execution_whitelist
    weights = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = again(params=weights)
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 0.01


class _Module(pl.LightningModule):
    def __init__(self, optimizer, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.layer = torch.nn.Linear(width, 1)

    def configure_optimizers(self):
        return self.hparams.optimizer(params=self.parameters())


def test_lightning_keeps_a_partial_optimizer_in_its_hparams():
    """lightning-hydra-template's pattern: `save_hyperparameters` drops what does not pickle."""
    module = _Module(_factory())
    assert isinstance(module.configure_optimizers(), torch.optim.Adam)


def test_the_whitelist_deprecation_is_one_warning_per_process(monkeypatch):
    monkeypatch.delenv("HYDRA_DEPRECATION_WARNINGS_AS_ERRORS", raising=False)
    script = textwrap.dedent(
        """
        import warnings
        import gpuopt.hydra_interop
        from hydra.utils import instantiate
        from omegaconf import OmegaConf
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as seen:
            for target in ("collections.Counter", "collections.OrderedDict", "collections.deque"):
                instantiate(OmegaConf.create({"_target_": target}))
        print(len(seen)); print(seen[0].message)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    count, message = out.stdout.split("\n", 1)
    assert count == "1"
    assert "first: collections.Counter" in message and "execution_whitelist=[...]" in message


def test_warnings_as_errors_still_raise_hydras_own(monkeypatch):
    monkeypatch.setenv("HYDRA_DEPRECATION_WARNINGS_AS_ERRORS", "1")
    with pytest.raises(HydraDeprecationError, match="with no\n_execution_whitelist_"):
        instantiate(OmegaConf.create({"_target_": "collections.Counter"}))


def test_hydra_applies_it_in_an_app_that_never_imports_gpuopt(tmp_path):
    """Hydra's plugin discovery loads gpuopt's entry point when any app starts."""
    app = tmp_path / "app.py"
    app.write_text(
        textwrap.dedent(
            """
            import pickle
            import hydra
            from hydra.utils import instantiate

            @hydra.main(version_base="1.3", config_path=None)
            def main(cfg):
                factory = instantiate({"_target_": "collections.Counter", "_partial_": True})
                print("pickled", len(pickle.dumps(factory)) > 0)

            main()
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(app), f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pickled True" in out.stdout
