r"""The jit pieces of per-row e4m3 quantisation (:mod:`leantune.ops.fp8`'s format and rounding rule), shared by the
kernels that quantise a GEMM input: :mod:`leantune.ops.fp8`'s own row-quantisation kernel and the RMSNorm and GLU
kernels that write the codes of their output in the same pass (:mod:`leantune.ops.rms_norm`, :mod:`leantune.ops.glu`,
:mod:`leantune.ops.lora.glu_lowrank`). One copy of the rounding, so every path gives the same codes bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._runtime import KERNELS_INTERPRETED

# Compiled for the card, fp32 -> e4m3 is the hardware conversion (cvt.rn.satfinite.e4m3x2.f32: round to nearest even,
# one instruction per two codes); the interpreter's cast is wrong (below), so there the codes come from integer
# arithmetic on the bits. The two give the same codes (tests/test_fp8_kernels.py on the card against torch's cast,
# on the CPU the integer form against the same references). Measured on the H200 (2026-12-03): with the integer form
# the quantisation was compute-bound, ~0.07 ms per 4096 x 4096 against a 0.013 ms memory floor.
NATIVE_E4M3 = tl.constexpr(not KERNELS_INTERPRETED)


@triton.jit
def _max_propagating_nan(a, b):
    # tl.max's default combine may drop a NaN on the card (max.f32 returns the other operand): torch's amax keeps it
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _e4m3_codes(v):
    """The e4m3fn codes (int32 in [0, 255]) of fp32 ``v`` in [-448, 448] or NaN, rounded to nearest even, in integer
    arithmetic on v's bits: the same on the card and in the interpreter, whose fp32 -> float8e4nv cast rounds ties
    away from zero (1.0625 -> 1.125), loses mantissa carries (1.9375 -> 1) and truncates subnormals (triton 3.6
    ``interpreter._convert_float``)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # |v| >= 2^-6 (bits 0x3C800000), e4m3 normals: drop 20 of fp32's 23 mantissa bits to nearest even (a carry into
    # the exponent is the right result), rebias the exponent from 127 to 7 (120 << 3 in code units)
    an = tl.minimum(a, 0x43E00000)  # 448: keeps NaN bits (discarded below) from overflowing int32 here
    normal = ((an + 0x7FFFF + ((an >> 20) & 1)) >> 20) - (120 << 3)
    # |v| < 2^-6, e4m3 subnormals (spacing 2^-9): the code is round(|v| 2^9) = round(m 2^(e - 141)) with m the 24-bit
    # significand and e the biased fp32 exponent (e >= 1 here or 0 for fp32 subnormals, where the shift caps at 31
    # and the code is 0); a code of 8 is 2^-6, the smallest normal, encoded right by the same integer
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    shift = tl.minimum(141 - tl.maximum(e, 1), 31)
    sub = (m + ((1 << (shift - 1)) - 1) + ((m >> shift) & 1)) >> shift
    codes = tl.where(a >= 0x3C800000, normal, sub)
    codes = tl.where(a > 0x7F800000, 0x7F, codes)  # NaN (no infinities reach here: the quotient is clamped)
    return codes | sign


@triton.jit
def _load_fp32(T, M, rows, cols, mask, stride_row, stride_col, n_cols,
               BF16_BITS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr):
    """t[rows, cols] as fp32 (times m[cols] with a multiplier): exactly ``t.float()`` (and ``* m``)."""
    ptrs = T + rows[:, None] * stride_row + cols[None, :] * stride_col
    if BF16_BITS:  # bf16 read as int16 bits: bf16 -> fp32 is a 16-bit shift (the interpreter's cast loses subnormals)
        x = (tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_MULTIPLIER:
        x = x * tl.load(M + cols, mask=cols < n_cols, other=0.0)[None, :]
    return x


@triton.jit
def _store_codes(Q, x, scale, rows, cols, mask, n_cols):
    """q = e4m3(clamp(x / s, -448, 448)) with IEEE fp32 division (``/`` is approximate on the card)."""
    quotient = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    quotient = tl.clamp(quotient, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if NATIVE_E4M3:
        codes = quotient.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        # a NaN keeps its sign bit, as torch's cast and the integer form do (the hardware writes 0x7F for any NaN)
        nan_codes = (((quotient.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F).to(tl.uint8)
        codes = tl.where(quotient != quotient, nan_codes, codes)
    else:
        codes = _e4m3_codes(quotient).to(tl.uint8)
    tl.store(Q + rows[:, None] * n_cols + cols[None, :], codes, mask=mask)


@triton.jit
def _row_scales(absmax):
    """s = max(absmax / 448, 2^-126) with IEEE division (``div_rn``), NaN kept."""
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, 448.0, tl.float32))
    return tl.maximum(scale, 1.1754943508222875e-38, propagate_nan=tl.PropagateNan.ALL)  # 2^-126


@triton.jit
def stored_fp32(v):
    """The exact fp32 value of ``v`` (a tile already cast to the dtype it is stored in): bf16 through its bits (a
    16-bit shift; the interpreter's bf16 -> fp32 cast loses subnormals), other dtypes by their exact cast."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def store_row_quantisation(Q, S, x, rows, cols, row_mask, mask, n_cols):
    """:func:`quantize_rows` of an fp32 tile ``x [ROWS, BLOCK]`` that holds whole rows (entries outside ``mask``
    ignored): s_r into S[rows], the codes into the contiguous ``Q [n_rows, n_cols]`` (uint8). For kernels that make
    a GEMM input and have its rows in registers (:mod:`leantune.ops.rms_norm`, :mod:`leantune.ops.glu`)."""
    absmax = tl.reduce(tl.where(mask, tl.abs(x), 0.0), 1, _max_propagating_nan)
    scale = _row_scales(absmax)
    tl.store(S + rows, scale, mask=row_mask)
    _store_codes(Q, x, scale, rows, cols, mask, n_cols)
    return scale


@triton.jit
def row_absmax(absmax, x, mask):
    """max(absmax, max_c |x[:, c]|) over the entries of the fp32 tile ``x [ROWS, BLOCK]`` inside ``mask``, NaN kept
    (torch's amax propagates it)."""
    block_max = tl.reduce(tl.where(mask, tl.abs(x), 0.0), 1, _max_propagating_nan)
    return tl.maximum(absmax, block_max, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantized_row_pass(T, Q, S, x, absmax, rows, cols, row_mask, mask, stride_row, n_cols,
                       BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """The end of a kernel that wrote ``T [n_rows, n_cols]`` (unit column stride) block by block and kept the rows'
    ``absmax``: s into S[rows], the codes into the contiguous ``Q`` (uint8). ``ONE_BLOCK``: the row fits one block,
    whose fp32 values ``x`` (as stored) are still in registers and give the codes; else T is read back block by
    block as stored (just written by this program: mostly L2 hits on the card)."""
    scale = _row_scales(absmax)
    tl.store(S + rows, scale, mask=row_mask)
    if ONE_BLOCK:
        _store_codes(Q, x, scale, rows, cols, mask, n_cols)
    else:
        tl.debug_barrier()  # the reads below see every thread's stores of T
        for start in range(0, n_cols, BLOCK):
            block_cols = start + cols
            block_mask = row_mask[:, None] & (block_cols < n_cols)[None, :]
            stored = tl.load(T + rows[:, None] * stride_row + block_cols[None, :], mask=block_mask, other=0.0)
            _store_codes(Q, stored_fp32(stored), scale, rows, block_cols, block_mask, n_cols)
