"""A DataModule of learnable synthetic vectors (class-dependent means), so nothing is downloaded;
its DataLoader knobs are constructor arguments, which the hparams_search preset tunes."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class RandomDataModule(L.LightningDataModule):
    def __init__(
        self,
        size: int = 4096,
        input_size: int = 64,
        num_classes: int = 10,
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.train_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        generator = torch.Generator().manual_seed(0)
        centers = torch.randn(hp.num_classes, hp.input_size, generator=generator)
        labels = torch.randint(0, hp.num_classes, (hp.size,), generator=generator)
        inputs = centers[labels] + torch.randn(hp.size, hp.input_size, generator=generator)
        self.train_set = TensorDataset(inputs, labels)

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(
            self.train_set,
            batch_size=hp.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=hp.num_workers,
            pin_memory=hp.pin_memory,
            persistent_workers=hp.persistent_workers and hp.num_workers > 0,
        )
