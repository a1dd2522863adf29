"""Helpers shared by every patched forward (:mod:`.forwards`, :mod:`.blocks`)."""

from __future__ import annotations

import contextvars

import torch

from .. import ops
from ..ops import _runtime

# The rope kind inside the forward of a patched attention module that runs HF's own attention forward (which calls
# the module-level ``apply_rotary_pos_emb``, leantune's dispatcher); False elsewhere. A context variable keeps
# threads and tasks apart. Eager mode only: dynamo traces no ``ContextVar``, and torch 2.11's traces no mutation of
# any Python state (class attribute, object, dict, list) inside a checkpointed layer, so under torch.compile a
# patched attention with its rope kind on runs leantune's copy of the attention, which hands the kind to the
# rotation as an argument (:func:`leantune.patch.blocks.attention_forward`), and the flag is never set.
_ROPE_ACTIVE = contextvars.ContextVar("leantune_rope_active", default=False)


def set_rope_active(on):
    """Make :func:`rope_active` return ``on`` (the family's rope kind, e.g. "half" or "half_freqs", or False) in
    eager mode; returns the token :func:`reset_rope_active` restores from. Not for traced code (see above)."""
    return _ROPE_ACTIVE.set(on)


def reset_rope_active(token) -> None:
    _ROPE_ACTIVE.reset(token)


def rope_active():
    """The rope kind (truthy) when the caller runs inside a patched attention forward with RoPE served by
    ``ops.rope`` through HF's own forward, else False; always False while torch.compile traces."""
    return False if torch.compiler.is_compiling() else _ROPE_ACTIVE.get()


def call_original(module, *args, **kwargs):
    """The module's class forward (HF's or PEFT's), bypassing the instance forward leantune bound."""
    return type(module).forward(module, *args, **kwargs)


def served(*tensors) -> bool:
    """Whether the ops take these tensors: fp32/fp16/bf16 on a real device. Anything else (a float64 model for
    gradient checks, the meta device for shape tracing) runs HF's forward, which handles it."""
    return all(t.dtype in _runtime.FLOAT_DTYPES and t.device.type != "meta" for t in tensors if t is not None)


# ----------------------------------------------------------------------------------------------------------- RoPE
def _rope_fits(q, k, cos, sin) -> bool:
    if not served(q, k, cos, sin):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.shape != sin.shape or cos.dim() not in (2, 3):
        return False
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or rotary_dim > q.shape[-1] or q.shape[-1] != k.shape[-1]:
        return False
    if cos.dim() == 3 and cos.shape[0] not in (1, q.shape[0]):
        return False
    return cos.shape[-2] == q.shape[-2] == k.shape[-2]


def rotate(kind, original, q, k, cos, sin, unsqueeze_dim=1):
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` for a patched attention whose rope kind is
    ``kind``: ``ops.rope`` where it fits ("half_freqs" cos/sin widened to one column per rotated dim first), else
    ``original`` (HF's function; also for ``kind=False``)."""
    if kind and unsqueeze_dim == 1 and torch.is_tensor(q) and torch.is_tensor(cos) and torch.is_tensor(sin):
        wide_cos, wide_sin = cos, sin
        if kind == "half_freqs":  # one column per frequency (gpt-oss): ops.rope wants one per rotated dim
            if cos.shape[-1] * 2 != q.shape[-1]:
                return original(q, k, cos, sin, unsqueeze_dim)
            wide_cos, wide_sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        if _rope_fits(q, k, wide_cos, wide_sin):
            if wide_cos.dim() == 3 and wide_cos.shape[0] == 1 and q.shape[0] != 1:
                wide_cos, wide_sin = wide_cos[0], wide_sin[0]  # one position row for the whole batch: [S, R]
            return ops.rope(q, k, wide_cos, wide_sin)
    return original(q, k, cos, sin, unsqueeze_dim)


def hf_rope(function):
    """HF's own ``apply_rotary_pos_emb`` behind ``function`` (a module's current one: leantune's dispatcher or HF's)."""
    return getattr(function, "_leantune_original", function)
