"""Batches of any structure (tuples, dicts, nested containers) and the extended model contract
(`model(**batch)` with an HF-style `loss`, `loss: model`, a user loss by `_target_`), unit by unit
and through the native engine on CPU."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from omegaconf import open_dict
from torch import nn
from torch.utils.data import Dataset

from gpuopt.core.errors import ConfigError
from gpuopt.core.result import Status
from gpuopt.engines._batches import batch_samples, move_batch
from gpuopt.engines._loss import model_loss
from gpuopt.engines.registry import run_trial
from gpuopt.trial.prepare import load_spec
from tests.conftest import TINY_TRIAL

Pair = namedtuple("Pair", ["left", "right"])


# ---- user code reached by _target_ (trusted with trust=[tests.*]) ------------------------------
class DictDataset(Dataset):
    """Hugging Face-style samples: {"features", "mask", "labels"}."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        return {"features": torch.randn(6, generator=g), "mask": torch.ones(6),
                "labels": torch.tensor(index % 3)}  # fmt: skip


class DictModel(nn.Module):
    """Takes the batch's keys as arguments and returns an output dict with its own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.keys_seen: list[str] = []

    def forward(self, features, mask, labels=None):
        self.keys_seen = ["features", "mask", "labels"]
        logits = self.linear(features * mask)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


class TripleDataset(Dataset):
    """(vector, extra, target): two inputs and the target last."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(index)
        return torch.randn(6, generator=g), torch.randn(2, generator=g), torch.tensor(index % 3)


class TwoInputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, vector, extra):
        return self.linear(torch.cat([vector, extra], dim=1))


def doubled_cross_entropy(outputs, targets):
    """A user loss function by _target_ (bound, not called, by Hydra)."""
    return 2 * nn.functional.cross_entropy(outputs, targets)


# ---- helpers, units ------------------------------------------------------------------------------
def test_move_batch_keeps_any_structure_and_moves_every_tensor():
    batch = {"ids": torch.ones(4, 3), "pair": Pair(torch.zeros(4), [torch.ones(4, 1, 2, 2), "s"]),
             "n": 7}  # fmt: skip
    moved = move_batch(batch, torch.device("meta"), channels_last=True)
    assert set(moved) == {"ids", "pair", "n"} and moved["n"] == 7
    assert isinstance(moved["pair"], Pair) and isinstance(moved["pair"].right, list)
    assert moved["ids"].device.type == "meta" and moved["pair"].left.device.type == "meta"
    image = moved["pair"].right[0]
    assert image.device.type == "meta" and image.is_contiguous(memory_format=torch.channels_last)
    assert moved["pair"].right[1] == "s"
    # pin_memory without CUDA is a no-op (PyTorch would refuse to pin): tensors stay as they are
    assert not move_batch(torch.ones(2), torch.device("cpu"), pin_memory=True).is_pinned()


def test_sample_count_from_the_batch_dimension_a_number_or_a_function():
    assert batch_samples({"mask": [torch.ones(5, 2)], "labels": torch.ones(9)}) == 5
    assert batch_samples((torch.ones(3), torch.ones(3)), samples=lambda b: 2 * len(b[0])) == 6
    assert batch_samples(["text"], samples=4) == 4
    with pytest.raises(TypeError, match="samples_per_batch"):
        batch_samples({"text": "no tensor"})


def test_model_contract_by_batch_structure():
    model = DictModel()
    batch = {
        "features": torch.randn(4, 6),
        "mask": torch.ones(4, 6),
        "labels": torch.tensor([0, 1, 2, 0]),
    }
    out = model(**batch)
    assert torch.equal(model_loss(model, batch, "cross_entropy"), out["loss"])  # HF: its own loss
    assert model_loss(model, batch, lambda o, b: o["logits"].sum() * 0 + 5).item() == 5
    two = TwoInputModel()
    triple = (torch.randn(4, 6), torch.randn(4, 2), torch.tensor([0, 1, 2, 0]))
    expected = nn.functional.cross_entropy(two(*triple[:2]), triple[2])
    assert torch.allclose(model_loss(two, triple, "cross_entropy"), expected)
    assert torch.allclose(model_loss(two, triple, doubled_cross_entropy), 2 * expected)
    # loss: model -> the model gets the whole batch, targets included, and returns its loss
    inputs = (batch["features"], batch["mask"], batch["labels"])
    assert torch.equal(model_loss(model, inputs, "model"), out["loss"])
    with pytest.raises(TypeError, match="returned no loss"):
        model_loss(model, {"features": batch["features"], "mask": batch["mask"]}, "cross_entropy")


# ---- through the native engine ---------------------------------------------------------------------
def _run(compose_cfg, model: str, data: str, loss=None):
    cfg = compose_cfg(*TINY_TRIAL, "trust=[tests.*]")
    with open_dict(cfg):
        cfg.model = {"_target_": f"tests.test_batches.{model}"}
        cfg.data = {"_target_": f"tests.test_batches.{data}"}
        if loss is not None:
            cfg.loss = loss
    built = {}
    return run_trial(load_spec(cfg), device=torch.device("cpu"), inspect=built.__setitem__), built


def test_dict_batches_train_an_hf_style_model(compose_cfg):
    result, built = _run(compose_cfg, "DictModel", "DictDataset")
    m = result.metrics
    assert result.status is Status.OK, result.reason
    assert built["model"].keys_seen == ["features", "mask", "labels"]
    assert m.throughput == pytest.approx(m.timed_steps * 8 / m.timed_seconds)
    assert m.flops_per_sample > 0 and m.ceiling_throughput > 0


@pytest.mark.parametrize(
    "loss",
    [None, {"_target_": "torch.nn.CrossEntropyLoss"},
     {"_target_": "tests.test_batches.doubled_cross_entropy"}],
)  # fmt: skip
def test_tuple_batches_of_three_with_builtin_class_and_function_losses(compose_cfg, loss):
    result, _ = _run(compose_cfg, "TwoInputModel", "TripleDataset", loss)
    assert result.status is Status.OK, result.reason
    assert result.metrics.timed_steps >= 2


def test_loss_config_is_checked_before_anything_runs(compose_cfg):
    cfg = compose_cfg(*TINY_TRIAL, "loss=hinge")
    with pytest.raises(ConfigError, match=r"cross_entropy \| mse \| model"):
        load_spec(cfg)
    cfg = compose_cfg(*TINY_TRIAL)
    with open_dict(cfg):
        cfg.loss = {"_target_": "mypkg.losses.focal"}
    with pytest.raises(ConfigError, match=r"loss._target_.*trust=\[mypkg.losses"):
        load_spec(cfg)
