"""Train a model the lightning-hydra-template way, measured by gpuopt.

`python src/train.py` fits and prints the measurement; `python src/train.py -m
hparams_search=throughput` lets gpuopt's sweeper search the loader and trainer knobs for
throughput. The task returns gpuopt's TrialResult: the sweeper turns it into named objectives,
every metric as a user attribute, OOM/NaN as infeasible trials, a baseline and a confirmation.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The project root on sys.path, so that configs reach `src.*` (lightning-hydra-template: rootutils).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf

import gpuopt

# What the configs may instantiate (Hydra's execution whitelist): this project, Lightning, torch.optim.
TRUSTED = ["src.*", "lightning.pytorch.*", "torch.optim.*", "functools.partial"]


def instantiate(node: DictConfig, **kwargs: Any) -> Any:
    return hydra.utils.instantiate(node, _execution_whitelist_=TRUSTED, **kwargs)


def train(cfg: DictConfig) -> gpuopt.TrialResult:
    """Instantiate data, model and trainer from the config; fit under gpuopt's measurement."""
    L.seed_everything(cfg.seed, workers=True)
    datamodule: L.LightningDataModule = instantiate(cfg.data)
    model: L.LightningModule = instantiate(cfg.model)
    meter = gpuopt.MeasureCallback(measure=OmegaConf.to_container(cfg.measure))
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=[meter])
    return meter.fit(trainer, model, datamodule=datamodule)


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> gpuopt.TrialResult | dict[str, Any]:
    result = train(cfg)
    m = result.metrics
    print(
        f"status={result.status.value} throughput={m.throughput} samples/s data_wait={m.data_wait}%"
    )
    if cfg.returns == "metrics":  # a dict of named metrics works too: gpuopt's names + your own
        return {"status": result.status.value, "reason": result.reason,
                "throughput": m.throughput, "data_wait": m.data_wait, "my_batch_size": cfg.data.batch_size}  # fmt: skip
    return result


if __name__ == "__main__":
    main()
