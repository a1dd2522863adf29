r"""FP8 dX for a group of projections of one x (q/k/v, gate/up): one quantisation and one e4m3 GEMM.

Projections of one x (q/k/v, gate/up) sum their dX terms, dX = sum_j dY_j W_j = g [Wq_1; ...; Wq_k]; the
LoRA ops run that as one e4m3 GEMM of reduction length sum out_j (:func:`fp8_grad_input_group`): one quantisation
launch and one ``_scaled_mm`` instead of k of each, and no k - 1 adds in the compute dtype (``_scaled_mm`` cannot
accumulate into its output). The row scale is shared by the parts, so a part whose values sit far below another's
keeps relative u while its values stay in e4m3's normal range (down to 2^-6 of the row's largest over 448, 15
binades) and the bound above holds with g for x and the stacked codes for W.

Kernel (Triton backend): ``_quantize_parts_kernel``, a group's g = [dY_1 diag(s_1), ..., dY_k diag(s_k)] (k = 2, 3)
quantised per row over all parts, without a concatenated copy of the dY's (:func:`quantize_grad_outputs`), with the
jit pieces and rounding of :mod:`leantune.ops.fp8`; the torch backend keeps the torch chain it equals bit for bit.
Measured (2026-12-05, H100, benchmarks/RESULTS.md): the Llama-3-8B FP8 step 320.9 ms grouped against 324.0 ms with
the per-projection GEMMs (``LEANTUNE_FP8_GROUPED_DX=0``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import _launch, _runtime
from ._fp8_rows import _load_fp32, _max_propagating_nan, _row_scales, _store_codes
from .fp8 import (
    E4M3,
    LOOP_BLOCK,
    QUANT_ONE_BLOCK,
    FP8Weight,
    _check_grad_output,
    _column_blocks,
    _native,
    _ones_row,
    _quantize_rows_torch,
    _scaled_mm,
    _transpose_into,
    _transposed_workspaces,
)


# ------------------------------------------------------------------------------------------------------ kernel
@_launch.bound
@triton.jit
def _quantize_parts_kernel(
    T0, T1, T2, M0, M1, M2, Q, S,
    stride_row0, stride_col0, stride_row1, stride_col1, stride_row2, stride_col2, n_cols0, n_cols1, n_cols2, n_rows,
    BF16_BITS: tl.constexpr, PARTS: tl.constexpr, BLOCK0: tl.constexpr, BLOCK1: tl.constexpr,
    BLOCK2: tl.constexpr, ROWS: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    # quantize_rows of the side-by-side [T0 diag(M0), T1 diag(M1) (, T2 diag(M2))] for a [ROWS, *] slab: one scale a
    # row over every part, codes into Q [n_rows, n_cols0 + n_cols1 + n_cols2] (T2 read only with PARTS == 3). One
    # block: each part's row stays in registers (one read); else every part is read twice in column blocks.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    q_cols = n_cols0 + n_cols1 + n_cols2
    Q1 = Q + n_cols0
    if ONE_BLOCK:
        c0, c1 = tl.arange(0, BLOCK0), tl.arange(0, BLOCK1)
        mask0 = row_mask[:, None] & (c0 < n_cols0)[None, :]
        mask1 = row_mask[:, None] & (c1 < n_cols1)[None, :]
        x0 = _load_fp32(T0, M0, rows, c0, mask0, stride_row0, stride_col0, n_cols0, BF16_BITS, True)
        x1 = _load_fp32(T1, M1, rows, c1, mask1, stride_row1, stride_col1, n_cols1, BF16_BITS, True)
        absmax = tl.maximum(tl.reduce(tl.abs(x0), 1, _max_propagating_nan),
                            tl.reduce(tl.abs(x1), 1, _max_propagating_nan), propagate_nan=tl.PropagateNan.ALL)
        if PARTS == 3:
            c2 = tl.arange(0, BLOCK2)
            mask2 = row_mask[:, None] & (c2 < n_cols2)[None, :]
            x2 = _load_fp32(T2, M2, rows, c2, mask2, stride_row2, stride_col2, n_cols2, BF16_BITS, True)
            absmax = tl.maximum(absmax, tl.reduce(tl.abs(x2), 1, _max_propagating_nan),
                                propagate_nan=tl.PropagateNan.ALL)
        scale = _row_scales(absmax)
        tl.store(S + rows, scale, mask=row_mask)
        _store_codes(Q, x0, scale, rows, c0, mask0, q_cols)
        _store_codes(Q1, x1, scale, rows, c1, mask1, q_cols)
        if PARTS == 3:
            _store_codes(Q1 + n_cols1, x2, scale, rows, c2, mask2, q_cols)
    else:
        absmax = tl.zeros([ROWS], dtype=tl.float32)
        absmax = _column_blocks(absmax, Q, T0, M0, absmax, rows, row_mask, stride_row0, stride_col0, n_cols0,
                                q_cols, BF16_BITS, True, BLOCK0, False)
        absmax = _column_blocks(absmax, Q1, T1, M1, absmax, rows, row_mask, stride_row1, stride_col1, n_cols1,
                                q_cols, BF16_BITS, True, BLOCK1, False)
        if PARTS == 3:
            absmax = _column_blocks(absmax, Q1 + n_cols1, T2, M2, absmax, rows, row_mask, stride_row2, stride_col2,
                                    n_cols2, q_cols, BF16_BITS, True, BLOCK2, False)
        scale = _row_scales(absmax)
        tl.store(S + rows, scale, mask=row_mask)
        _column_blocks(scale, Q, T0, M0, scale, rows, row_mask, stride_row0, stride_col0, n_cols0, q_cols,
                       BF16_BITS, True, BLOCK0, True)
        _column_blocks(scale, Q1, T1, M1, scale, rows, row_mask, stride_row1, stride_col1, n_cols1, q_cols,
                       BF16_BITS, True, BLOCK1, True)
        if PARTS == 3:
            _column_blocks(scale, Q1 + n_cols1, T2, M2, scale, rows, row_mask, stride_row2, stride_col2, n_cols2,
                           q_cols, BF16_BITS, True, BLOCK2, True)


# ------------------------------------------------------------------------------------------- one dX GEMM a group
# LEANTUNE_FP8_GROUPED_DX=0 (benchmarks) times the per-projection dX GEMMs of a group instead
GROUPED_GRAD_INPUT = os.environ.get("LEANTUNE_FP8_GROUPED_DX", "1") != "0"
MAX_GROUP = 3  # projections one grouped quantisation kernel takes (q/k/v; gate/up)


def grouped_grad_input_ok(dys, ws) -> bool:
    """Whether :func:`fp8_grad_input_group` takes these: 2 or 3 FP8 weights with one ``in``, on one device, and dY's of
    one dtype and row count (the dX of projections of one x, as ``lora_qkv``'s and ``lora_mlp``'s gate/up)."""
    if not GROUPED_GRAD_INPUT or not 2 <= len(ws) <= MAX_GROUP or not all(isinstance(w, FP8Weight) for w in ws):
        return False
    w0, dy0 = ws[0], dys[0]
    return all(w.shape[1] == w0.shape[1] and w.device == w0.device for w in ws) and all(
        isinstance(dy, torch.Tensor) and dy.dtype == dy0.dtype and dy.dim() == 2 and dy.shape[0] == dy0.shape[0]
        for dy in dys)


def _check_group(dys, ws) -> None:
    if not isinstance(dys, (list, tuple)) or not isinstance(ws, (list, tuple)) or len(dys) != len(ws) or not ws:
        raise ValueError(f"dys and ws must be sequences of the same non-zero length, got {type(dys).__name__} and "
                         f"{type(ws).__name__}")
    for j, (dy, w) in enumerate(zip(dys, ws)):
        if not isinstance(w, FP8Weight):
            raise ValueError(f"ws[{j}] must be an FP8Weight, got {type(w).__name__}")
        _check_grad_output(dy, w)
        if w.shape[1] != ws[0].shape[1] or dy.shape[0] != dys[0].shape[0] or dy.dtype != dys[0].dtype:
            raise ValueError(f"dys[{j}]/ws[{j}]: a group's weights share in features ({ws[0].shape[1]}) and its dY's "
                             f"their rows and dtype ({dys[0].shape[0]}, {dys[0].dtype}); got in {w.shape[1]}, "
                             f"dY {tuple(dy.shape)} {dy.dtype}")


def _quantize_parts_triton(dys, ws):
    n_rows, widths = dys[0].shape[0], [w.shape[0] for w in ws]
    device = dys[0].device
    q = _runtime.empty((n_rows, sum(widths)), dtype=E4M3, device=device)
    scale = _runtime.empty((n_rows,), dtype=torch.float32, device=device)
    if n_rows == 0:
        return q, scale
    blocks = [_runtime.next_power_of_2(n) for n in widths]
    one_block = sum(blocks) <= QUANT_ONE_BLOCK
    if one_block:  # as the one-part launch: ~4K elements a program (a power of 2 rows), 8 warps from 4096 columns
        total = sum(blocks)
        rows = 1 << (max(1, min(16, 4096 // total)).bit_length() - 1)
        num_warps = _runtime.num_warps_for(total * rows)
    else:
        blocks = [min(b, LOOP_BLOCK) for b in blocks]
        rows, num_warps = 2, 4
    parts = len(ws)
    bf16 = dys[0].dtype == torch.bfloat16
    ts = [dy.view(torch.int16) if bf16 else dy for dy in dys]
    ms = [w.scale for w in ws]
    if parts == 2:  # the third part's arguments are never read (PARTS == 2)
        ts, ms, widths, blocks = ts + [ts[1]], ms + [ms[1]], widths + [0], blocks + [blocks[1]]
    strides = [s for t in ts for s in t.stride()]
    _quantize_parts_kernel[(_runtime.cdiv(n_rows, rows),)](
        *ts, *ms, q.view(torch.uint8), scale, *strides, *widths, n_rows,
        BF16_BITS=bf16, PARTS=parts, BLOCK0=blocks[0], BLOCK1=blocks[1], BLOCK2=blocks[2], ROWS=rows,
        ONE_BLOCK=one_block, num_warps=num_warps,
    )
    return q, scale


def quantize_grad_outputs(dys, ws) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(cat([dy_j.float() * w_j.scale for j], dim=1))``: g = [dY_1 diag(s_1), ..., dY_k diag(s_k)]
    side by side, one scale a row over all k parts (``dys[j] [M, out_j]`` fp32/fp16/bf16 of one dtype, any
    strides; ``ws`` FP8Weights of one ``in``). Returns codes ``float8_e4m3fn [M, sum out_j]`` and scales fp32
    ``[M]``. Triton backend: one kernel for 2 or 3 parts (no concatenated copy of the dY's); torch backend: the
    concatenated fp32 product, then :func:`quantize_rows`.

    Raises:
        ValueError: a dY not 2-D float or not out_j wide, a weight not an FP8Weight, or weights of different
            ``in`` / dY's of different rows or dtype (names the index).
    """
    _check_group(dys, ws)
    if _runtime.backend(dys[0].device) == "triton" and 2 <= len(ws) <= MAX_GROUP:
        return _quantize_parts_triton(dys, ws)
    return _quantize_rows_torch(torch.cat([dy.float() * w.scale[None, :] for dy, w in zip(dys, ws)], dim=1))


