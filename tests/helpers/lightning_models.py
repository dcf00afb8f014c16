"""User-side Lightning code for the Lightning engine tests: what a gpuopt user would bring.

`TinyClassifier` is a complete LightningModule (its own training_step, configure_optimizers and
train_dataloader); `TinyDataModule` is a DataModule whose constructor takes DataLoader knobs, so
gpuopt's `loader` group can reach it; `NaNAfter` and `OOMAfter` fail after a few steps the way real
training fails (a NaN loss; the allocator's OutOfMemoryError, raised by hand: this machine has no GPU).
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _dataset(size: int, in_features: int, num_classes: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, in_features, generator=generator)
    targets = torch.randint(0, num_classes, (size,), generator=generator)
    return TensorDataset(inputs, targets)


class TinyClassifier(L.LightningModule):
    """A two-layer classifier with everything Lightning needs, data included."""

    def __init__(
        self,
        in_features: int = 16,
        num_classes: int = 4,
        hidden: int = 32,
        lr: float = 1e-2,
        batch_size: int = 8,
        size: int = 256,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )
        self.training_steps_run = 0
        self.dataloaders_built = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        inputs, targets = batch
        self.training_steps_run += 1
        return nn.functional.cross_entropy(self(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        self.dataloaders_built += 1
        hp = self.hparams
        return DataLoader(
            _dataset(hp.size, hp.in_features, hp.num_classes), batch_size=hp.batch_size
        )


class TinyDataModule(L.LightningDataModule):
    """Random vectors; batch_size/num_workers/pin_memory/drop_last come in through the constructor."""

    def __init__(
        self,
        in_features: int = 16,
        num_classes: int = 4,
        size: int = 256,
        batch_size: int = 8,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.num_classes, self.size = in_features, num_classes, size
        self.batch_size, self.num_workers = batch_size, num_workers
        self.pin_memory, self.drop_last = pin_memory, drop_last

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            _dataset(self.size, self.in_features, self.num_classes),
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=self.drop_last,
        )


class NaNAfter(TinyClassifier):
    """Training that diverges: the loss turns NaN from step `after` on."""

    def __init__(self, after: int = 3, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.after = after

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.training_steps_run > self.after else loss


class OOMAfter(TinyClassifier):
    """Training that runs out of device memory at step `after`, with the allocator's own error type."""

    def __init__(self, after: int = 3, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.after = after

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.training_steps_run > self.after:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB (simulated)"
            )
        return loss
