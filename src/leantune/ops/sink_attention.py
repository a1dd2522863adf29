r"""Causal attention with attention sinks (one learned logit per query head in the softmax denominator) through
PyTorch's ``scaled_dot_product_attention``, so the flash / memory-efficient kernels run and no ``[B, H, L, S]``
score tensor is formed. Autograd through torch (SDPA's own backward); no kernel of leantune's.

Formula (gpt-oss; transformers 5.17 ``models/gpt_oss/modeling_gpt_oss.py``, ``eager_attention_forward``, which
appends the sink logit as an extra column, softmaxes, and drops the column). Per batch b, query head h, query i, with
s_ij = scaling * q_hi . k_g(h)j + mask_ij (g(h) the key/value head of h, mask_ij = -inf where i may not see j):

    out_hi = sum_j exp(s_ij) v_g(h)j / (exp(sink_h) + sum_j exp(s_ij))

Construction. With D the head dim and D' = the next multiple of 8 above D (SDPA's flash and efficient kernels take
head dims that are multiples of 8), every vector is padded with zeros to D' and one key is prepended:

    q'_hi = [q_hi, sink_h, 0...]           (component D carries the head's sink)
    k'_j  = [k_j, 0, 0...],  v'_j = [v_j, 0...]        for the real keys j = 0..S-1 (at positions 1..S)
    k'_s  = [0...0, 1 / scaling, 0...],  v'_s = 0      the sink key, at position 0, shared by every head

so scaling * q'_hi . k'_j = scaling * q_hi . k_j = s_ij and scaling * q'_hi . k'_s = sink_h for every query: SDPA's
softmax over the S + 1 keys is the one above, and the sink key's zero value adds nothing to the numerator. The sink
key is the same for all heads (the sink rides on the query), so grouped-query attention needs no per-head key
(``enable_gqa`` on the flash path, key/value heads repeated as HF's ``repeat_kv`` does where a mask is given).
Gradients: q, k, v through the slices of the padding; the sinks through component D of q' (d sink_h is the sum of
dq'_hi[D] over b and i). 1 / scaling is rounded to the input dtype (exact for D = 64, scaling = 1/8, gpt-oss).

Causal alignment. SDPA's ``is_causal`` is top-left aligned: with L queries and S + 1 keys query i would see keys
0..i, i.e. the sink and tokens 0..i-1. A dummy query (zeros) is prepended too, so both lengths are L + 1 and query
i (at position i + 1) sees the sink and tokens 0..i; the dummy's output is dropped (its upstream gradient is zero, so
it adds exactly nothing to dk and dv), and it always sees the sink, so no row is ever fully masked.

Masks. ``attention_mask`` None and L == S with no window: ``is_causal=True`` (the flash path on CUDA). A window w
without a mask: an explicit boolean band, token i sees j with i - w < j <= i (transformers' ``sliding_window_overlay``:
``kv_idx > q_idx - sliding_window``, w tokens including itself). L != S without a mask (new tokens on a cache):
the causal band aligned bottom-right (query i is token S - L + i), as transformers' masks are. A given mask is the
whole pattern (causality and window included, as transformers builds them): boolean (True = attend) or additive
float (0 / a large negative, transformers' eager masks), broadcastable to ``[B, H, L, S]``; it is padded by one row
and one column that see everything (the sink column for every query; the dummy row). Explicit masks keep SDPA off
its flash kernel (memory-efficient kernel on CUDA: still no score tensor, O(B L S) for the mask itself).

Dtypes. q, k, v one float dtype; sinks any float dtype, cast to it (transformers concatenates the sinks with the
scores in the attention dtype). SDPA accumulates in fp32 on its fused kernels; transformers' eager softmax runs in
the attention dtype, so in bf16 this is closer to the float64 formula than HF's eager. Dropout (``dropout_p``) is
SDPA's, on the probabilities of all S + 1 keys: on the sink's it has no effect (zero value), so it is HF's dropout
of the S token probabilities in distribution.

Not once-differentiable by hand like the other ops: gradients of gradients are whatever SDPA's backward supports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _runtime


def _band(queries: int, keys: int, window: int | None, device) -> torch.Tensor:
    """[queries, keys] bool: query i is token keys - queries + i; it sees j <= that token, within the window."""
    i = torch.arange(queries, device=device)[:, None] + (keys - queries)
    j = torch.arange(keys, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    return allowed


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor, *,
                   scaling: float, attention_mask: torch.Tensor | None = None, sliding_window: int | None = None,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention whose softmax denominator also holds ``exp(sinks[h])`` (module docstring).

    Args:
        query: ``[B, H, L, D]``, float (fp32 / fp16 / bf16; float64 runs SDPA's math kernel).
        key, value: ``[B, Hkv, S, D]``, query's dtype and device; ``H % Hkv == 0`` (grouped-query attention).
        sinks: ``[H]``, any float dtype (cast to query's); gets a gradient when it requires one.
        scaling: the factor on q . k (HF's ``module.scaling``); > 0.
        attention_mask: None, or the full pattern, broadcastable to ``[B, H, L, S]``: bool (True = attend) or
            additive float. When given, ``sliding_window`` is not applied again (the mask holds it).
        sliding_window: w >= 1: token i sees tokens i - w + 1 .. i (only when ``attention_mask`` is None).
        dropout_p: dropout on the attention probabilities (pass 0.0 outside training).

    Returns:
        ``[B, L, H, D]`` (heads after tokens, as transformers' attention functions return it), query's dtype.

    Raises:
        ValueError: shapes or head counts that do not match, a sinks vector that is not ``[H]``, a window < 1, a
            mask whose last two dims are not ``[L, S]`` or whose dtype is neither bool nor float, or scaling <= 0.
    """
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        raise ValueError(f"query [B, H, L, D] and key = value [B, Hkv, S, D] expected, got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if key.shape[0] != batch or key.shape[3] != dim or heads % kv_heads:
        raise ValueError(f"key/value {tuple(key.shape)} do not fit query {tuple(query.shape)} (same B and D, "
                         f"H a multiple of Hkv)")
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (heads,):
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a [H] = [{heads}] tensor, got {got}")
    _runtime.check_same_device(query=query, key=key, value=value, sinks=sinks, attention_mask=attention_mask)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if attention_mask is not None and tuple(attention_mask.shape[-2:]) != (length, keys):
        raise ValueError(f"attention_mask's last dims must be [L, S] = [{length}, {keys}], got "
                         f"{tuple(attention_mask.shape)}")
    if not scaling > 0:  # SDPA's causal path gives NaN for a negative scale; 0 has no 1 / scaling
        raise ValueError(f"scaling must be > 0 (the sink key holds 1 / scaling), got {scaling}")
    if attention_mask is not None and not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point()):
        raise ValueError(f"attention_mask must be bool (True: may attend) or float (added to the scores), got "
                         f"{attention_mask.dtype}")
    dtype = query.dtype
    padded = -(-(dim + 1) // 8) * 8
    # a sink of -inf (exp = 0: plain causal attention) as the dtype's lowest finite value: -inf * 0 against the
    # real keys' zero component would be NaN; against the sink key it still gives -inf, exp 0
    sink_column = sinks.to(dtype).clamp(min=torch.finfo(dtype).min)
    sink_column = sink_column.view(1, heads, 1, 1).expand(batch, heads, length, 1)
    # q' = [q, sink, 0...], with the dummy query (zeros) at position 0
    q = F.pad(torch.cat([query, sink_column], dim=-1), (0, padded - dim - 1, 1, 0))
    k = F.pad(key, (0, padded - dim, 1, 0))
    k[:, :, 0, dim] = 1.0 / scaling  # the sink key; CopySlices: no gradient reaches this constant
    v = F.pad(value, (0, padded - dim, 1, 0))

    mask, causal = None, False
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = F.pad(attention_mask, (1, 0, 1, 0), value=True)
        else:
            mask = F.pad(attention_mask.to(dtype), (1, 0, 1, 0), value=0.0)
    elif length == keys and (sliding_window is None or sliding_window >= keys):
        causal = True  # top-left alignment is right: both lengths are L + 1
    else:
        mask = F.pad(_band(length, keys, sliding_window, query.device), (1, 0, 1, 0), value=True)
    gqa = heads != kv_heads
    if gqa and mask is not None:  # HF's choice (use_gqa_in_sdpa): enable_gqa with a mask falls to the math kernel
        repeat = heads // kv_heads
        k = k[:, :, None].expand(batch, kv_heads, repeat, keys + 1, padded).reshape(batch, heads, keys + 1, padded)
        v = v[:, :, None].expand(batch, kv_heads, repeat, keys + 1, padded).reshape(batch, heads, keys + 1, padded)
        gqa = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                         scale=scaling, enable_gqa=gqa)
    return out[:, :, 1:, :dim].transpose(1, 2)
