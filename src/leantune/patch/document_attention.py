"""Attention over the documents packed in a row, without the dense [B, 1, S, S] mask: one causal SDPA per document.

Packed rows restart ``position_ids`` at each document. Given them with no attention mask and no cache, transformers
5 builds a block-diagonal causal mask of B S^2 bytes (``masking_utils.find_packed_sequence_indices``), and SDPA with
a mask cannot run its flash kernel: at 65,536 tokens the mask alone is 4 GiB a row, at 262,144 64 GiB. This
attention function is registered with transformers' ``AttentionInterface`` as :data:`NAME`, together with a mask
function (``AttentionMaskInterface``) that returns a marker instead of that mask exactly when transformers would have
built it: causal AND same-document, nothing else (no padding mask, no cache offset, queries as long as keys). On the
marker, the attention function reads the documents from ``position_ids`` (a document starts where a position is not
its predecessor's plus one, transformers' own rule) and runs each document's queries against its own keys and values
with ``is_causal=True``:

    out[b, s:e] = softmax(q[b, s:e] k[b, s:e]^T * scaling + causal) v[b, s:e]       for each document [s, e) of row b

which is the block-diagonal causal attention exactly, with O(tokens) extra memory. The spans are needed on the host
(one SDPA call per document); they are reused by every layer and by the checkpointed recomputation (keyed on the
``position_ids`` tensor). Where the data is built on the host, :func:`remember_documents` computes them from the host
copy of the positions (``leantune train`` does, before each forward): no device sync at all. Otherwise they are
read from the device's ``position_ids`` once per forward (one sync). Every other call (a padding mask, decoding or
several new tokens on a cache, unpacked rows) gets transformers' own SDPA mask and path, so results never change,
only the memory. Sliding-window and softcapped attention are refused by :func:`use_document_attention`.
"""

from __future__ import annotations

import numpy as np
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


def remember_documents(position_ids: torch.Tensor, host_position_ids: torch.Tensor) -> None:
    """Tell the next forwards on ``position_ids`` (the tensor the model is called with, on any device) where its
    documents are, from ``host_position_ids`` (the same values on the CPU, where the data was built), so that
    neither this module nor transformers reads them back from the device:

    - the document spans :func:`document_attention` runs on (cached as if read from ``position_ids``);
    - the answer of transformers' ``masking_utils.find_packed_sequence_indices`` for this tensor, which otherwise
      ends in a host sync (``(...).all()`` deciding whether any row is packed): None when every row is one
      document, else the same per-token document index (0, 1, 2, ... from each row's first token, +1 at each
      document start), formed on the device. A dispatcher in ``masking_utils`` (installed on the first call)
      answers for this tensor and calls transformers' function for every other.

    Computed with numpy (``.numpy()`` refuses a device tensor, so it can never read one back). Raises ValueError
    when the shapes differ."""
    if tuple(host_position_ids.shape) != tuple(position_ids.shape) or position_ids.dim() != 2:
        raise ValueError(f"host_position_ids must have position_ids' shape (2-D [B, S]) {tuple(position_ids.shape)}, "
                         f"got {tuple(host_position_ids.shape)}")
    if position_ids.is_inference():  # no version counter to key the cache on: nothing remembered
        return
    positions = host_position_ids.detach().numpy()
    length = positions.shape[1]
    spans = []
    for row in positions:
        starts = [0, *(np.flatnonzero(row[1:] - row[:-1] != 1) + 1).tolist()] if length else []
        spans.append(list(zip(starts, [*starts[1:], length])))
    _spans_cache[:] = [position_ids, position_ids._version, spans]
    _packing_known[:] = [position_ids, position_ids._version, any(len(row) > 1 for row in spans)]
    _install_packing_dispatch()


_packing_known: list = [None, None, None]  # [position_ids tensor, its version, whether any row is packed]


def remember_single_sequences(position_ids: torch.Tensor) -> None:
    """Tell the next forwards on ``position_ids`` ``[B or 1, S]`` that each row is one sequence (what the causal-LM
    forward knows when it made the positions itself, 0..S-1): transformers' packed-row check then returns None with
    no host sync, and under CUDA-graph capture (where that check skips its sync and always builds a dense mask) the
    attention keeps its mask-free causal path. Under torch.compile nothing: transformers' check already avoids the
    sync while tracing, and installing the dispatchers from inside a compiled frame would recompile the next call."""
    if torch.compiler.is_compiling() or position_ids.is_inference():  # inference tensors have no version counter
        return
    length = position_ids.shape[-1]
    _spans_cache[:] = [position_ids, position_ids._version, [[(0, length)]] * position_ids.shape[0]]
    _packing_known[:] = [position_ids, position_ids._version, False]
    _install_packing_dispatch()
    _install_capture_causal_skip()


def install_dispatchers() -> None:
    """Put the packed-row and capture-mask dispatchers in ``masking_utils`` now (``leantune.patch`` does, when it
    binds the causal-LM forward), not at the first forward: a frame torch.compile traced before they existed guards
    on transformers' functions and would recompile once they appear. Both defer to transformers until told."""
    _install_packing_dispatch()
    _install_capture_causal_skip()


