r"""DoRA's per-column Triton kernels and their launchers (derivation: :mod:`leantune.ops.lora.dora`).

- ``_column_dot_kernel``: c[K] = sum over rows of dY[M, K] * u[M, K] in fp32 (DoRA's dm = sum_i dY_ij u_ij), both
  read as stored and upcast in registers, split-M partials summed like the skinny kernels': one launch where a
  chunked torch chain needs five per 16 MiB chunk (two upcasts, the product, its sum, the accumulation). With
  ``SCALED`` it also writes dY' = g * dY from the same read of dY (DoRA's backward: ``scale_column_dot``, in place
  into dY allowed); without, it is the dm-only form (``column_dot``).
- ``_column_scale_kernel``: y[M, K] = x * g[K] (+ b[K]) in fp32, one rounding to nearest even (DoRA's y = g u + b
  where u is already formed, and dY' = g dY under a frozen magnitude): the values of torch's ``mul`` / ``addcmul``
  with an fp32 g, in 16-byte vector accesses where torch's mixed-dtype elementwise path is scalar.

The rounding store, the column affine g u + b (shared with the low-rank add's DoRA epilogue) and the split-M
bookkeeping come from :mod:`.kernels`, so these values match that module's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _launch, _runtime
from .kernels import _BLOCK_K, _BLOCK_N, _column_affine, _grid, _round_store, _splits, _sum_partials


# ------------------------------------------------------------------------------------------------------ kernels
@_launch.bound
@triton.jit
def _column_dot_kernel(D, U, G, DS, C, stride_d, stride_u, stride_ds, stride_cs, n_rows, n_cols, m_per_split,
                       SCALED: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[split, K] = sum over this program's row slice of D[m, k] * U[m, k] (the partials of DoRA's dm), products and
    sums in fp32; with SCALED also DS = cast(D[m, k] * G[k]) (dY' = g dY) from the same read of D. DS may be D (in
    place): every element is loaded before the same program stores it."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(1)
    col_ok = cols < n_cols
    if SCALED:
        g = tl.load(G + cols, mask=col_ok, other=0.0).to(tl.float32)
    m_start = split * m_per_split
    m_end = tl.minimum(m_start + m_per_split, n_rows)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_M):
        rows64 = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows64 < m_end)[:, None] & col_ok[None, :]
        d = tl.load(D + rows64[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + rows64[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(d * u, 0)
        if SCALED:
            _round_store(DS + rows64[:, None] * stride_ds + cols[None, :], d * g[None, :], mask, INTERPRETED)
    tl.store(C + split.to(tl.int64) * stride_cs + cols, acc, mask=col_ok)


@_launch.bound
@triton.jit
def _column_scale_kernel(X, G, BIAS, Y, stride_x, stride_y, n_rows, n_cols,
                         HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y = cast(X[m, k] * G[k] (+ BIAS[k])): DoRA's y = g u + b and dY' = g dY, in fp32 registers, one cast."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _column_affine(x, G, BIAS, cols, col_ok, HAS_BIAS, INTERPRETED)
    _round_store(Y + rows64[:, None] * stride_y + cols[None, :], y, mask, INTERPRETED)


# ----------------------------------------------------------------------------------------------------- launchers
def column_dot(a, b, *, block_m=32, block_k=128, num_warps=4, per_sm=4):
    """c [K] fp32 = sum over rows of a * b (a, b [M, K], any float dtypes, read as stored and multiplied in fp32
    registers; a copy only for a column stride other than 1). Split-M partials in fp32, summed by torch in a fixed
    order (deterministic). Raises ValueError for shapes that differ."""
    if a.dim() != 2 or a.shape != b.shape:
        raise ValueError(f"column_dot takes two [M, K] tensors of one shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    return _column_dot(a, b, None, None, block_m, block_k, num_warps, per_sm)


def _column_dot(d, u, scale, out, block_m, block_k, num_warps, per_sm):
    """The split-M launch of ``_column_dot_kernel`` (shapes checked by the caller): the fp32 column sums, and
    dY' = d * scale into ``out`` when a scale is given."""
    n_rows, n_cols = d.shape
    dot = _runtime.empty((n_cols,), dtype=torch.float32, device=d.device)
    if n_cols == 0:
        return dot
    if n_rows == 0:
        return dot.zero_()
    d = d if d.stride(1) == 1 or n_cols == 1 else d.contiguous()  # a copy: out may no longer alias d, still right
    u = u if u.stride(1) == 1 or n_cols == 1 else u.contiguous()
    n_tiles = _runtime.cdiv(n_cols, block_k)
    splits, per_split = _splits(d.device, n_tiles, n_rows, block_m, per_sm)
    dest = dot.view(1, n_cols) if splits == 1 else _runtime.empty((splits, n_cols), dtype=torch.float32,
                                                                   device=d.device)
    scaled = scale is not None
    _column_dot_kernel[(n_tiles, splits)](
        d, u, scale.contiguous() if scaled else d, out if scaled else d, dest, d.stride(0), u.stride(0),
        out.stride(0) if scaled else 0, dest.stride(0), n_rows, n_cols, per_split,
        SCALED=scaled, INTERPRETED=_runtime.KERNELS_INTERPRETED, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=num_warps,
    )
    if splits > 1:
        _sum_partials(dest, dot)
    return dot


