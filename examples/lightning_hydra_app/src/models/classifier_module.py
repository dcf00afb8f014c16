"""A LightningModule: the training step, loss and optimizer around a network."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch import nn


class ClassifierModule(L.LightningModule):
    def __init__(self, net: nn.Module, optimizer: Callable[..., torch.optim.Optimizer]) -> None:
        super().__init__()
        self.net = net
        self.make_optimizer = optimizer  # a partial (`_partial_: true`): called with the parameters
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        inputs, targets = batch
        loss = self.criterion(self(inputs), targets)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer(params=self.parameters())
