"""lightning-hydra-template's own MNISTDataModule (src/data/mnist_datamodule.py, unchanged) on
synthetic MNIST: the tests copy this file and tests/helpers/torchvision_stand_in.py into a copy of
the template (src/data/stand_in.py, src/data/torchvision_stand_in.py) and run the template with
`data._target_=src.data.stand_in.MNISTDataModule`. Lightning is imported first: its torchmetrics
then takes torchvision for absent, as it is here.
"""

from __future__ import annotations

import lightning  # noqa: F401  (first: torchmetrics decides torchvision is absent)
from src.data.torchvision_stand_in import install

install()

from src.data.mnist_datamodule import MNISTDataModule  # noqa: E402  (the template's own)

__all__ = ["MNISTDataModule"]
