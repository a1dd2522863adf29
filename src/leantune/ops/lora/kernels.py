r"""The LoRA branch's Triton kernels and their launchers (derivation: :mod:`leantune.ops.lora.api`).

- ``_dropout_kernel``: m * x for the mask of one seed (``tl.rand(seed, row * width + col)``), cast once.
- ``_lowrank_add_kernel``: base + s * m * (P @ Q) for a small rank-R product, formed in fp32 registers, cast once and
  stored in place; in backward it also writes m * x for dA, so the mask is generated once per pass; for DoRA's
  forward it also writes y = g u + b from the u it stores (``lowrank_add_scale_triton``: u and y in one pass).
- ``_skinny_matmul_kernel`` (C[M, r] = A[M, K] @ B[K, r], split-K) and ``_skinny_tn_kernel``
  (C[r, K] = P[M, r]^T @ X[M, K], split-M): the products xa = x A^T, g = s dY B, dA = g^T (m*x), dB = s dY^T xa,
  reading the activation tile as stored and multiplying it by the small factor in fp32 registers
  (:func:`leantune.ops._dot.mixed_dot`); partials of the splits are summed by torch in a fixed order (deterministic).
- DoRA's per-column kernels (column dot, column scale, both in one pass) live in :mod:`.column_kernels`.

Stores of a rounded fp32 value go through ``_round_store``: under the interpreter its bf16 rounding is done in integer
arithmetic (the interpreter's own fp32 -> bf16 cast truncates), so CPU tests compare bit for bit with torch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import _dot, _launch, _runtime
from .._dot import mixed_dot


# ------------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _keep(seed, rows64, cols, n_cols, p):
    """Dropout keep decision for element (row, col) of an [rows, n_cols] input: one Philox draw per element."""
    return tl.rand(seed, rows64[:, None] * n_cols + cols[None, :]) >= p


@_launch.bound
@triton.jit
def _dropout_kernel(
    X, XD, SEEDS, seed_index,
    stride_x, stride_xd, n_rows, n_cols, p, inv_keep,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    keep = _keep(tl.load(SEEDS + seed_index), rows64, cols, n_cols, p)
    xd = x * tl.where(keep, inv_keep, 0.0)  # a product, as PEFT's dropout: a NaN/inf x stays non-finite
    tl.store(XD + rows64[:, None] * stride_xd + cols[None, :], xd.to(XD.dtype.element_ty), mask=mask)


@triton.jit
def _round_store(ptrs, y, mask, INTERPRETED: tl.constexpr):
    """Store fp32 ``y`` rounded to nearest even in the pointers' dtype. The card's cast does that; the interpreter's
    fp32 -> bf16 cast truncates (triton 3.6 ``interpreter._convert_float`` without a rounding mode), so there the
    bf16 bits are rounded in integer arithmetic (NaN kept quiet): the values the card stores."""
    val = y.to(ptrs.dtype.element_ty)
    if INTERPRETED:
        if ptrs.dtype.element_ty == tl.bfloat16:
            bits = y.to(tl.uint32, bitcast=True)
            rounded = tl.where(y != y, (bits >> 16) | 0x40, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
            val = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(ptrs, val, mask=mask)


@triton.jit
def _column_affine(x, G, BIAS, cols, col_ok, HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 x [rows, K] * G[cols] (+ BIAS[cols]): DoRA's g u + b, as torch's fp32 ``mul`` / ``addcmul`` forms it."""
    g = tl.load(G + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = x * g
    if HAS_BIAS:  # one FMA, as torch's addcmul on the CPU and (contracted by nvcc) on the card
        b = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if INTERPRETED:  # the interpreter's tl.fma rounds the product: an fp64 product (exact) and sum instead
            y = (x.to(tl.float64) * g.to(tl.float64) + b.to(tl.float64)).to(tl.float32)
        else:
            y = tl.fma(x, g, b)
    return y


@_launch.bound
@triton.jit
def _lowrank_add_kernel(
    BASE, P, Q, OUT, X, XD, SEEDS, seed_index, G, BIAS, Y,
    stride_base, stride_p, stride_qr, stride_qk, stride_out, stride_x, stride_xd, stride_y,
    n_rows, n_cols, rank, scale, p, inv_keep,
    HAS_MASK: tl.constexpr, WRITE_XD: tl.constexpr, WRITE_Y: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """OUT = cast(BASE + scale * m * (P @ Q)), P [n_rows, rank], Q [rank, n_cols]; optionally XD = cast(m * X);
    optionally (DoRA's y = g u + b on the u just formed) Y = cast(OUT[m, k] * G[k] (+ BIAS[k])) from the stored
    OUT values, as ``_column_scale_kernel`` would form it from OUT: u and y in one pass."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < rank
        pt = tl.load(P + rows64[:, None] * stride_p + rr[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        qt = tl.load(Q + rr[:, None].to(tl.int64) * stride_qr + cols[None, :].to(tl.int64) * stride_qk,
                     mask=r_ok[:, None] & col_ok[None, :], other=0.0)
        # fp32 operands: exact under the interpreter (bf16 is not) and the 1e-5 fp32 bar on the GPU (no TF32); tf32x3
        # was slower here at every tile tried on the H200 (benchmarks/lora_probe.py, 2026-12-04): ~1.5x its floor
        # as it is
        acc += tl.dot(pt.to(tl.float32), qt.to(tl.float32), input_precision="ieee")
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_MASK:
        keep = _keep(tl.load(SEEDS + seed_index), rows64, cols, n_cols, p)
        acc = acc * tl.where(keep, inv_keep, 0.0)
    base = tl.load(BASE + rows64[:, None] * stride_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = (base + scale * acc).to(OUT.dtype.element_ty)
    tl.store(OUT + rows64[:, None] * stride_out + cols[None, :], out, mask=mask)
    if WRITE_Y:  # from the rounded u, the value the store above keeps
        y = _column_affine(out.to(tl.float32), G, BIAS, cols, col_ok, HAS_BIAS, INTERPRETED)
        _round_store(Y + rows64[:, None] * stride_y + cols[None, :], y, mask, INTERPRETED)
    if WRITE_XD:
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_MASK:
            x = x * tl.where(keep, inv_keep, 0.0)
        tl.store(XD + rows64[:, None] * stride_xd + cols[None, :], x.to(XD.dtype.element_ty), mask=mask)


# Skinny products of the LoRA branch: one operand is a wide activation tile (x, h or dY: [M, K], any float dtype,
# loaded as stored), the other the small fp32/bf16 factor (A^T, B, xa or g), multiplied by ``_dot.mixed_dot`` without
# a materialised upcast copy. The dropout mask is a 0/1 product on the stored values (exact in any dtype);
# 1 / (1 - p) rides on the final scale.
@_launch.bound
@triton.jit
def _skinny_matmul_kernel(
    A, B, C, SEEDS, seed_index,
    stride_am, stride_bk, stride_br, stride_cs, stride_cm,
    n_rows, n_inner, rank, k_per_split, scale, p,
    HAS_MASK: tl.constexpr, DOT_MODE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """C[split, M, R] = scale * (keep * A)[M, Ks] @ B[Ks, R] over this program's K slice Ks (split-K partials)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    rows64 = rows.to(tl.int64)
    row_ok = rows < n_rows
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < rank
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, n_inner)
    if HAS_MASK:
        seed = tl.load(SEEDS + seed_index)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        a = tl.load(A + rows64[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_MASK:
            a = (a * tl.where(_keep(seed, rows64, ks, n_inner, p), 1.0, 0.0)).to(A.dtype.element_ty)  # exact
        b = tl.load(B + ks.to(tl.int64)[:, None] * stride_bk + rr[None, :] * stride_br,
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = mixed_dot(acc, a, b, True, DOT_MODE, UPCAST)
    out = acc * scale
    tl.store(C + split.to(tl.int64) * stride_cs + rows64[:, None] * stride_cm + rr[None, :],
             out.to(C.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])


@_launch.bound
@triton.jit
def _skinny_tn_kernel(
    P, X, C, SEEDS, seed_index,
    stride_pm, stride_xm, stride_cs, stride_cr, stride_ck,
    n_rows, n_cols, rank, m_per_split, scale, p,
    HAS_MASK: tl.constexpr, DOT_MODE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """C[split, R, K] = scale * P[Ms, R]^T @ (keep * X)[Ms, K] over this program's row slice Ms (split-M partials)."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(1)
    col_ok = cols < n_cols
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < rank
    m_start = split * m_per_split
    m_end = tl.minimum(m_start + m_per_split, n_rows)
    if HAS_MASK:
        seed = tl.load(SEEDS + seed_index)
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        m_ok = rows < m_end
        x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_MASK:
            x = (x * tl.where(_keep(seed, rows64, cols, n_cols, p), 1.0, 0.0)).to(X.dtype.element_ty)  # exact
        # P^T tile loaded transposed ([R, BLOCK_M]): no tl.trans needed
        pt = tl.load(P + rows64[None, :] * stride_pm + rr[:, None], mask=r_ok[:, None] & m_ok[None, :], other=0.0)
        acc = mixed_dot(acc, pt, x, False, DOT_MODE, UPCAST)
    out = acc * scale
    tl.store(C + split.to(tl.int64) * stride_cs + rr[:, None].to(tl.int64) * stride_cr
             + cols[None, :].to(tl.int64) * stride_ck, out.to(C.dtype.element_ty),
             mask=r_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------------- launchers
_BLOCK_N, _BLOCK_K = 64, 128


def _grid(n_rows, n_cols):
    return (_runtime.cdiv(n_rows, _BLOCK_N), _runtime.cdiv(n_cols, _BLOCK_K))


def dropout_triton(x, seeds, index, p, dtype):
    n_rows, n_cols = x.shape
    xd = _runtime.empty((n_rows, n_cols), dtype=dtype, device=x.device)
    if n_rows and n_cols:
        _dropout_kernel[_grid(n_rows, n_cols)](
            x, xd, seeds, index, x.stride(0), xd.stride(0), n_rows, n_cols, p, 1.0 / (1.0 - p),
            BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4,
        )
    return xd


def lowrank_add_triton(base, lhs, rhs, scale, out_dtype, seeds, index, p, x):
    """(cast(base + scale * m * (lhs @ rhs), out_dtype): in place into base when the dtypes match, m * x in lhs's
    dtype or None); :func:`.passes._lowrank_add`'s Triton path."""
    out, xd, _ = _lowrank_add(base, lhs, rhs, scale, out_dtype, seeds, index, p, x, None, None)
    return out, xd


def lowrank_add_scale_triton(base, lhs, rhs, scale, out_dtype, col_scale, col_bias=None):
    """(u = cast(base + scale * lhs @ rhs, out_dtype), in place into base when the dtypes match; y = cast(u * col_scale
    (+ col_bias)) per column, out_dtype): DoRA's u and y = g u + b in one pass, y the values :func:`column_scale`
    forms from u (fp32 from the rounded u, one FMA with a bias, rounded once). base [N, K], lhs [N, R], rhs [R, K]
    as :func:`lowrank_add_triton`; col_scale [K] fp32, col_bias [K] or None."""
    out, _, y = _lowrank_add(base, lhs, rhs, scale, out_dtype, None, 0, 0.0, None, col_scale, col_bias)
    return out, y


def _lowrank_add(base, lhs, rhs, scale, out_dtype, seeds, index, p, x, col_scale, col_bias):
    n_rows, n_cols = base.shape
    out = base if out_dtype == base.dtype else _runtime.empty((n_rows, n_cols), dtype=out_dtype, device=base.device)
    xd = None if x is None else _runtime.empty((n_rows, n_cols), dtype=lhs.dtype, device=x.device)
    y = None if col_scale is None else _runtime.empty((n_rows, n_cols), dtype=out_dtype, device=base.device)
    if not (n_rows and n_cols):
        return out, xd, y
    rank = lhs.shape[1]
    if lhs.shape[1] > 1 and lhs.stride(1) != 1:
        lhs = lhs.contiguous()
    block_r = _runtime.rank_block(rank)
    has_mask = seeds is not None
    col_scale = None if col_scale is None else col_scale.contiguous()
    col_bias = None if col_bias is None else col_bias.contiguous()
    _lowrank_add_kernel[_grid(n_rows, n_cols)](
        base, lhs, rhs, out, x if x is not None else base, xd if xd is not None else base,
        seeds if has_mask else base, index,
        col_scale if col_scale is not None else base, col_bias if col_bias is not None else base,
        y if y is not None else base,
        base.stride(0), lhs.stride(0), rhs.stride(0), rhs.stride(1), out.stride(0),
        x.stride(0) if x is not None else 0, xd.stride(0) if xd is not None else 0, y.stride(0) if y is not None else 0,
        n_rows, n_cols, rank, float(scale), float(p), 1.0 / (1.0 - p) if has_mask else 1.0,
        HAS_MASK=has_mask, WRITE_XD=x is not None, WRITE_Y=y is not None, HAS_BIAS=col_bias is not None,
        INTERPRETED=_runtime.KERNELS_INTERPRETED, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, BLOCK_R=block_r, num_warps=4,
    )
    return out, xd, y


@functools.lru_cache(maxsize=1024)
def _splits(device, n_tiles, n_inner, block, per_sm):
    """(splits, inner length per split): enough programs to fill the card (a few per SM) when the tile grid alone
    does not; each split a whole number of blocks. Cached: a few shapes per model, every launch asks."""
    target = _runtime.persistent_programs(device, 1 << 30, per_sm)
    splits = max(1, min(_runtime.cdiv(n_inner, block), _runtime.cdiv(target, n_tiles)))
    per_split = _runtime.cdiv(_runtime.cdiv(n_inner, splits), block) * block
    return _runtime.cdiv(n_inner, per_split), per_split


def _sum_partials(partials, out):
    """out = sum over the first dim of the fp32 partials (fixed order: deterministic); out may be a strided view.
    A 16-bit ``out`` goes through an fp32 total: torch would cast the partials to out's dtype before summing."""
    if out.dtype == torch.float32:
        torch.sum(partials, 0, out=out)
    else:
        total = _runtime.empty(partials.shape[1:], dtype=torch.float32, device=partials.device)
        out.copy_(torch.sum(partials, 0, out=total))


def skinny_matmul(a, b, scale=1.0, *, out=None, out_dtype=torch.float32, seeds=None, index=0, p=0.0,
                   precision="auto", block_m=64, block_k=128, num_warps=4, per_sm=4):
    """C [M, R] = scale * (m * a) @ b in fp32, cast once to ``out_dtype``; a [M, K] any float dtype with unit column
    stride (x, h or dY, read as stored: no upcast copy), b [K, R] (any strides; e.g. lora_A.T, lora_B). ``out`` may
    be an [M, R] view with unit column stride. m is the dropout mask of ``seeds[index]`` over a's elements (None: no
    dropout). Split-K with fp32 partials summed by torch (deterministic) when the row tiles alone do not fill the
    card. R beyond ``_runtime.MAX_RANK_BLOCK`` (concatenated adapters) runs in column chunks: bounded tiles."""
    n_rows, n_inner = a.shape
    rank = b.shape[1]
    if out is None:
        out = _runtime.empty((n_rows, rank), dtype=out_dtype, device=a.device)
    if rank > _runtime.MAX_RANK_BLOCK:
        for r0 in range(0, rank, _runtime.MAX_RANK_BLOCK):
            r1 = min(rank, r0 + _runtime.MAX_RANK_BLOCK)
            skinny_matmul(a, b[:, r0:r1], scale, out=out[:, r0:r1], seeds=seeds, index=index, p=p,
                           precision=precision, block_m=block_m, block_k=block_k, num_warps=num_warps, per_sm=per_sm)
        return out
    if n_rows == 0:
        return out
    if n_inner == 0:
        return out.zero_()
    if a.stride(1) != 1:
        a = a.contiguous()
    n_tiles = _runtime.cdiv(n_rows, block_m)
    splits, per_split = _splits(a.device, n_tiles, n_inner, block_k, per_sm)
    dest = out if splits == 1 else _runtime.empty((splits, n_rows, rank), dtype=torch.float32, device=a.device)
    has_mask = seeds is not None
    _skinny_matmul_kernel[(n_tiles, splits)](
        a, b, dest, seeds if has_mask else a, index,
        a.stride(0), b.stride(0), b.stride(1), dest.stride(0) if splits > 1 else 0, dest.stride(-2),
        n_rows, n_inner, rank, per_split, float(scale) / (1.0 - p) if has_mask else float(scale), float(p),
        HAS_MASK=has_mask, DOT_MODE=_dot.dot_mode(a.dtype, b.dtype, precision), UPCAST=_runtime.KERNELS_INTERPRETED,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=_runtime.rank_block(rank), num_warps=num_warps,
    )
    if splits > 1:
        _sum_partials(dest, out)
    return out


def skinny_tn(lhs, x, scale=1.0, *, out=None, out_dtype=torch.float32, seeds=None, index=0, p=0.0,
               precision="auto", block_m=64, block_k=128, num_warps=4, per_sm=4):
    """C [R, K] = scale * lhs^T @ (m * x) in fp32, cast once; lhs [M, R] (fp32 xa or g; unit column stride),
    x [M, K] any float dtype with unit column stride, read as stored. ``out`` may be any [R, K]-shaped view (e.g. the
    transpose of a [K, R] buffer for dB). Split-M partials in fp32, summed by torch (deterministic)."""
    n_rows, n_cols = x.shape
    rank = lhs.shape[1]
    if out is None:
        out = _runtime.empty((rank, n_cols), dtype=out_dtype, device=x.device)
    if rank > _runtime.MAX_RANK_BLOCK:  # bounded tiles: wide (concatenated) ranks in row chunks of the output
        for r0 in range(0, rank, _runtime.MAX_RANK_BLOCK):
            r1 = min(rank, r0 + _runtime.MAX_RANK_BLOCK)
            skinny_tn(lhs[:, r0:r1], x, scale, out=out[r0:r1], seeds=seeds, index=index, p=p, precision=precision,
                       block_m=block_m, block_k=block_k, num_warps=num_warps, per_sm=per_sm)
        return out
    if n_cols == 0:
        return out
    if n_rows == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    if rank > 1 and lhs.stride(1) != 1:
        lhs = lhs.contiguous()
    n_tiles = _runtime.cdiv(n_cols, block_k)
    splits, per_split = _splits(x.device, n_tiles, n_rows, block_m, per_sm)
    if splits == 1:
        dest, strides = out, (0, out.stride(0), out.stride(1))
    else:
        dest = _runtime.empty((splits, rank, n_cols), dtype=torch.float32, device=x.device)
        strides = dest.stride()
    has_mask = seeds is not None
    _skinny_tn_kernel[(n_tiles, splits)](
        lhs, x, dest, seeds if has_mask else x, index,
        lhs.stride(0), x.stride(0), *strides,
        n_rows, n_cols, rank, per_split, float(scale) / (1.0 - p) if has_mask else float(scale), float(p),
        HAS_MASK=has_mask, DOT_MODE=_dot.dot_mode(x.dtype, lhs.dtype, precision), UPCAST=_runtime.KERNELS_INTERPRETED,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=_runtime.rank_block(rank), num_warps=num_warps,
    )
    if splits > 1:
        _sum_partials(dest, out)
    return out
