"""Attention over the documents packed in a row, without the dense [B, 1, S, S] mask: one causal SDPA per document.

Packed rows restart ``position_ids`` at each document. Given them and no attention mask, transformers 5 builds a
block-diagonal causal mask of B S^2 bytes (``masking_utils.find_packed_sequence_indices``), and SDPA with a mask
cannot run its flash kernel: at 65,536 tokens the mask alone is 4 GiB a row, at 262,144 64 GiB. This attention
function (registered with transformers' ``AttentionInterface`` as :data:`NAME`, and with ``AttentionMaskInterface``
so that no dense mask is built for it) finds the documents from ``position_ids`` instead, where a position is not
its predecessor's plus one (transformers' own rule), and runs each document's queries against its own keys and
values with ``is_causal=True``:

    out[b, s:e] = softmax(q[b, s:e] k[b, s:e]^T * scaling + causal) v[b, s:e]       for each document [s, e) of row b

which is the block-diagonal causal attention exactly, with O(tokens) extra memory. The spans are read to the host
once per forward (one sync) and reused by every layer and by the checkpointed recomputation (keyed on the
``position_ids`` tensor). A padding mask (a 2-D ``attention_mask`` with zeros), a query length other than the key
length (decoding with a cache), or sliding-window / softcapped attention are not this case: those calls run
transformers' own SDPA path with its mask, so results never change, only the memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "leantune_document_sdpa"
_spans_cache: list = [None, None, None]  # [position_ids tensor, its version, spans]


def document_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``position_ids [B, S]``, the ``[start, end)`` token spans of its documents (a document starts
    where a position is not its predecessor's plus one). One host sync."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    rows, cols = torch.nonzero(starts, as_tuple=True)
    length = position_ids.shape[1]
    spans: list[list[tuple[int, int]]] = [[] for _ in range(position_ids.shape[0])]
    for row, col in zip(rows.tolist(), cols.tolist()):
        if spans[row]:
            spans[row][-1] = (spans[row][-1][0], col)
        spans[row].append((col, length))
    return spans


def _cached_spans(position_ids: torch.Tensor):
    cached, version, spans = _spans_cache
    if cached is not position_ids or version != position_ids._version:
        spans = document_spans(position_ids)
        _spans_cache[:] = [position_ids, position_ids._version, spans]
    return spans


def document_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       position_ids=None, **kwargs):
    """transformers' attention-function signature: ``query [B, H, S, D]``, ``key``/``value [B, H_kv, S, D]`` ->
    ``([B, S, H, D], None)``. One causal SDPA per packed document (module docstring); any other case is
    transformers' SDPA forward unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]
             or query.shape[2] < 2 or kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None
             or not getattr(module, "is_causal", True))
    spans = None if plain else _cached_spans(position_ids)
    if spans is None or all(len(row) == 1 for row in spans):  # not packed: the whole row is one causal attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      position_ids=position_ids, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for b, row in enumerate(spans):
        rows.append(torch.cat([
            F.scaled_dot_product_attention(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                           dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
            for s, e in row], dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def _document_mask(*args, attention_mask=None, **kwargs):
    """No dense mask for this implementation unless a padding mask asks for one (then SDPA's, and the attention
    function takes transformers' path with it)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def use_document_attention(model) -> str | None:
    """Switch a transformers model that attends with SDPA to :data:`NAME` (registering it once); returns None when
    switched, else why not (another attention implementation, sliding windows or softcapped attention scores)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = model.config
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        return None
    if current != "sdpa":
        return f"the model attends with {current!r}, not sdpa"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "the model has sliding-window attention layers"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "the model softcaps its attention scores"
    AttentionInterface.register(NAME, document_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _document_mask)
    model.set_attn_implementation(NAME)
    return None