def _output(x, out, out_dtype):
    """``out`` checked as an [M, K] buffer like x with unit column stride, or a new one of ``out_dtype`` (x's)."""
    if out is None:
        return _runtime.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if out.dim() != 2 or out.shape != x.shape:
        raise ValueError(f"out must be [M, K] = {list(x.shape)}, got {list(out.shape)}")
    if x.shape[1] > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have unit column stride, got strides {out.stride()}")
    return out


def _check_columns(name, t, n_cols):
    if t.dim() != 1 or t.shape[0] != n_cols:
        raise ValueError(f"{name} must be a [K] = [{n_cols}] vector, got {list(t.shape)}")


def column_scale(x, scale, bias=None, *, out=None, out_dtype=None):
    """y [M, K] = x * scale (+ bias) per column, evaluated in fp32 and cast once to ``out_dtype`` (default x's dtype):
    DoRA's y = g u + b and dY' = g dY. x [M, K] any float dtype, read as stored (a copy only for a column stride
    other than 1); scale [K] (fp32: g = m / n) and bias [K] any float dtype, upcast in registers. The same values as
    torch's ``torch.mul(x, scale, out=y)`` / ``torch.addcmul(bias, x, scale, out=y)`` for an fp32 scale (both form the
    fp32 product and round it once; with a bias the GPU compiler may fuse the add into an FMA, as torch's CUDA kernel
    does). ``out`` (an [M, K] tensor with unit column stride, may be x itself) receives y. Raises ValueError for
    mismatched shapes."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {list(x.shape)}")
    n_rows, n_cols = x.shape
    _check_columns("scale", scale, n_cols)
    if bias is not None:
        _check_columns("bias", bias, n_cols)
    out = _output(x, out, out_dtype)
    if not (n_rows and n_cols):
        return out
    x = x if x.stride(1) == 1 or n_cols == 1 else x.contiguous()
    scale = scale.contiguous()
    bias = None if bias is None else bias.contiguous()
    _column_scale_kernel[_grid(n_rows, n_cols)](
        x, scale, bias if bias is not None else scale, out, x.stride(0), out.stride(0), n_rows, n_cols,
        HAS_BIAS=bias is not None, INTERPRETED=_runtime.KERNELS_INTERPRETED, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        num_warps=4,
    )
    return out


def scale_column_dot(dy, u, scale, *, out=None, out_dtype=None, block_m=32, block_k=128, num_warps=4, per_sm=4):
    """(dY' [M, K] = dy * scale per column in fp32, cast once to ``out_dtype`` (default dy's dtype); c [K] fp32 =
    sum over rows of dy * u): DoRA's dY' = g dY and dm's sum in one read of dy and u, where :func:`column_scale` and
    :func:`column_dot` read dy twice. dy, u [M, K] any float dtypes (read as stored, fp32 registers); scale [K]. dY'
    has :func:`column_scale`'s values and c :func:`column_dot`'s (the same split-M partials, summed by torch in a
    fixed order: deterministic) for the same block and split arguments. ``out`` (an [M, K] tensor with unit column
    stride, may be dy itself: in place) receives dY'. Raises ValueError for mismatched shapes."""
    if dy.dim() != 2 or dy.shape != u.shape:
        raise ValueError(f"scale_column_dot takes dy and u of one [M, K] shape, got {list(dy.shape)} and "
                         f"{list(u.shape)}")
    n_rows, n_cols = dy.shape
    _check_columns("scale", scale, n_cols)
    out = _output(dy, out, out_dtype)
    return out, _column_dot(dy, u, scale, out, block_m, block_k, num_warps, per_sm)