def _install_capture_causal_skip() -> None:
    """transformers' ``_ignore_causal_mask_sdpa`` refuses to leave the causal mask to SDPA's ``is_causal`` while
    "tracing", which includes CUDA-graph capture: a dense [B, 1, S, S] mask is then built and SDPA loses its flash
    kernel (a captured 8B step ran ~30% slower on the H200). Its reason is torch.export, whose graph generalises the
    shapes; a CUDA graph replays one fixed shape, so there the skip decision is the eager one. This dispatcher takes
    that decision during capture for the case it can read without the device (no padding mask), and leaves every
    other call, and every other kind of tracing, to transformers."""
    from transformers import masking_utils

    current = masking_utils._ignore_causal_mask_sdpa
    if getattr(current, "_leantune_original", None) is not None:
        return

    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        capturing_only = (padding_mask is None and torch.cuda.is_available()
                          and torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling()
                          and not torch.jit.is_tracing())
        if not capturing_only:
            return current(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)
        if local_attention_size is not None and kv_length >= local_attention_size:
            return False
        return q_length == 1 or kv_length == q_length or q_offset == 0  # transformers' rules without a padding mask

    _ignore_causal_mask_sdpa._leantune_original = current
    masking_utils._ignore_causal_mask_sdpa = _ignore_causal_mask_sdpa


def _known_packing(position_ids):
    """Whether some row of ``position_ids`` (or of the tensor it was expanded from) is packed, when
    :func:`remember_documents` was told; None when unknown."""
    known, version, packed = _packing_known
    if known is None:
        return None
    if known._version != version:
        return None
    if position_ids is known:
        return packed
    # transformers expands [1, S] positions to the batch (position_ids.expand(B, -1)): the same single row. Views
    # share their root's storage: known may itself be a view (arange(S).unsqueeze(0)), then the expansion's _base is
    # that root, not known
    root = known if known._base is None else known._base
    expanded = (position_ids._base is root and known.shape[0] == 1 and position_ids.dim() == 2
                and position_ids.stride(0) == 0 and position_ids.shape[1] == known.shape[1]
                and position_ids.data_ptr() == known.data_ptr())
    return packed if expanded else None


def _install_packing_dispatch() -> None:
    from transformers import masking_utils

    current = masking_utils.find_packed_sequence_indices
    if getattr(current, "_leantune_original", None) is not None:
        return

    def find_packed_sequence_indices(position_ids):
        packed = None if torch.compiler.is_compiling() else _known_packing(position_ids)  # traced: transformers' own
        if packed is None:
            return find_packed_sequence_indices._leantune_original(position_ids)
        if not packed:
            return None
        # document index per token: 0 at a row's first token, + 1 at each token that is not its predecessor + 1
        starts = position_ids[:, 1:] - position_ids[:, :-1] != 1
        return F.pad(starts.cumsum(-1), (1, 0))

    find_packed_sequence_indices.__doc__ = (f"leantune dispatcher: the known answer for position_ids given to "
                                            f"remember_documents, else {current!r}.")
    find_packed_sequence_indices._leantune_original = current
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def _cached_spans(position_ids: torch.Tensor):
    if position_ids.is_inference():  # no version counter: read each time (inference mode, no graph to keep short)
        return document_spans(position_ids)
    cached, version, spans = _spans_cache
    if cached is not position_ids or version != position_ids._version:
        spans = document_spans(position_ids)
        _spans_cache[:] = [position_ids, position_ids._version, spans]
    return spans


def document_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       position_ids=None, **kwargs):
    """transformers' attention-function signature: ``query [B, H, S, D]``, ``key``/``value [B, H_kv, S, D]`` ->
    ``([B, S, H, D], None)``. One causal SDPA per packed document when the mask function left its marker (module
    docstring); transformers' SDPA forward unchanged otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not _PACKED:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      position_ids=position_ids, **kwargs)
    if position_ids is None or position_ids.shape[-1] != query.shape[2]:
        raise RuntimeError("leantune's document attention got packed rows without their position_ids")
    spans = _cached_spans(position_ids)
    if len(spans) == 1 and query.shape[0] > 1:  # [1, S] positions shared by every row, as transformers expands them
        spans = spans * query.shape[0]
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for b, row in enumerate(spans):
        rows.append(torch.cat([
            F.scaled_dot_product_attention(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                           dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
            for s, e in row], dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


# what the mask function returns instead of the block-diagonal mask: only document_attention reads it
_PACKED = torch.ones(())


def _causal_and_packed(mask_function) -> bool:
    """Whether transformers' mask function is exactly causal AND same-document (its packed-sequence detection),
    read from how ``create_causal_mask`` composes it (transformers 5: ``and_masks(causal_mask_function,
    packed_sequence_mask_function(...))``)."""
    from transformers.masking_utils import causal_mask_function

    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return False
    cells = dict(zip(mask_function.__code__.co_freevars, (c.cell_contents for c in mask_function.__closure__ or ())))
    parts = cells.get("mask_functions", ())
    return (len(parts) == 2 and parts[0] is causal_mask_function
            and getattr(parts[1], "__qualname__", "") == "packed_sequence_mask_function.<locals>.inner_mask")


def _document_mask(*args, mask_function=None, attention_mask=None, q_length=None, kv_length=None, q_offset=0,
                   kv_offset=0, **kwargs):
    """The marker where transformers would build the block-diagonal causal mask of packed rows; its own SDPA mask
    (``sdpa_mask``) in every other case."""
    from transformers.masking_utils import sdpa_mask

    if (attention_mask is None and q_length == kv_length and not q_offset and not kv_offset
            and _causal_and_packed(mask_function)):
        return _PACKED
    return sdpa_mask(*args, mask_function=mask_function, attention_mask=attention_mask, q_length=q_length,
                     kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset, **kwargs)


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
