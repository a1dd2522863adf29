"""What every patch module reads off a model: the transformers causal LM inside whatever wraps it (PEFT), and
whether a layer's checkpoint function runs reentrantly."""

from __future__ import annotations

import functools

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


def instance_forward(module: nn.Module, is_ours):
    """The module's instance-level forward (None if it has none), seen through the ``functools.wraps`` wrappers put
    on over it (accelerate's mixed-precision autocast and fp32-output wrappers, which ``Trainer.train`` adds for
    ``bf16=True``): the first callable in the ``__wrapped__`` chain for which ``is_ours`` is true, else the outer
    one."""
    outer = forward = module.__dict__.get("forward")
    for _ in range(8):  # a chain, never a cycle in practice; bounded all the same
        if forward is None or is_ours(forward):
            return forward if forward is not None else outer
        forward = getattr(forward, "__wrapped__", None)
    return outer


def checkpoint_reentrant(func) -> bool | None:
    """Whether a module's ``_gradient_checkpointing_func`` runs torch's checkpoint reentrantly: transformers sets a
    ``functools.partial`` of it, whose missing ``use_reentrant`` means torch's default, reentrant; leantune's offload
    wrapper (``.inner``) is looked through. None for any other callable: leantune cannot tell."""
    func = getattr(func, "inner", func)
    if not isinstance(func, functools.partial):
        return None
    return func.keywords.get("use_reentrant", True) is not False
