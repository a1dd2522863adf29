"""Finding the transformers causal LM inside whatever wraps it (PEFT), shared by every patch module."""

from __future__ import annotations

from torch import nn


def hf_model(model) -> nn.Module:
    """The transformers causal LM inside ``model`` (itself, or the base of a PEFT wrapper)."""
    from transformers import PreTrainedModel

    inner = model
    for _ in range(4):  # PeftModel -> LoraModel (a BaseTuner) -> the transformers model
        if isinstance(inner, PreTrainedModel):
            return inner
        if "get_base_model" in dir(type(inner)):
            inner = inner.get_base_model()
        elif isinstance(getattr(inner, "model", None), PreTrainedModel):
            inner = inner.model
        else:
            break
    raise ValueError(f"leantune.patch needs a transformers causal LM (or a PEFT wrapper of one), got "
                     f"{type(model).__name__}")
