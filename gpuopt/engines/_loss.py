"""How a batch meets the model: the forward call by the batch's structure and the loss it gives,
the Hugging Face conventions included: one module so that every engine reads a model's outputs the
same way. torch is imported inside functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def outputs_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned, the Hugging Face way: `outputs.loss` or `outputs["loss"]`."""
    import torch

    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def step_loss(returned: Any) -> torch.Tensor | None:
    """The loss a training step returned: a tensor, or outputs carrying one (`outputs_loss`)."""
    import torch

    return returned if isinstance(returned, torch.Tensor) else outputs_loss(returned)


def outputs_logits(outputs: Any) -> Any:
    """The tensor a loss compares with targets: the outputs, or their `logits` (HF)."""
    import torch

    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
    return logits if logits is not None else getattr(outputs, "logits", outputs)


LossFunction = Callable[[Any, Any], "torch.Tensor"]


def model_loss(forward: Callable[..., Any], batch: Any, loss: str | LossFunction) -> torch.Tensor:
    """One forward pass and its loss: `model(**batch)` for a dict (HF style; the outputs' own
    loss unless `loss` is a function), `model(*batch)` under `loss: model`, `model(*batch[:-1])`
    with targets `batch[-1]` for a tuple, `model(batch)` (its own loss) for a single tensor."""
    if isinstance(batch, Mapping):
        outputs, targets = forward(**batch), batch
    elif isinstance(batch, (tuple, list)) and loss == "model":
        outputs, targets = forward(*batch), None
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        outputs, targets = forward(*batch[:-1]), batch[-1]
    else:
        outputs, targets = forward(batch), None
    if callable(loss):
        return loss(outputs, targets)
    own = outputs_loss(outputs)
    if own is not None and (targets is None or targets is batch or loss == "model"):
        return own
    if targets is None or targets is batch:
        raise TypeError(
            f"the model returned no loss for a {type(batch).__name__} batch: return one as "
            "outputs.loss / outputs['loss'] (the Hugging Face convention), or set loss._target_ "
            "to a function loss(outputs, targets)"
        )
    import torch.nn.functional as F

    logits = outputs_logits(outputs)  # the built-in loss: mse, or cross_entropy over the last dim
    if loss == "mse":
        return F.mse_loss(logits, targets.to(logits.dtype))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
