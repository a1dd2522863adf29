"""Helpers shared by every patched forward (:mod:`.forwards`, :mod:`.blocks`)."""

from __future__ import annotations

import contextvars

import torch

from ..ops import _runtime

# True inside the forward of a patched attention module whose rope kind is on: the RoPE dispatcher runs ops.rope.
# A context variable keeps threads and tasks apart; dynamo cannot trace one (a graph break per attention layer), so
# inside torch.compile the flag is a plain attribute, which dynamo tracks as a side effect of the frame.
_ROPE_ACTIVE = contextvars.ContextVar("leantune_rope_active", default=False)


class _TracedFlag:
    on = False


def set_rope_active(on):
    """Make :func:`rope_active` return ``on`` (the family's rope kind, e.g. "half" or "half_freqs", or False);
    returns the token :func:`reset_rope_active` restores from."""
    if torch.compiler.is_compiling():
        previous, _TracedFlag.on = _TracedFlag.on, on
        return previous
    return _ROPE_ACTIVE.set(on)


def reset_rope_active(token) -> None:
    if torch.compiler.is_compiling():
        _TracedFlag.on = token
    else:
        _ROPE_ACTIVE.reset(token)


def rope_active():
    """The rope kind (truthy) when the caller runs inside a patched attention forward with RoPE served by
    ``ops.rope``, else False."""
    return _TracedFlag.on if torch.compiler.is_compiling() else _ROPE_ACTIVE.get()


def call_original(module, *args, **kwargs):
    """The module's class forward (HF's or PEFT's), bypassing the instance forward leantune bound."""
    return type(module).forward(module, *args, **kwargs)


def served(*tensors) -> bool:
    """Whether the ops take these tensors: fp32/fp16/bf16 on a real device. Anything else (a float64 model for
    gradient checks, the meta device for shape tracing) runs HF's forward, which handles it."""
    return all(t.dtype in _runtime.FLOAT_DTYPES and t.device.type != "meta" for t in tensors if t is not None)
