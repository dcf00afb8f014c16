"""Hugging Face `transformers` model families built from their configurations: random weights,
nothing downloaded (`pip install "gpuopt[hf]"`).

`build(architecture, **config)` is the `_target_` of conf/model/hf_*.yaml: `architecture` names a
transformers model class, the other keys are its config class's fields. The models are called as
`model(**batch)` on a dict batch (SyntheticDataset's `hf_*` kinds) and return outputs with `.loss`.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def build(architecture: str, activation_checkpointing: bool = False, **config: Any) -> nn.Module:
    """A randomly initialized `architecture` from its config class with `config`'s fields."""
    import transformers  # the extra: checked as config, with how to install it (core/checks)

    model_class = getattr(transformers, architecture, None)
    if not isinstance(model_class, type) or not issubclass(model_class, nn.Module):
        raise ValueError(f"model.architecture={architecture!r} is not a transformers model class")
    model = model_class(model_class.config_class(**config))
    if activation_checkpointing:
        # transformers' own activation checkpointing (non-reentrant: works with torch.compile).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
