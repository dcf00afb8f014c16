"""Building the workload a `TrialSpec` describes: the process-wide policies, then the model, the
data and the optimizer from their configs (Hydra's `instantiate` under the trust whitelist), and
the loss function.

Workload contract (what a user's own model and dataset must follow):

- The dataset (`data._target_`, a `torch.utils.data.Dataset`) yields samples of any structure the
  DataLoader's default collate stacks: `(inputs, targets)` pairs, longer tuples, dicts (Hugging
  Face style: `input_ids`/`attention_mask`/`labels`, `pixel_values`/`labels`), nested containers.
  Batches move to the device recursively (`gpuopt.engines._batches.move_batch`); a batch's sample
  count is the batch dimension of its first tensor (`batch_samples`).
- The model (`model._target_`, an `nn.Module`) is called by the batch's structure
  (`gpuopt.engines._loss.model_loss`): `model(**batch)` for a dict, `model(*batch[:-1])` for a
  tuple (the last element: the targets). Keys of the model config listed in
  `gpuopt.core.spec.MODEL_META_KEYS` (input, input_shape, num_classes, channels_last) describe the
  model to gpuopt and are not passed to the constructor; every other key is a constructor argument.
- The loss (`loss`) is `cross_entropy(outputs.reshape(-1, C), targets.reshape(-1))` with C the last
  dimension of `outputs` (or of `outputs.logits`; classification or next-token prediction; targets
  are int64 class ids), `mse(outputs, targets)` (targets of the outputs' shape), `model` (the
  model gets the whole batch and returns its loss as `outputs.loss` / `outputs["loss"]`, the
  Hugging Face convention, which a dict batch also follows by default), or the user's function by
  `_target_` (`loss: {_target_: mypkg.losses.focal}`), called as `loss(outputs, targets)`.
- User modules must be trusted: `trust=[mypkg.*]` (Hydra's execution whitelist).

Shared by the engines (native, lightning/), the numerics guard's reference run and the sweeper's
probing processes, so every one of them builds the same thing. torch is imported inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuopt.core.spec import DATA_GPUOPT_KEYS, MODEL_META_KEYS, TrialSpec

if TYPE_CHECKING:
    import torch

    from gpuopt.engines._loss import LossFunction
    from gpuopt.trial.policies import CachePolicy, PrecisionPolicy


@dataclass(frozen=True)
class TrialPolicies:
    precision: PrecisionPolicy
    cache: CachePolicy


def apply_policies(spec: TrialSpec, device: torch.device) -> TrialPolicies:
    """The process-wide settings (threads, float32 matmul precision / TF32, cuDNN autotuning),
    applied before anything is built."""
    from gpuopt.trial import policies

    policies.set_num_threads(spec.device.num_threads)
    precision = policies.precision_policy(spec.precision, device)
    cache = policies.CachePolicy(spec.cache, device)
    cache.apply()
    return TrialPolicies(precision, cache)


def instantiate_trusted(config: dict[str, Any], trusted: tuple[str, ...], **kwargs: Any) -> Any:
    from hydra.utils import instantiate

    # Hydra 1.4's execution whitelist: only trusted `_target_`s (also nested ones) may be called.
    return instantiate(config, _execution_whitelist_=list(trusted), _convert_="all", **kwargs)


def instantiate_model(spec: TrialSpec) -> Any:
    """The model config's object, built without gpuopt's descriptive keys (MODEL_META_KEYS)."""
    model_kwargs = {k: v for k, v in spec.model.items() if k not in MODEL_META_KEYS}
    return instantiate_trusted(model_kwargs, spec.trusted_targets)


def instantiate_data(spec: TrialSpec, **kwargs: Any) -> Any:
    """The data config's object (a Dataset, or under Lightning a LightningDataModule), built
    without gpuopt's own data keys (DATA_GPUOPT_KEYS)."""
    data = {k: v for k, v in spec.data.items() if k not in DATA_GPUOPT_KEYS}
    return instantiate_trusted(data, spec.trusted_targets, **kwargs)


def build_optimizer(spec: TrialSpec, params: Any) -> torch.optim.Optimizer:
    """The optimizer group's optimizer; its lr scaled by `optimizer.lr_scaling` (spec.lr_scale)."""
    import torch

    conf = spec.optimizer
    kwargs: dict[str, Any] = {"lr": conf.lr * spec.lr_scale, "weight_decay": conf.weight_decay}
    if conf.foreach is not None:
        kwargs["foreach"] = conf.foreach
    if conf.fused is not None:
        kwargs["fused"] = conf.fused
    if conf.name == "sgd":
        return torch.optim.SGD(params, momentum=conf.momentum, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def build_loss(spec: TrialSpec) -> str | LossFunction:
    """The `loss` config: a built-in name (cross_entropy | mse | model), or the user's loss function
    built from its `_target_` (a function, or a class such as torch.nn.CrossEntropyLoss, whose
    instance is the function), called as `loss(outputs, targets)`."""
    from hydra.utils import get_object

    if isinstance(spec.loss, str):
        return spec.loss
    # A class is instantiated (its instance is the function); a function is bound, not called.
    is_function = not isinstance(get_object(spec.loss["_target_"]), type)
    built = instantiate_trusted(dict(spec.loss), spec.trusted_targets, _partial_=is_function)
    if not callable(built):
        raise TypeError(f"loss._target_={spec.loss['_target_']} built a non-callable")
    return built
