"""Helpers shared by every patched forward (:mod:`.forwards`, :mod:`.blocks`)."""

from __future__ import annotations

import contextvars

from ..ops import _runtime

# True inside the forward of a patched attention module whose rope kind is on: the RoPE dispatcher runs ops.rope
ROPE_ACTIVE = contextvars.ContextVar("leantune_rope_active", default=False)


def call_original(module, *args, **kwargs):
    """The module's class forward (HF's or PEFT's), bypassing the instance forward leantune bound."""
    return type(module).forward(module, *args, **kwargs)


def served(*tensors) -> bool:
    """Whether the ops take these tensors: fp32/fp16/bf16 on a real device. Anything else (a float64 model for
    gradient checks, the meta device for shape tracing) runs HF's forward, which handles it."""
    return all(t.dtype in _runtime.FLOAT_DTYPES and t.device.type != "meta" for t in tensors if t is not None)