def _transposed_group(ws) -> torch.Tensor:
    """[Wq_1; ...; Wq_k]^T ``[in, sum out_j]`` row-major in a workspace reused per (shapes, device): the mat2 of a
    group's one dX GEMM. Each Wq_j^T is written into its column block (:func:`_transpose_into`)."""
    key = (tuple(w.shape for w in ws), ws[0].device)
    if key not in _transposed_workspaces:
        _transposed_workspaces[key] = _runtime.empty((ws[0].shape[1], sum(w.shape[0] for w in ws)), dtype=E4M3,
                                                     device=ws[0].device)
    out, start = _transposed_workspaces[key], 0
    for w in ws:
        _transpose_into(out[:, start:start + w.shape[0]], w)
        start += w.shape[0]
    return out


def fp8_grad_input_group(dys, ws, *, out_dtype: torch.dtype,
                         quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """dX = sum_j dY_j W_j ``[M, in]`` in ``out_dtype`` as one e4m3 GEMM of reduction length sum out_j:

        dX = [dY_1 diag(s_1), ..., dY_k diag(s_k)] [Wq_1; ...; Wq_k] ~= diag(s_g) gq Wq_cat

    with g quantised per row over all parts (:func:`quantize_grad_outputs`) and Wq_cat^T made in a reused workspace.
    Against k separate :func:`fp8_grad_input` calls: one quantisation launch, one GEMM instead of k and no k - 1
    adds in out_dtype (``_scaled_mm`` cannot accumulate into its output), the sum over parts in the GEMM's fp32
    accumulator. A part whose values sit far below another's shares its row scale: in e4m3's normal range
    (2^-6 to 448 times the scale, 15 binades) its relative error is the same u = 2^-4; only values under 2^-6 s
    (the subnormal range, absolute spacing 2^-9 s) lose more, as in one projection's row.

    ``quantized``: ``(codes, scales)`` = ``quantize_grad_outputs(dys, ws)`` made by the kernel that wrote the dY's
    (the LoRA MLP's GLU backward, :mod:`leantune.ops.glu_fp8`); the quantisation pass is then skipped.

    Raises:
        ValueError: as :func:`quantize_grad_outputs`; ``quantized`` not e4m3 codes ``[M, sum out_j]`` and fp32
            scales ``[M]``.
    """
    if quantized is None:
        gq, gs = quantize_grad_outputs(dys, ws)
    else:
        gq, gs = quantized
        rows, width = dys[0].shape[0], sum(w.shape[0] for w in ws)
        if gq.dtype != E4M3 or gq.shape != (rows, width) or gs.dtype != torch.float32 or gs.shape != (rows,):
            raise ValueError(f"quantized must be (float8_e4m3fn [{rows}, {width}], float32 [{rows}]), got "
                             f"({gq.dtype} {tuple(gq.shape)}, {gs.dtype} {tuple(gs.shape)})")
    if all(_native(w) for w in ws):
        return _scaled_mm(gq, gs, _transposed_group(ws).t(), _ones_row(ws[0].shape[1], gq.device), out_dtype)
    wq = torch.cat([w.qweight.float() for w in ws], dim=0)
    return ((gq.float() @ wq) * gs[:, None]).to(out_dtype)
