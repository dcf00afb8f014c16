"""Building the workload a `TrialSpec` describes: the process-wide policies, then the model, the
data and the optimizer from their configs (Hydra's `instantiate` under the trust whitelist), and
the loss function. Shared by the engines, the numerics guard and the sweeper's probing processes,
so every one of them builds the same thing.

The workload contract (docs/your-training.md): the dataset yields samples of any structure the
default collate stacks; the model is called by the batch's structure (`_loss.model_loss`); the
model config's MODEL_META_KEYS describe it to gpuopt and are not passed to its constructor.
torch is imported inside functions.
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
    """The process-wide settings (threads, float32 matmul precision, cuDNN autotuning)."""
    from gpuopt.trial import policies

    policies.set_num_threads(spec.device.num_threads)
    precision = policies.precision_policy(spec.precision, device)
    cache = policies.CachePolicy(spec.cache, device)
    cache.apply()
    return TrialPolicies(precision, cache)


def instantiate_trusted(config: dict[str, Any], trusted: tuple[str, ...], **kwargs: Any) -> Any:
    """Hydra 1.4's execution whitelist: only trusted `_target_`s (also nested ones) are called."""
    from hydra.utils import instantiate

    return instantiate(config, _execution_whitelist_=list(trusted), _convert_="all", **kwargs)


def instantiate_model(spec: TrialSpec) -> Any:
    """The model config's object, built without gpuopt's descriptive keys."""
    model_kwargs = {k: v for k, v in spec.model.items() if k not in MODEL_META_KEYS}
    return instantiate_trusted(model_kwargs, spec.trusted_targets)


def instantiate_data(spec: TrialSpec, **kwargs: Any) -> Any:
    """The data config's object (a Dataset, or a LightningDataModule), without gpuopt's keys."""
    data = {k: v for k, v in spec.data.items() if k not in DATA_GPUOPT_KEYS}
    return instantiate_trusted(data, spec.trusted_targets, **kwargs)


def build_optimizer(spec: TrialSpec, params: Any) -> torch.optim.Optimizer:
    """The optimizer group's optimizer; its lr scaled by `spec.lr_scale`."""
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
    built from its `_target_`, called as `loss(outputs, targets)`."""
    from hydra.utils import get_object

    if isinstance(spec.loss, str):
        return spec.loss
    # A class is instantiated (its instance is the function); a function is bound, not called.
    is_function = not isinstance(get_object(spec.loss["_target_"]), type)
    built = instantiate_trusted(dict(spec.loss), spec.trusted_targets, _partial_=is_function)
    if not callable(built):
        raise TypeError(f"loss._target_={spec.loss['_target_']} built a non-callable")
    return built
