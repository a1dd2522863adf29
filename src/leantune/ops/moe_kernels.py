r"""Grouped GEMMs over tokens sorted by expert: one Triton launch for all experts, no host sync, no expert loop.

The rows of ``a`` are sorted by group (expert); ``offsets [E]`` holds the cumulative end rows, as ``offs`` of
``torch._grouped_mm``: group e owns rows ``offsets[e-1]:offsets[e]`` (``offsets[-1]`` of group 0 is 0; empty groups
allowed). The offsets stay on the device: reading them would be a host sync (docs/design.md, "No host sync in a step").

- :func:`grouped_mm`: ``c[rows_e] = a[rows_e] @ b[e]  (+ scale * t[rows_e] @ cf[e])``, the frozen expert GEMM of the
  forward (``b = W.transpose(1, 2)``) and of dX (``b = W``), with LoRA's low-rank term fused in the same kernel.
  Rows past ``offsets[-1]`` are written as 0.
- :func:`grouped_outer`: ``c[e] = a[rows_e]^T @ b[rows_e]``, the per-expert weight-gradient products (LoRA's
  ``dB_e = s dY_e^T xa_e``, ``dA_e = g_e^T x_e``); a group without rows gives zeros.

Grid and tile lookup (docs/design.md, "Grouped GEMM"). The grid cannot depend on the per-group counts, so
``grouped_mm`` launches an upper bound of row tiles. With the trailing rows past ``offsets[-1]`` counted as one more
group (index E, written as zeros), the E + 1 groups of ``n_g`` rows need ``sum_g cdiv(n_g, BLOCK_M) <= cdiv(M,
BLOCK_M) + E`` tiles (each non-empty group wastes less than one tile). Every program loads the E offsets as one
vector (one cached line per 16-32 experts), forms the tiles per group and their running sum (``tl.cumsum``) in
registers, and finds its group as the count of groups whose tiles end at or before its tile index; programs past
the last tile return at once. Row tiles never straddle groups, so each program multiplies by one ``b[e]``. The 1-D
grid runs column tiles fastest: consecutive programs share one row tile of ``a`` and one expert's ``b[e]`` in L2.
``grouped_outer`` reduces over a data-dependent row range: its grid is (E, Ka tiles, Kb tiles) and each program
loops over its group's rows (deterministic; no atomics).

Numerics (docs/design.md, "Numerics", "Backends"): fp32 accumulation; products by :func:`leantune.ops._dot.mixed_dot`
(same 16-bit dtypes: native dot; bf16 x fp32: the three-way bf16 split, fp32-exact; fp32: IEEE FMA, for the 1e-5
bar); an fp32 x fp32 product whose result is stored in 16 bits uses TF32 (its 2^-11 relative rounding is below the
store's 2^-9). Under Triton's interpreter (bf16 kept as raw bits) every tile is upcast to fp32 before a dot.
Offsets are int64 in pointer arithmetic. Rounded once, at the store.

The torch path of the experts op (moe-core's ``ops/moe.py``) is not here: this file is the Triton side only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _dot, _runtime
from ._dot import mixed_dot

_INDEX_DTYPES = (torch.int32, torch.int64)


# ------------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _tile_of(OFFSETS, n_groups, n_rows, tile, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """(group, first row, end row of the group) of row tile ``tile``: group n_groups is the rows past offsets[-1]
    (written as zeros), a group above it means the tile is past the last one. Offsets are clamped to [0, n_rows], so
    bad offsets never address rows outside the tensor."""
    g = tl.arange(0, BLOCK_G)
    ends = tl.load(OFFSETS + g, mask=g < n_groups, other=n_rows).to(tl.int32)
    starts = tl.load(OFFSETS + g - 1, mask=(g >= 1) & (g <= n_groups), other=0).to(tl.int32)
    ends = tl.minimum(tl.maximum(ends, 0), n_rows)
    starts = tl.where(g > n_groups, n_rows, tl.minimum(tl.maximum(starts, 0), n_rows))
    tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    group = tl.sum((tiles_end <= tile).to(tl.int32), 0)
    pick = g == group
    first_tile = tl.sum(tl.where(pick, tiles_end - tiles, 0), 0)
    row0 = tl.sum(tl.where(pick, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(pick, ends, 0), 0)
    return group, row0, row_end


@triton.jit
def _grouped_mm_kernel(
    A, B, C, OFFSETS, T, CF,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_tm, stride_tr, stride_fe, stride_fr, stride_fn,
    n_rows, n_cols, n_inner, n_groups, rank, scale,
    HAS_LOWRANK: tl.constexpr, DOT_MODE: tl.constexpr, LOW_LEFT: tl.constexpr,
    LR_MODE: tl.constexpr, LR_LOW_LEFT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """C[rows_e, cols] = A[rows_e] @ B[e][:, cols] (+ scale * T[rows_e] @ CF[e][:, cols]); zeros past offsets[-1]."""
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(n_cols, BLOCK_N)
    group, row0, row_end = _tile_of(OFFSETS, n_groups, n_rows, pid // n_col_tiles, BLOCK_M, BLOCK_G)
    if group > n_groups:  # past the last tile of the upper-bound grid
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = (pid % n_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < n_cols
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    c_ptrs = C + rows64[:, None] * stride_cm + cols64[None, :] * stride_cn
    c_mask = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if group == n_groups:  # rows past offsets[-1]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)
        return
    group64 = group.to(tl.int64)
    if HAS_LOWRANK:  # scale * t @ cf[e], formed first so one accumulator holds the sum
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            r_ok = rr < rank
            rr64 = rr.to(tl.int64)
            t = tl.load(T + rows64[:, None] * stride_tm + rr64[None, :] * stride_tr,
                        mask=row_ok[:, None] & r_ok[None, :], other=0.0)
            f = tl.load(CF + group64 * stride_fe + rr64[:, None] * stride_fr + cols64[None, :] * stride_fn,
                        mask=r_ok[:, None] & col_ok[None, :], other=0.0)
            acc = mixed_dot(acc, t, f, LR_LOW_LEFT, LR_MODE, UPCAST)
        acc = acc * scale
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows64[:, None] * stride_am + ks.to(tl.int64)[None, :] * stride_ak
    b_ptrs = B + group64 * stride_be + ks.to(tl.int64)[:, None] * stride_bk + cols64[None, :] * stride_bn
    for k0 in range(0, n_inner, BLOCK_K):
        k_ok = ks < n_inner - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = mixed_dot(acc, a, b, LOW_LEFT, DOT_MODE, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)


@triton.jit
def _grouped_outer_kernel(
    A, B, C, OFFSETS,
    stride_am, stride_ak, stride_bm, stride_bk, stride_ce, stride_ca, stride_cb,
    n_rows, n_a, n_b,
    DOT_MODE: tl.constexpr, LOW_LEFT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """C[e, ia, ib] = sum over rows of group e of A[row, ia] * B[row, ib]: a loop over the group's rows."""
    pid = tl.program_id(0)
    tiles_a = tl.cdiv(n_a, BLOCK_A)
    tiles_b = tl.cdiv(n_b, BLOCK_B)
    group = pid // (tiles_a * tiles_b)
    tile_a = (pid // tiles_b) % tiles_a
    tile_b = pid % tiles_b
    end = tl.minimum(tl.maximum(tl.load(OFFSETS + group).to(tl.int32), 0), n_rows)
    start = tl.where(group > 0, tl.load(OFFSETS + tl.maximum(group - 1, 0)).to(tl.int32), 0)
    start = tl.minimum(tl.maximum(start, 0), n_rows)
    ia = (tile_a * BLOCK_A + tl.arange(0, BLOCK_A)).to(tl.int64)
    ib = (tile_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    a_ok = ia < n_a
    b_ok = ib < n_b
    acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        m_ok = rows < end
        rows64 = rows.to(tl.int64)
        # a^T tile loaded transposed ([BLOCK_A, BLOCK_M]): no tl.trans
        at = tl.load(A + rows64[None, :] * stride_am + ia[:, None] * stride_ak,
                     mask=a_ok[:, None] & m_ok[None, :], other=0.0)
        bt = tl.load(B + rows64[:, None] * stride_bm + ib[None, :] * stride_bk,
                     mask=m_ok[:, None] & b_ok[None, :], other=0.0)
        acc = mixed_dot(acc, at, bt, LOW_LEFT, DOT_MODE, UPCAST)
    tl.store(C + group.to(tl.int64) * stride_ce + ia[:, None] * stride_ca + ib[None, :] * stride_cb,
             acc.to(C.dtype.element_ty), mask=a_ok[:, None] & b_ok[None, :])


# ----------------------------------------------------------------------------------------------------- launchers
class MMConfig(NamedTuple):
    """Tile sizes and launch options of one grouped GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _pair_mode(lhs: torch.dtype, rhs: torch.dtype, out: torch.dtype) -> tuple[int, bool]:
    """(DOT_MODE, LOW_LEFT) for lhs @ rhs: the 16-bit operand is the "low" tile of mixed_dot; an fp32 x fp32
    product stored in 16 bits runs in TF32."""
    if lhs != torch.float32 or rhs == torch.float32:
        mode, low_left = _dot.dot_mode(lhs, rhs), True
    else:
        mode, low_left = _dot.dot_mode(rhs, lhs), False
    if mode == _dot.DOT_IEEE and lhs == rhs == torch.float32 and out != torch.float32:
        mode = _dot.DOT_TF32
    return mode, low_left


def _width_block(width: int, cap: int) -> int:
    return max(16, min(cap, _runtime.next_power_of_2(width)))  # tl.dot needs >= 16 on every side


def mm_config(n_rows: int, n_cols: int, n_groups: int, mode: int) -> MMConfig:
    """Tiles of :func:`grouped_mm`, picked once from the shape (no autotuning: its first call costs host time).

    Hopper defaults for 16-bit dots: 64-row tiles while groups hold < 1024 rows on average (a partial last tile per
    group wastes up to BLOCK_M - 1 rows), else 128; 128 columns (fewer for a narrow output, e.g. rank 16); BLOCK_K
    64. IEEE fp32 dots (FMA, no tensor cores) use 64 x 64 x 32. Under the interpreter: 16 (the smallest tl.dot)."""
    if _runtime.KERNELS_INTERPRETED:
        return MMConfig(16, 16, 16, 1, 1)
    if mode == _dot.DOT_IEEE:
        return MMConfig(64, _width_block(n_cols, 64), 32, 4, 2)
    block_m = 128 if n_rows >= 1024 * max(1, n_groups) else 64
    block_n = _width_block(n_cols, 128)
    return MMConfig(block_m, block_n, 64, 8 if block_m * block_n >= 128 * 128 else 4, 3)


def outer_config(n_a: int, n_b: int, mode: int) -> MMConfig:
    """Tiles of :func:`grouped_outer` (block_m: rows per step of the reduction; block_n/block_k: the Ka/Kb tile)."""
    if _runtime.KERNELS_INTERPRETED:
        return MMConfig(16, 16, 16, 1, 1)
    cap, block_m = (64, 32) if mode == _dot.DOT_IEEE else (128, 64)
    block_a, block_b = _width_block(n_a, cap), _width_block(n_b, cap)
    return MMConfig(block_m, block_a, block_b, 8 if block_a * block_b >= 128 * 128 else 4, 3)


def _check_offsets(offsets, n_groups: int, device: torch.device) -> torch.Tensor:
    if not isinstance(offsets, torch.Tensor):
        raise ValueError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in _INDEX_DTYPES:
        raise ValueError(f"offsets must be int32 or int64 (cumulative end rows of each group), got {offsets.dtype}")
    _runtime.check_shape("offsets", offsets, (n_groups,), "one cumulative end row per group")
    if offsets.device != device:
        raise ValueError(f"offsets must be on {device} with the other tensors, got {offsets.device}")
    return offsets.contiguous()


def _check_out_dtype(out_dtype, default: torch.dtype) -> torch.dtype:
    out_dtype = default if out_dtype is None else out_dtype
    if out_dtype not in _runtime.FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    return out_dtype


def _check_lowrank(lowrank, n_rows: int, n_groups: int, n_cols: int, device: torch.device):
    if not isinstance(lowrank, (tuple, list)) or len(lowrank) != 3:
        raise ValueError("lowrank must be a tuple (t [M, r], cf [E, r, N], scale), got "
                         f"{type(lowrank).__name__}")
    t, cf, scale = lowrank
    _runtime.check_tensor("lowrank t", t)
    _runtime.check_tensor("lowrank cf", cf)
    if t.dim() != 2 or t.shape[0] != n_rows:
        raise ValueError(f"lowrank t must have shape ({n_rows}, r) (one row per row of a), got {tuple(t.shape)}")
    _runtime.check_shape("lowrank cf", cf, (n_groups, t.shape[1], n_cols), "[E, r, N]: one factor per group")
    if t.device != device or cf.device != device:
        raise ValueError(f"lowrank t and cf must be on {device} with a, got {t.device} and {cf.device}")
    return t, cf, _runtime.check_real("lowrank scale", scale)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, lowrank=None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``c[rows_e] = a[rows_e] @ b[e] (+ scale * t[rows_e] @ cf[e])`` for every group e in one launch.

    Args:
        a: ``[M, K]`` float (fp32, fp16, bf16), any strides, rows sorted by group.
        b: ``[E, K, N]`` float, any strides (``W.transpose(1, 2)`` of an expert weight ``W [E, N, K]``, or ``W``).
        offsets: ``[E]`` int32 or int64 on a's device, cumulative end rows (``torch._grouped_mm``'s ``offs``):
            group e owns rows ``offsets[e-1]:offsets[e]``, non-decreasing, at most M (not checked: that would read
            the device; values are clamped to [0, M] so no access leaves the tensors).
        lowrank: None, or ``(t [M, r], cf [E, r, N], scale)``, floats of any dtype and strides (fp32 factors under a
            bf16 base, as PEFT keeps adapters): the LoRA term added in fp32 before the single rounding.
        out_dtype: the result's dtype; default a's.

    Returns:
        ``c [M, N]`` of ``out_dtype``; rows past ``offsets[-1]`` are 0. Accumulation in fp32 (IEEE for fp32
        operands stored in fp32, so 1e-5 holds; see the module docstring).

    Raises:
        ValueError: a tensor of the wrong rank, shape, dtype or device, naming the argument (before any kernel).
    """
    _runtime.check_tensor("a", a)
    _runtime.check_tensor("b", b)
    if a.dim() != 2:
        raise ValueError(f"a must be 2-D [M, K], got shape {tuple(a.shape)}")
    if b.dim() != 3 or b.shape[1] != a.shape[1]:
        raise ValueError(f"b must have shape [E, {a.shape[1]}, N] (K = a.shape[1]), got {tuple(b.shape)}")
    if b.device != a.device:
        raise ValueError(f"b must be on a's device {a.device}, got {b.device}")
    n_rows, n_inner = a.shape
    n_groups, _, n_cols = b.shape
    offsets = _check_offsets(offsets, n_groups, a.device)
    out_dtype = _check_out_dtype(out_dtype, a.dtype)
    t = cf = None
    scale = 0.0
    if lowrank is not None:
        t, cf, scale = _check_lowrank(lowrank, n_rows, n_groups, n_cols, a.device)
    c = _runtime.empty((n_rows, n_cols), dtype=out_dtype, device=a.device)
    if n_rows == 0 or n_cols == 0:
        return c
    has_lowrank = t is not None and t.shape[1] > 0
    mode, low_left = _pair_mode(a.dtype, b.dtype, out_dtype)
    lr_mode, lr_low_left = _pair_mode(t.dtype, cf.dtype, out_dtype) if has_lowrank else (0, True)
    cfg = mm_config(n_rows, n_cols, n_groups, mode)
    row_tiles = _runtime.cdiv(n_rows, cfg.block_m) + n_groups  # upper bound: see the module docstring
    grid = (row_tiles * _runtime.cdiv(n_cols, cfg.block_n),)
    t_, cf_ = (t, cf) if has_lowrank else (a, b)  # placeholders never read
    _grouped_mm_kernel[grid](
        a, b, c, offsets, t_, cf_,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        t_.stride(0), t_.stride(1), cf_.stride(0), cf_.stride(1), cf_.stride(2),
        n_rows, n_cols, n_inner, n_groups, t.shape[1] if has_lowrank else 0, scale,
        HAS_LOWRANK=has_lowrank, DOT_MODE=mode, LOW_LEFT=low_left, LR_MODE=lr_mode, LR_LOW_LEFT=lr_low_left,
        UPCAST=_runtime.KERNELS_INTERPRETED,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_R=_runtime.rank_block(t.shape[1]) if has_lowrank else 16,
        BLOCK_G=_runtime.next_power_of_2(n_groups + 1), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


def grouped_outer(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``c[e] = a[rows_e]^T @ b[rows_e]`` for every group e in one launch (per-expert weight-gradient products).

    Args:
        a: ``[M, Ka]`` float, any strides; b: ``[M, Kb]`` float, any strides; rows sorted by group.
        offsets: ``[E]`` int32 or int64 cumulative end rows, as for :func:`grouped_mm` (rows past ``offsets[-1]``
            are not read).
        out_dtype: the result's dtype (default fp32: weight gradients of fp32 adapters).

    Returns:
        ``c [E, Ka, Kb]``; a group without rows gives zeros. fp32 accumulation over the group's rows, in a fixed
        order (deterministic).

    Raises:
        ValueError: a tensor of the wrong rank, shape, dtype or device, naming the argument (before any kernel).
    """
    _runtime.check_tensor("a", a)
    _runtime.check_tensor("b", b)
    if a.dim() != 2 or b.dim() != 2 or b.shape[0] != a.shape[0]:
        raise ValueError(f"a and b must be [M, Ka] and [M, Kb] with the same M, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if b.device != a.device:
        raise ValueError(f"b must be on a's device {a.device}, got {b.device}")
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
        raise ValueError(f"offsets must be a 1-D [E] tensor of cumulative end rows, got {offsets!r:.80}")
    n_groups = offsets.shape[0]
    offsets = _check_offsets(offsets, n_groups, a.device)
    out_dtype = _check_out_dtype(out_dtype, torch.float32)
    n_rows, n_a = a.shape
    n_b = b.shape[1]
    c = _runtime.empty((n_groups, n_a, n_b), dtype=out_dtype, device=a.device)
    if n_groups == 0 or n_a == 0 or n_b == 0:
        return c
    mode, low_left = _pair_mode(a.dtype, b.dtype, out_dtype)
    cfg = outer_config(n_a, n_b, mode)
    grid = (n_groups * _runtime.cdiv(n_a, cfg.block_n) * _runtime.cdiv(n_b, cfg.block_k),)
    _grouped_outer_kernel[grid](
        a, b, c, offsets,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), c.stride(2),
        n_rows, n_a, n_b,
        DOT_MODE=mode, LOW_LEFT=low_left, UPCAST=_runtime.KERNELS_INTERPRETED,
        BLOCK_M=cfg.block_m, BLOCK_A=cfg.block_n, BLOCK_B=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c
