"""Hugging Face `transformers` model families built from their configurations: random weights,
nothing downloaded (`pip install "gpuopt[hf]"`).

`build(architecture, **config)` is the `_target_` of conf/model/hf_*.yaml: `architecture` names a
transformers model class (GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM,
ViTForImageClassification, ResNetForImageClassification, or any other), the other keys are its
config class's fields (`GPT2Config(n_layer=12, ...)`). The models follow the Hugging Face
convention gpuopt's model contract accepts: called as `model(**batch)` on a dict batch
(`input_ids`/`attention_mask`/`labels` or `pixel_values`/`labels`, see
gpuopt.workload.data.SyntheticDataset's `hf_*` kinds), they return outputs with `.loss`.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from torch import nn

INSTALL_HINT = 'pip install "gpuopt[hf]"'


def transformers_installed() -> bool:
    """Whether the extra is installed, without importing it (an import takes seconds)."""
    return importlib.util.find_spec("transformers") is not None


def _transformers() -> Any:
    if not transformers_installed():
        raise ModuleNotFoundError(
            f"Hugging Face models need transformers: {INSTALL_HINT}", name="transformers"
        )
    return importlib.import_module("transformers")


def build(architecture: str, activation_checkpointing: bool = False, **config: Any) -> nn.Module:
    """A randomly initialized `architecture` from its config class with `config`'s fields."""
    transformers = _transformers()
    model_class = getattr(transformers, architecture, None)
    if not isinstance(model_class, type) or not issubclass(model_class, nn.Module):
        raise ValueError(f"model.architecture={architecture!r} is not a transformers model class")
    model = model_class(model_class.config_class(**config))
    if activation_checkpointing:
        # transformers' own activation checkpointing (non-reentrant: works with torch.compile).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
