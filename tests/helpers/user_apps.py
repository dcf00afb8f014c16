"""A user's multi-rank training as a Hydra app that gpuopt sweeps, one per kind, as
docs/your-training.md writes them (tiny models, measure=quick): a Lightning script whose Trainer
runs `strategy="ddp"` on `devices=2` (Lightning re-launches the script for rank 1), a
torchrun-style script (its own `dist.init_process_group("gloo")`, DDP, DistributedSampler,
`gpuopt.measure_step`) swept with `hydra.launcher.nproc_per_node=2`, the same loop with nothing of
gpuopt's in its code (`gpuopt.MeasureJob` in its YAML), and the Hugging Face `Trainer` on a small
GPT-2 built from its config, also with `nproc_per_node=2`.

Each script's rank `$FAIL_RANK` fails in its training step ("rank 1 broke on purpose"), in every
trial or, with `$FAIL_BATCH`, only in a trial of that batch size, and each process notes its pid in the trial's run directory (`pids/<pid>`), so a test can tell which
processes a trial had.
"""

from __future__ import annotations

from pathlib import Path

# The torchrun-style scripts' imports and setup: the process group, a DDP model, its data.
_DDP_IMPORTS = """
import hydra
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
"""
_DDP_SETUP = """
    note_pid(cfg)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
    data = TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))
"""

# Every script: the failing rank and the pid note.
_COMMON = """
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

FAIL_RANK = -1


def note_pid(cfg):
    # Arms the failing rank (for this trial's batch size) and notes this process's pid.
    global FAIL_RANK
    batch = cfg.get("batch_size", cfg.get("per_device_train_batch_size"))
    if os.environ.get("FAIL_BATCH") in (None, str(batch)):
        FAIL_RANK = int(os.environ.get("FAIL_RANK", "-1"))
    pids = Path(HydraConfig.get().runtime.output_dir) / "pids"
    pids.mkdir(exist_ok=True)
    (pids / str(os.getpid())).touch()
"""

LIGHTNING = (
    _COMMON
    + """
import hydra
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpuopt


class Net(L.LightningModule):
    def __init__(self, hidden, lr):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 4))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        if self.global_rank == FAIL_RANK:
            raise RuntimeError(f"rank {FAIL_RANK} broke on purpose")
        x, y = batch
        return nn.functional.cross_entropy(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@hydra.main(config_path="conf", config_name="config")
def main(cfg):
    note_pid(cfg)
    data = TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))
    loader = DataLoader(data, batch_size=cfg.batch_size)
    meter = gpuopt.MeasureCallback(measure="quick")
    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp", devices=2, max_epochs=100, callbacks=[meter],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    return meter.fit(trainer, Net(cfg.hidden, cfg.lr), train_dataloaders=loader)


if __name__ == "__main__":
    main()
"""
)

TORCHRUN = (
    _COMMON
    + _DDP_IMPORTS
    + """
import gpuopt


@hydra.main(config_path="conf", config_name="config")
def main(cfg):"""
    + _DDP_SETUP
    + """    loader = DataLoader(data, batch_size=cfg.batch_size, sampler=DistributedSampler(data))

    def step(batch):
        if dist.get_rank() == FAIL_RANK:
            raise RuntimeError(f"rank {FAIL_RANK} broke on purpose")
        x, y = batch
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    result = gpuopt.measure_step(step, loader, model=model, optimizer=opt, measure="quick")
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
"""
)

# A torchrun-style loop with nothing of gpuopt's in its code: gpuopt.MeasureJob in its YAML measures
# each rank (its ranks started by gpuopt: `hydra.launcher.nproc_per_node=2`).
PLAIN_DDP = (
    _COMMON
    + _DDP_IMPORTS
    + """

@hydra.main(config_path="conf", config_name="config")
def main(cfg):"""
    + _DDP_SETUP
    + """    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=cfg.batch_size, sampler=sampler)
    for epoch in range(100):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if dist.get_rank() == FAIL_RANK:
                raise RuntimeError(f"rank {FAIL_RANK} broke on purpose")
            loss = nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""
)

HF = (
    _COMMON
    + """
import hydra
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gpuopt


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 2048

    def __getitem__(self, i):
        if int(os.environ.get("RANK", "0")) == FAIL_RANK:
            raise RuntimeError(f"rank {FAIL_RANK} broke on purpose")
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


@hydra.main(config_path="conf", config_name="config")
def main(cfg):
    note_pid(cfg)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=64, vocab_size=256, n_positions=32)
    args = TrainingArguments(
        output_dir=HydraConfig.get().runtime.output_dir,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_steps=500, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    meter = gpuopt.HFMeasureCallback(measure="quick")
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(),
                      callbacks=[meter])
    return meter.train(trainer)


if __name__ == "__main__":
    main()
"""
)


def _config(keys: str, searched: str, ranks_started_by_gpuopt: bool) -> str:
    """An app's conf/config.yaml: gpuopt's sweeper over `searched` (one key's choice), and where
    gpuopt starts the ranks (torchrun-style, the HF Trainer), fresh_process with 2 per trial;
    Lightning starts its own."""
    launcher = "  - override hydra/launcher: fresh_process\n" if ranks_started_by_gpuopt else ""
    ranks = "  launcher:\n    nproc_per_node: 2\n" if ranks_started_by_gpuopt else ""
    return (
        "\ndefaults:\n  - override hydra/sweeper: gpuopt\n" + launcher + "  - _self_\n"
        + keys
        + "hydra:\n" + ranks
        + "  sweeper:\n    objectives: [throughput]\n    storage: ${gpuopt.sqlite:gpuopt.db}\n"
        + "    study_name: mine\n    n_trials: 20\n    params:\n"
        + f"      {searched}\n"
    )  # fmt: skip


LIGHTNING_CONFIG = _config(
    "batch_size: 32\nhidden: 64\nlr: 0.1\n", "batch_size: choice(32, 64)", False
)
TORCHRUN_CONFIG = _config(
    "batch_size: 32\nhidden: 64\nlr: 0.1\n", "batch_size: choice(32, 64)", True
)
HF_CONFIG = _config(
    "per_device_train_batch_size: 8\ngradient_accumulation_steps: 2\n",
    "per_device_train_batch_size: choice(8, 16)",
    True,
)

MEASURE_JOB = "hydra:\n  callbacks:\n    gpuopt_measure:\n      _target_: gpuopt.MeasureJob\n"
PLAIN_DDP_CONFIG = TORCHRUN_CONFIG.replace("hydra:\n", MEASURE_JOB + "      measure: quick\n", 1)

APPS = {
    "lightning": (LIGHTNING, LIGHTNING_CONFIG),
    "torchrun": (TORCHRUN, TORCHRUN_CONFIG),
    "hf_trainer": (HF, HF_CONFIG),
    "plain_ddp": (PLAIN_DDP, PLAIN_DDP_CONFIG),
}


def write_app(folder: Path, kind: str) -> Path:
    """The app of `kind` (lightning | torchrun | hf_trainer) in `folder`; its script's path."""
    script, config = APPS[kind]
    (folder / "conf").mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(script)
    (folder / "conf" / "config.yaml").write_text(config)
    return folder / "train.py"
