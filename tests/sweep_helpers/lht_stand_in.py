"""A stand-in for lightning-hydra-template's `src/train.py`, placed in a copy of the template.

The real train.py cannot run here: it imports `rootutils` (not installed) and trains on MNIST,
which it downloads (no network). This task composes the template's REAL configs (the same
`config_path="../configs"`, `train.yaml`) and returns a deterministic stand-in for
`val/acc_best` from the searched values, so the sweep, its outputs and the exported best are
tested in the template's own layout. It also prints the values it ran with as JSON (one line
starting with `STAND_IN `), for the test to compare a reproduced best with the trial.

`configs/hydra/default.yaml` selects `colorlog` logging (the hydra-colorlog plugin, not installed
here): the same names are registered with Hydra's default logging configs instead.
"""

import json
import math
import os

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

_HYDRA_CONF = os.path.join(os.path.dirname(hydra.__file__), "conf", "hydra")
for _group in ("hydra_logging", "job_logging"):
    ConfigStore.instance().store(
        group=f"hydra/{_group}",
        name="colorlog",
        node=OmegaConf.load(os.path.join(_HYDRA_CONF, _group, "default.yaml")),
    )


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> float:
    lr = float(cfg.model.optimizer.lr)
    net = cfg.model.net
    ran = {
        "model.optimizer.lr": lr,
        "data.batch_size": int(cfg.data.batch_size),
        "model.net.lin1_size": int(net.lin1_size),
        "model.net.lin2_size": int(net.lin2_size),
        "model.net.lin3_size": int(net.lin3_size),
        "seed": cfg.seed,
        "tags": list(cfg.tags),
    }
    print("STAND_IN " + json.dumps(ran), flush=True)
    # peaks at lr=0.003, batch 64, the widest layers: a function the sampler can climb
    score = 0.9 - 0.05 * abs(math.log10(lr) - math.log10(0.003))
    score -= 0.0002 * abs(ran["data.batch_size"] - 64)
    score += 0.0001 * (net.lin1_size + net.lin2_size + net.lin3_size) / 3
    return score


if __name__ == "__main__":
    main()
