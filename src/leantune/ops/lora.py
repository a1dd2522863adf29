r"""LoRA projections with hand-derived backward: one linear, the q/k/v triple of one input, and the gated MLP.

Forward (Hu et al. 2021, "LoRA"; PEFT ``peft/tuners/lora/layer.py`` ``Linear.forward``), x ``[N, in]``, frozen
W ``[out, in]``, adapters A ``[r, in]``, B ``[out, r]``, scaling s, dropout mask m = keep / (1 - p):

    y = x W^T + b + s ((m*x) A^T) B^T                      (m = 1 when p = 0 or not training)

Backward, with xa = (m*x) A^T ``[N, r]`` and g = s (dY B) ``[N, r]``:

    dX = dY W + m * (g A)          dA = g^T (m*x)          dB = s dY^T xa
    db = sum over rows of dY       dW = dY^T x             (only when W requires grad: full fine-tune)

Saved for backward: x and xa (``[N, r]``, small). m*x is not saved: the mask is regenerated from a per-projection
seed (drawn from torch's generator for x's device, so checkpoint recomputation, which restores the RNG state, draws
the same one) and applied again in backward. All backward needs goes through ``ctx.save_for_backward``.

Dtypes (PEFT's behaviour): the frozen matmul runs in the compute dtype c = W's dtype (x cast to it), or autocast's
dtype under ``torch.autocast``; the LoRA branch runs in l = lora_A's dtype (autocast's under autocast); the sum is
formed in promote(c, l) and cast once to c, the base output's dtype (PEFT's ``result.to(torch_result_dtype)``).
Gradients come back in their inputs' dtypes.

Groups. ``lora_qkv`` runs q, k, v off one x in one autograd node: x is saved once; without dropout the three A's are
concatenated (a copy of ``3 r in`` elements, free next to x) so x is read once for xa, and once for dA; dX is one
buffer that every frozen and LoRA term is accumulated into (``addmm_`` with beta = 1).

``lora_mlp``: y = down(act(gate(x)) * up(x)) with each projection a LoRA linear (HF LlamaMLP/GemmaMLP with PEFT on
all three). It saves x and the gate and up outputs (plus the ``[N, r]`` xa's) but not h = act(gate) * up: backward
recomputes h (needed for down's dA and dW), forms dh = dY W_down + m*(g_down A_down), and the GLU backward writes
d_gate, d_up into the saved gate/up buffers (this node owns them). Saved bytes N (H + 2I) elt + O(N r) against
PEFT's N (H + 4I) elt (it also keeps act(gate) and h).

Passes. Frozen and LoRA matmuls go through torch (cuBLAS). When the LoRA branch has the base's dtype and there is no
dropout, the B term is added into the base output inside the GEMM (``addmm_``, beta = 1, alpha = s): one pass.
Otherwise one Triton kernel (``_lowrank_add_kernel``) forms base + s * m * (P @ Q) for the small rank-R product in
fp32 registers, casts once and stores in place (in backward it also writes m*x for dA, so the mask is generated once
per pass); ``_dropout_kernel`` applies the mask in forward. Masks are ``tl.rand(seed, row * width + col)`` on the
Triton path and ``torch.rand`` with a seeded ``torch.Generator`` on the torch path (the two differ, as DESIGN allows).

Skinny products (Triton path). With PEFT's fp32 adapters under a bf16/fp16 base, xa = x A^T, g = s dY B,
dA = g^T (m*x) and dB = s dY^T xa would need fp32 copies of x (or h) and of every dY ([N, in], [N, out]: the bulk of
the LoRA branch's traffic). ``_skinny_matmul_kernel`` (C[M, r] = A[M, K] @ B[K, r], split-K) and
``_skinny_tn_kernel`` (C[r, K] = P[M, r]^T @ X[M, K], split-M) read the activation tile as stored and form the
product in fp32 registers: bf16 x fp32 as three bf16 tensor-core dots against an exact three-way bf16 split of the
fp32 factor (every bf16 product is exact in fp32, accumulation is fp32), fp16/fp32 x fp32 as an IEEE fp32 dot;
``precision="ieee"`` forces the latter. Partials of the splits are summed by torch in a fixed order (deterministic).
They also take dropout: the mask is regenerated in registers from the seed and applied as a 0/1 product (as
PEFT's dropout multiplies: a NaN/inf input element stays non-finite where dropped), so m*x is never stored. Used
where the upcast to the LoRA dtype is exact (one dtype, or fp32 adapters); otherwise (autocast to bf16 from fp32
inputs) the LoRA branch rounds its inputs first, as autocast does, through torch.

GLU fusion (Triton path, gate and up both with adapters): the B terms of gate and up are added inside the GLU
forward pass (:func:`leantune.ops.glu.glu_forward_lowrank`), which writes the summed gate/up in place (saved for
backward) and h from them, instead of a low-rank add over each [N, I] output followed by a GLU pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _dot, _runtime
from ._dot import mixed_dot
from .glu import ACTIVATIONS, glu_backward, glu_forward, glu_forward_lowrank


class LoraWeights(NamedTuple):
    """One projection: frozen ``weight [out, in]``, adapters ``lora_A [r, in]``, ``lora_B [out, r]`` (PEFT layout),
    ``scaling`` (alpha/r, rsLoRA alpha/sqrt(r), ... whatever the caller uses) and ``bias [out]`` or None.
    ``lora_A = lora_B = None`` is a plain frozen projection."""

    weight: torch.Tensor
    lora_A: torch.Tensor | None
    lora_B: torch.Tensor | None
    scaling: float
    bias: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _keep(seed, rows64, cols, n_cols, p):
    """Dropout keep decision for element (row, col) of an [rows, n_cols] input: one Philox draw per element."""
    return tl.rand(seed, rows64[:, None] * n_cols + cols[None, :]) >= p


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
def _lowrank_add_kernel(
    BASE, P, Q, OUT, X, XD, SEEDS, seed_index,
    stride_base, stride_p, stride_qr, stride_qk, stride_out, stride_x, stride_xd,
    n_rows, n_cols, rank, scale, p, inv_keep,
    HAS_MASK: tl.constexpr, WRITE_XD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """OUT = cast(BASE + scale * m * (P @ Q)), P [n_rows, rank], Q [rank, n_cols]; optionally XD = cast(m * X)."""
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
        # fp32 operands: exact under the interpreter (bf16 is not) and the 1e-5 fp32 bar on the GPU (no TF32)
        acc += tl.dot(pt.to(tl.float32), qt.to(tl.float32), input_precision="ieee")
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_MASK:
        keep = _keep(tl.load(SEEDS + seed_index), rows64, cols, n_cols, p)
        acc = acc * tl.where(keep, inv_keep, 0.0)
    base = tl.load(BASE + rows64[:, None] * stride_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = base + scale * acc
    tl.store(OUT + rows64[:, None] * stride_out + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    if WRITE_XD:
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_MASK:
            x = x * tl.where(keep, inv_keep, 0.0)
        tl.store(XD + rows64[:, None] * stride_xd + cols[None, :], x.to(XD.dtype.element_ty), mask=mask)


# Skinny products of the LoRA branch: one operand is a wide activation tile (x, h or dY: [M, K], any float dtype,
# loaded as stored), the other the small fp32/bf16 factor (A^T, B, xa or g), multiplied by ``_dot.mixed_dot`` without
# a materialised upcast copy. The dropout mask is a 0/1 product on the stored values (exact in any dtype);
# 1 / (1 - p) rides on the final scale.
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


def _dropout_triton(x, seeds, index, p, dtype):
    n_rows, n_cols = x.shape
    xd = _runtime.empty((n_rows, n_cols), dtype=dtype, device=x.device)
    if n_rows and n_cols:
        _dropout_kernel[_grid(n_rows, n_cols)](
            x, xd, seeds, index, x.stride(0), xd.stride(0), n_rows, n_cols, p, 1.0 / (1.0 - p),
            BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4,
        )
    return xd


def _lowrank_add_triton(base, lhs, rhs, scale, out_dtype, seeds, index, p, x):
    n_rows, n_cols = base.shape
    out = base if out_dtype == base.dtype else _runtime.empty((n_rows, n_cols), dtype=out_dtype, device=base.device)
    xd = None if x is None else _runtime.empty((n_rows, n_cols), dtype=lhs.dtype, device=x.device)
    if not (n_rows and n_cols):
        return out, xd
    rank = lhs.shape[1]
    if lhs.shape[1] > 1 and lhs.stride(1) != 1:
        lhs = lhs.contiguous()
    block_r = _runtime.rank_block(rank)
    has_mask = seeds is not None
    _lowrank_add_kernel[_grid(n_rows, n_cols)](
        base, lhs, rhs, out, x if x is not None else base, xd if xd is not None else base,
        seeds if has_mask else base, index,
        base.stride(0), lhs.stride(0), rhs.stride(0), rhs.stride(1), out.stride(0),
        x.stride(0) if x is not None else 0, xd.stride(0) if xd is not None else 0,
        n_rows, n_cols, rank, float(scale), float(p), 1.0 / (1.0 - p) if has_mask else 1.0,
        HAS_MASK=has_mask, WRITE_XD=x is not None,
        BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, BLOCK_R=block_r, num_warps=4,
    )
    return out, xd


def _dot_mode(low_dtype, factor_dtype, precision):
    """DOT_MODE (ops/_dot.py) for a product of a stored activation tile (low_dtype) and a factor tile
    (factor_dtype)."""
    if precision not in ("auto", "ieee"):
        raise ValueError(f"precision must be 'auto' or 'ieee', got {precision!r}")
    if precision == "ieee" or low_dtype == torch.float32:
        return _dot.DOT_IEEE
    if factor_dtype == low_dtype:
        return _dot.DOT_NATIVE
    if low_dtype == torch.bfloat16 and factor_dtype == torch.float32:
        return _dot.DOT_SPLIT3
    return _dot.DOT_IEEE  # fp16 activations with fp32 factors: no exact fp16 split (range), fp32 FMA


def _splits(device, n_tiles, n_inner, block, per_sm):
    """(splits, inner length per split): enough programs to fill the card (a few per SM) when the tile grid alone
    does not; each split a whole number of blocks."""
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


def _skinny_matmul(a, b, scale=1.0, *, out=None, out_dtype=torch.float32, seeds=None, index=0, p=0.0,
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
            _skinny_matmul(a, b[:, r0:r1], scale, out=out[:, r0:r1], seeds=seeds, index=index, p=p,
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
        HAS_MASK=has_mask, DOT_MODE=_dot_mode(a.dtype, b.dtype, precision), UPCAST=_runtime.KERNELS_INTERPRETED,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=_runtime.rank_block(rank), num_warps=num_warps,
    )
    if splits > 1:
        _sum_partials(dest, out)
    return out


def _skinny_tn(lhs, x, scale=1.0, *, out=None, out_dtype=torch.float32, seeds=None, index=0, p=0.0,
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
            _skinny_tn(lhs[:, r0:r1], x, scale, out=out[r0:r1], seeds=seeds, index=index, p=p, precision=precision,
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
        HAS_MASK=has_mask, DOT_MODE=_dot_mode(x.dtype, lhs.dtype, precision), UPCAST=_runtime.KERNELS_INTERPRETED,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=_runtime.rank_block(rank), num_warps=num_warps,
    )
    if splits > 1:
        _sum_partials(dest, out)
    return out


def _torch_mask(seed, shape, p, device):
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    keep = torch.rand(shape, generator=generator, device=device) >= p
    return keep.to(torch.float32) * (1.0 / (1.0 - p))


def _dropout(x, seeds, index, p, impl, dtype):
    """m * x in ``dtype`` for the seed ``seeds[index]`` (the cast to the LoRA dtype rides along: one pass)."""
    if impl == "triton":
        return _dropout_triton(x, seeds, index, p, dtype)
    return (x.float() * _torch_mask(seeds[index], x.shape, p, x.device)).to(dtype)


def _lowrank_add(base, lhs, rhs, scale, out_dtype, impl, seeds=None, index=0, p=0.0, x=None):
    """(cast(base + scale * m * (lhs @ rhs), out_dtype), m * x in lhs's dtype or None); in place into base when
    dtypes allow. lhs [N, R] and rhs [R, K] share one dtype (the LoRA dtype); the sum is formed in promote(base, lhs).
    """
    if seeds is None and x is None and base.dtype == lhs.dtype == out_dtype:
        return base.addmm_(lhs, rhs, alpha=scale), None  # one pass: the GEMM reads and writes base (beta = 1)
    if impl == "triton":
        return _lowrank_add_triton(base, lhs, rhs, scale, out_dtype, seeds, index, p, x)
    wide = torch.promote_types(base.dtype, lhs.dtype)
    term = lhs @ rhs
    xd = None
    if seeds is not None:
        mask = _torch_mask(seeds[index], base.shape, p, base.device)
        term = (term.float() * mask).to(term.dtype)
        if x is not None:
            xd = (x.float() * mask).to(lhs.dtype)
    elif x is not None:
        xd = x.to(lhs.dtype)
    out = torch.add(base.to(wide), term.to(wide), alpha=scale).to(out_dtype)
    if out_dtype == base.dtype:
        return base.copy_(out), xd
    return out, xd


# ---------------------------------------------------------------------------------------------------- dropout API
def dropout_seeds(count: int, device) -> torch.Tensor:
    """The ``count`` dropout seeds an op draws in forward (int64 ``[count]`` on ``device``), one per LoRA projection
    in argument order (linear: 1; qkv: q, k, v; mlp: gate, up, down; projections without LoRA draw none). Drawn from
    torch's generator for ``device``, so resetting that generator's state replays an op's masks."""
    return torch.randint(0, 2**31 - 1, (count,), device=device, dtype=torch.int64)


def dropout_mask(seed, shape, p: float, device) -> torch.Tensor:
    """The scaled dropout mask m = keep / (1 - p) (float32 ``shape`` = ``[rows, in]`` of the projection's input as
    rows) that the current backend draws for ``seed`` (an int or a 1-element tensor)."""
    device = torch.device(device)
    rows, cols = shape
    if _runtime.backend(device) == "triton":
        seeds = torch.as_tensor(seed, dtype=torch.int64, device=device).reshape(1)
        ones = torch.ones((rows, cols), dtype=torch.float32, device=device)
        return _dropout_triton(ones, seeds, 0, float(p), torch.float32)
    return _torch_mask(int(seed), (rows, cols), float(p), device)


# ------------------------------------------------------------------------------------------- shared group passes
class _Meta(NamedTuple):
    """What the autograd nodes need besides tensors."""

    scalings: tuple  # per projection
    p: float  # 0.0 when no dropout is applied (p = 0 or not training)
    compute_dtype: torch.dtype  # frozen matmuls and outputs
    lora_dtype: torch.dtype | None  # LoRA branch
    impl: str


def _skinny_ok(meta, act_dtype):
    """Whether the Triton skinny kernels form the LoRA products of an activation stored in ``act_dtype``: on the
    Triton path when the upcast to the LoRA dtype is exact (one dtype, or PEFT's fp32 adapters under a 16-bit base),
    so reading the stored tile and upcasting in registers is the same product as ``act.to(lora_dtype)``."""
    return meta.impl == "triton" and (act_dtype == meta.lora_dtype or meta.lora_dtype == torch.float32)


def _cat_lora_A(projs, lora, ldt):
    """The lora_A of the projections ``lora`` stacked on the rank dim, in ``ldt``: x is read once for all of them."""
    if len(lora) == 1:
        return projs[lora[0]].lora_A.to(ldt)
    return torch.cat([projs[j].lora_A.to(ldt) for j in lora])


def _group_forward(x2d, projs, meta, seeds, first_seed, add_lowrank=True):
    """Outputs ``[N, out_j]`` (compute dtype) and xa_j of the projections sharing ``x2d``; seeds[first_seed:] are
    theirs. ``add_lowrank=False`` leaves the s xa B^T terms out of the outputs (the caller fuses them)."""
    cdt, ldt = meta.compute_dtype, meta.lora_dtype
    xc = x2d.to(cdt)
    ys = [F.linear(xc, w.to(cdt), None if b is None else b.to(cdt)) for w, _, _, b in projs]
    lora = [j for j, (_, a, _, _) in enumerate(projs) if a is not None]
    xas = [None] * len(projs)
    if not lora:
        return ys, xas
    skinny = _skinny_ok(meta, x2d.dtype)
    if seeds is None:
        a_cat = _cat_lora_A(projs, lora, ldt)
        if skinny and x2d.dtype != ldt:  # x read as stored, upcast in registers: no [N, in] copy in ldt
            xa_cat = _skinny_matmul(x2d, a_cat.T, out_dtype=ldt)
        else:
            xa_cat = x2d.to(ldt) @ a_cat.T  # x read once for every adapter of the group
        start = 0
        for j in lora:
            rank = projs[j].lora_A.shape[0]
            xas[j] = xa_cat[:, start:start + rank]
            start += rank
    else:
        for k, j in enumerate(lora):
            if skinny:  # mask applied in registers: no m*x buffer
                xas[j] = _skinny_matmul(x2d, projs[j].lora_A.to(ldt).T, out_dtype=ldt, seeds=seeds,
                                        index=first_seed + k, p=meta.p)
            else:
                xas[j] = _dropout(x2d, seeds, first_seed + k, meta.p, meta.impl, ldt) @ projs[j].lora_A.to(ldt).T
    if add_lowrank:
        for j in lora:
            _lowrank_add(ys[j], xas[j], projs[j].lora_B.to(ldt).T, meta.scalings[j], cdt, meta.impl)
    return ys, xas


def _group_backward(dys, x2d, xas, projs, meta, seeds, first_seed, needs):
    """(dx in x2d's dtype or None, [[dW, dA, dB, db]] per projection); ``needs`` = [need dx, then per projection
    its 4 flags (weight, lora_A, lora_B, bias)]. The frozen terms first, then per adapter g = s dY B and dB, then
    dA and the low-rank part of dx: x read once for all adapters without dropout, per adapter mask with it."""
    need_x, proj_needs = needs[0], needs[1:]
    dys = [_runtime.as_rows(dy).to(meta.compute_dtype) for dy in dys]
    dx, grads = _frozen_backward(dys, x2d, projs, meta.compute_dtype, need_x, proj_needs)
    lora = [j for j, proj in enumerate(projs) if proj.lora_A is not None]
    if lora:
        gs, g_cat = _lora_g_and_dB(dys, x2d, xas, projs, meta, lora, seeds is None, proj_needs, grads)
        if seeds is None:
            dx = _lora_dA_dx(dx, g_cat, x2d, projs, meta, lora, need_x, proj_needs, grads)
        else:
            dx = _lora_dA_dx_dropout(dx, gs, x2d, projs, meta, lora, seeds, first_seed, need_x, proj_needs, grads)
    return (None if dx is None else dx.to(x2d.dtype)), grads


def _frozen_backward(dys, x2d, projs, cdt, need_x, proj_needs):
    """dx = sum_j dY_j W_j (or None) and per projection [dW, None, None, db] as wanted (full fine-tune, biases)."""
    dx = None
    if need_x:
        for dy, proj in zip(dys, projs):
            dx = dy @ proj.weight.to(cdt) if dx is None else dx.addmm_(dy, proj.weight.to(cdt))
    grads = [[None] * 4 for _ in projs]
    xc = x2d.to(cdt) if any(n[0] for n in proj_needs) else None
    for j, (proj, dy, need) in enumerate(zip(projs, dys, proj_needs)):
        if need[0]:
            grads[j][0] = (dy.T @ xc).to(proj.weight.dtype)
        if need[3]:
            grads[j][3] = dy.sum(0).to(proj.bias.dtype)
    return dx, grads


def _lora_g_and_dB(dys, x2d, xas, projs, meta, lora, stack, proj_needs, grads):
    """g_j = s_j dY_j B_j [N, r_j] per adapter ({j: g_j}) and dB_j = s_j dY_j^T xa_j into ``grads``; with ``stack``
    (no dropout) also g_cat [N, sum r], the g's side by side for the one dA product (None otherwise), each g written
    into its g_cat columns directly. The skinny path reads dY as stored (no [N, out] copy in the LoRA dtype); the
    cuBLAS path scales inside the matmul (:func:`_scaled_product`)."""
    ldt = meta.lora_dtype
    skinny_dy = _skinny_ok(meta, meta.compute_dtype) and meta.compute_dtype != ldt
    g_cat = None
    if stack and len(lora) > 1:
        g_cat = _runtime.empty((x2d.shape[0], sum(projs[j].lora_A.shape[0] for j in lora)), dtype=ldt,
                               device=x2d.device)
    gs, g_col = {}, 0
    for j in lora:
        lora_B, rank, scaling = projs[j].lora_B, projs[j].lora_A.shape[0], meta.scalings[j]
        g_cols = None if g_cat is None else g_cat[:, g_col:g_col + rank]
        g_col += rank
        if skinny_dy:
            gs[j] = _skinny_matmul(dys[j], lora_B.to(ldt), scaling, out=g_cols, out_dtype=ldt)
            if proj_needs[j][2]:  # dB written as [out, r] through a transposed view
                d_b = _runtime.empty(lora_B.shape, dtype=lora_B.dtype, device=lora_B.device)
                grads[j][2] = d_b
                _skinny_tn(xas[j], dys[j], scaling, out=d_b.T)
            continue
        dyl = dys[j].to(ldt)
        gs[j] = _scaled_product(dyl, lora_B.to(ldt), scaling, out=g_cols)
        if proj_needs[j][2]:
            grads[j][2] = _scaled_product(dyl.T, xas[j], scaling).to(lora_B.dtype)
    if stack and g_cat is None:
        g_cat = gs[lora[0]]
    return gs, g_cat


def _scaled_product(a, b, scale, *, out=None):
    """scale * (a @ b) in one matmul (alpha = scale and beta = 0: out's contents are ignored, NaN included); one
    rounding, and on the GPU one launch instead of a matmul and a scaling pass. ``out`` may be a column slice."""
    if out is None:
        out = _runtime.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    return torch.addmm(out, a, b, beta=0, alpha=scale, out=out)


def _lora_dA_dx(dx, g_cat, x2d, projs, meta, lora, need_x, proj_needs, grads):
    """No dropout: dA_cat = g_cat^T x (x read once for every adapter, as stored on the skinny path) split into
    ``grads``; returns dx + g_cat A_cat."""
    ldt = meta.lora_dtype
    if any(proj_needs[j][1] for j in lora):
        if _skinny_ok(meta, x2d.dtype) and x2d.dtype != ldt:
            da_cat = _skinny_tn(g_cat, x2d, out_dtype=ldt)
        else:
            da_cat = g_cat.T @ x2d.to(ldt)
        start = 0
        for j in lora:
            rank = projs[j].lora_A.shape[0]
            if proj_needs[j][1]:
                grads[j][1] = da_cat[start:start + rank].to(projs[j].lora_A.dtype)
            start += rank
    if need_x:
        dx, _ = _lowrank_add(dx, g_cat, _cat_lora_A(projs, lora, ldt), 1.0, meta.compute_dtype, meta.impl)
    return dx


def _lora_dA_dx_dropout(dx, gs, x2d, projs, meta, lora, seeds, first_seed, need_x, proj_needs, grads):
    """With dropout, per adapter j (mask of seeds[first_seed + k]): dA_j = g_j^T (m * x) into ``grads``; returns
    dx + sum_j m * (g_j A_j). The skinny kernels regenerate the mask in registers (no m * x buffer); otherwise one
    low-rank pass adds to dx and writes m * x for dA, the mask drawn once."""
    ldt, cdt = meta.lora_dtype, meta.compute_dtype
    skinny_x = _skinny_ok(meta, x2d.dtype)
    for k, j in enumerate(lora):
        lora_A, index = projs[j].lora_A, first_seed + k
        if skinny_x:
            if need_x:
                dx, _ = _lowrank_add(dx, gs[j], lora_A.to(ldt), 1.0, cdt, meta.impl, seeds, index, meta.p)
            if proj_needs[j][1]:
                grads[j][1] = _skinny_tn(gs[j], x2d, out_dtype=lora_A.dtype, seeds=seeds, index=index, p=meta.p)
            continue
        if need_x:
            dx, xd = _lowrank_add(dx, gs[j], lora_A.to(ldt), 1.0, cdt, meta.impl, seeds, index, meta.p, x2d)
        else:
            xd = _dropout(x2d, seeds, index, meta.p, meta.impl, ldt)
        if proj_needs[j][1]:
            grads[j][1] = (gs[j].T @ xd).to(lora_A.dtype)
    return dx


class _Proj(NamedTuple):
    """One projection's tensors as the autograd nodes take them (LoraWeights without the scaling, in ``_Meta``)."""

    weight: torch.Tensor
    lora_A: torch.Tensor | None
    lora_B: torch.Tensor | None
    bias: torch.Tensor | None


def _unflatten(tensors):
    return [_Proj(*tensors[i:i + 4]) for i in range(0, len(tensors), 4)]


def _proj_needs(ctx_needs, first, count):
    """Per projection, its 4 ``needs_input_grad`` flags (weight, lora_A, lora_B, bias), from index ``first`` on."""
    return [tuple(ctx_needs[first + 4 * j:first + 4 * j + 4]) for j in range(count)]


def _no_autocast(device):
    return torch.autocast(device_type=device.type, enabled=False)


# ------------------------------------------------------------------------------------------------ autograd nodes
class LoraGroupFunction(torch.autograd.Function):
    """Autograd node of :func:`lora_linear` and :func:`lora_qkv`: projections of one x (4 tensors each).

    Saves x (as rows), every xa ``[N, r]`` and the dropout seeds; dtypes are resolved by the caller (autocast is
    applied through ``meta``, so the body runs with autocast off)."""

    @staticmethod
    def forward(ctx, meta, x, *tensors):
        x2d = _runtime.as_rows(x)
        projs = _unflatten(tensors)
        n_lora = sum(a is not None for _, a, _, _ in projs)
        seeds = dropout_seeds(n_lora, x.device) if meta.p > 0 and n_lora else None
        with _no_autocast(x.device):
            ys, xas = _group_forward(x2d, projs, meta, seeds, 0)
        ctx.save_for_backward(x2d, seeds, *tensors, *xas)
        ctx.meta, ctx.count, ctx.x_shape = meta, len(projs), x.shape
        return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in ys)

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, *dys):
        saved = ctx.saved_tensors
        count = ctx.count
        x2d, seeds = saved[0], saved[1]
        projs = _unflatten(saved[2:2 + 4 * count])
        xas = saved[2 + 4 * count:]
        with _no_autocast(x2d.device):
            needs = [ctx.needs_input_grad[1]] + _proj_needs(ctx.needs_input_grad, 2, count)
            dx, grads = _group_backward(dys, x2d, xas, projs, ctx.meta, seeds, 0, needs)
        return (None, None if dx is None else dx.view(ctx.x_shape), *[g for four in grads for g in four])


class LoraMLPFunction(torch.autograd.Function):
    """Autograd node of :func:`lora_mlp`. Saves x (as rows), the gate and up outputs, the xa's and the seeds; h is
    recomputed in backward and the GLU backward overwrites the saved gate/up buffers with d_gate/d_up."""

    @staticmethod
    def forward(ctx, meta_gu, meta_down, activation, x, *tensors):
        x2d = _runtime.as_rows(x)
        projs = _unflatten(tensors)
        n_lora = sum(a is not None for _, a, _, _ in projs)
        seeds = dropout_seeds(n_lora, x.device) if meta_gu.p > 0 and n_lora else None
        n_gu_lora = sum(a is not None for _, a, _, _ in projs[:2])
        # Triton path with adapters on gate and up: their B terms are added inside the GLU pass (one pass over
        # gate/up instead of a low-rank add per projection and then the GLU)
        fuse = meta_gu.impl == "triton" and projs[0].lora_A is not None and projs[1].lora_A is not None
        with _no_autocast(x.device):
            (gate, up), xas_gu = _group_forward(x2d, projs[:2], meta_gu, seeds, 0, add_lowrank=not fuse)
            if fuse:
                ldt = meta_gu.lora_dtype
                h = glu_forward_lowrank(gate, up, xas_gu[0], projs[0].lora_B.to(ldt), meta_gu.scalings[0],
                                        xas_gu[1], projs[1].lora_B.to(ldt), meta_gu.scalings[1], activation)
            else:
                h = glu_forward(gate, up, activation)
            (y,), xas_down = _group_forward(h, projs[2:], meta_down, seeds, n_gu_lora)
        del h  # recomputed in backward
        ctx.save_for_backward(x2d, gate, up, seeds, *tensors, *xas_gu, *xas_down)
        ctx.metas, ctx.activation, ctx.x_shape, ctx.n_gu_lora = (meta_gu, meta_down), activation, x.shape, n_gu_lora
        ctx.used = False
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, dy):
        if ctx.used:
            raise RuntimeError("lora_mlp's backward overwrites its saved activations and cannot run twice "
                               "(retain_graph=True is not supported)")
        ctx.used = True
        x2d, gate, up, seeds, *rest = ctx.saved_tensors
        projs = _unflatten(rest[:12])
        xas = rest[12:]
        meta_gu, meta_down = ctx.metas
        needs = ctx.needs_input_grad
        with _no_autocast(x2d.device):
            h = glu_forward(gate, up, ctx.activation)
            down_needs = [True] + _proj_needs(needs, 12, 1)  # dh is always needed: it feeds gate/up
            dh, (down_grads,) = _group_backward([dy], h, xas[2:], projs[2:], meta_down, seeds, ctx.n_gu_lora,
                                                down_needs)
            del h
            d_gate, d_up = glu_backward(dh.to(gate.dtype), gate, up, ctx.activation, inplace=True)
            del dh
            gu_needs = [needs[3]] + _proj_needs(needs, 4, 2)
            dx, gu_grads = _group_backward([d_gate, d_up], x2d, xas[:2], projs[:2], meta_gu, seeds, 0, gu_needs)
        grads = [g for four in (*gu_grads, down_grads) for g in four]
        return (None, None, None, None if dx is None else dx.view(ctx.x_shape), *grads)


# ------------------------------------------------------------------------------------------------ validation
def _check_projection(name, proj, in_features, device):
    """Validate one LoraWeights against x's last dim; return it as a tuple of 4 tensors plus scaling."""
    if not isinstance(proj, LoraWeights):
        if isinstance(proj, tuple) and len(proj) in (4, 5):
            proj = LoraWeights(*proj)
        else:
            raise ValueError(f"{name.rstrip('.') or 'the projection'} must be a LoraWeights(weight, lora_A, lora_B, "
                             f"scaling, bias), got {type(proj).__name__}")
    weight, lora_A, lora_B, scaling, bias = proj
    _runtime.check_tensor(f"{name}weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"{name}weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    out_features = weight.shape[0]
    _runtime.check_shape(f"{name}weight", weight, (out_features, in_features), "[out, in] with in = x's last dim")
    if out_features == 0 or in_features == 0:
        raise ValueError(f"{name}weight must have out >= 1 and in >= 1 (x's last dim), got shape "
                         f"{tuple(weight.shape)}")
    if (lora_A is None) != (lora_B is None):
        raise ValueError(f"{name}lora_A and {name}lora_B must both be tensors or both be None")
    if lora_A is not None:
        _runtime.check_tensor(f"{name}lora_A", lora_A)
        _runtime.check_tensor(f"{name}lora_B", lora_B)
        if lora_A.dim() != 2 or lora_A.shape[0] < 1:
            raise ValueError(f"{name}lora_A must be 2-D [r, in] with r >= 1, got shape {tuple(lora_A.shape)}")
        rank = lora_A.shape[0]
        if lora_A.shape[1] != in_features:
            raise ValueError(f"{name}lora_A must have shape (r, {in_features}) ([r, in] with in = x's last dim, PEFT's "
                             f"layout), got {tuple(lora_A.shape)}")
        _runtime.check_shape(f"{name}lora_B", lora_B, (out_features, rank), "[out, r] with out = weight's rows")
        if lora_A.dtype != lora_B.dtype:
            raise ValueError(f"{name}lora_A and {name}lora_B must share a dtype, got {lora_A.dtype} and "
                             f"{lora_B.dtype}")
        scaling = _runtime.check_real(f"{name}scaling", scaling)
    if bias is not None:
        _runtime.check_tensor(f"{name}bias", bias)
        _runtime.check_shape(f"{name}bias", bias, (out_features,), "[out] with out = weight's rows")
    for label, t in (("weight", weight), ("lora_A", lora_A), ("lora_B", lora_B), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(f"all tensors must be on one device: x on {device}, {name}{label} on {t.device}")
    return (weight, lora_A, lora_B, bias), float(scaling) if lora_A is not None else 0.0


def _check_x(x):
    _runtime.check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., in], got a 0-dim tensor")


def _check_dropout(dropout):
    return _runtime.check_real("dropout", dropout, low=0.0, high=1.0, high_open=True, expected="a float in [0, 1)")


def _meta(names, checked, x, dropout, training):
    """One _Meta for projections sharing an input: they must share the weight dtype and the LoRA dtype."""
    if not isinstance(training, bool):
        raise ValueError(f"training must be True or False, got {training!r}")
    autocast = _runtime.autocast_dtype(x.device)
    weight_dtypes = {t[0][0].dtype for t in checked}
    if len(weight_dtypes) > 1:
        raise ValueError(f"{', '.join(names)} weights must share a dtype, got {sorted(map(str, weight_dtypes))}")
    lora_dtypes = {t[0][1].dtype for t in checked if t[0][1] is not None}
    if len(lora_dtypes) > 1:
        raise ValueError(f"{', '.join(names)} adapters must share a dtype, got {sorted(map(str, lora_dtypes))}")
    compute = autocast or weight_dtypes.pop()
    lora = (autocast or lora_dtypes.pop()) if lora_dtypes else None
    p = dropout if training and lora is not None else 0.0
    return _Meta(tuple(t[1] for t in checked), p, compute, lora, _runtime.backend(x.device))


# ------------------------------------------------------------------------------------------------------- API
def lora_linear(x, weight, lora_A, lora_B, scaling, bias=None, *, dropout=0.0, training=True):
    """y = x W^T + b + s ((m*x) A^T) B^T with gradients for x, lora_A, lora_B, bias (and W if it requires grad).

    Args:
        x: ``[..., in]`` float32/float16/bfloat16.
        weight: ``[out, in]`` frozen weight (a gradient is returned only when it requires grad).
        lora_A: ``[r, in]``, lora_B: ``[out, r]`` (PEFT layout, one dtype; both None: plain linear).
        scaling: s, a finite real number (alpha/r, rsLoRA alpha/sqrt(r), ...).
        bias: ``[out]`` or None.
        dropout: p in [0, 1) applied to the LoRA branch's input (PEFT's ``lora_dropout``); only when ``training``
            (a bool).

    Returns:
        ``y [..., out]`` in the compute dtype: weight's dtype, or autocast's under ``torch.autocast`` (PEFT/HF's).
        The frozen matmul runs in that dtype, the LoRA branch in lora_A's (autocast's), summed in the promoted dtype.

    Raises:
        ValueError: shapes that do not match or are empty (the message names the argument), non-float dtypes,
            lora_A/lora_B of different dtypes, tensors on different devices, dropout outside [0, 1), a scaling that
            is not a finite number, a training flag that is not a bool.

    Source: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; PEFT
    ``peft/tuners/lora/layer.py`` ``Linear.forward``; the derivation is in this module's docstring.
    """
    return _lora_group(x, [("", LoraWeights(weight, lora_A, lora_B, scaling, bias))], dropout, training)[0]


def _lora_group(x, named, dropout, training):
    _check_x(x)
    dropout = _check_dropout(dropout)
    checked = [_check_projection(name, proj, x.shape[-1], x.device) for name, proj in named]
    meta = _meta([name.rstrip(".") or "the" for name, _ in named], checked, x, dropout, training)
    flat = [t for tensors, _ in checked for t in tensors]
    return LoraGroupFunction.apply(meta, x, *flat)


def lora_qkv(x, q, k, v, *, dropout=0.0, training=True):
    """The q, k, v projections of one x in one autograd node: ``(q_out, k_out, v_out)``.

    Args:
        x: ``[..., H]`` float32/float16/bfloat16.
        q, k, v: :class:`LoraWeights` with weights ``[out_j, H]`` of one dtype; adapters of one dtype (or None for a
            plain frozen projection); Qwen2-style biases allowed.
        dropout, training: as :func:`lora_linear`; one independent mask per projection (seeds in order q, k, v).

    Returns:
        ``q_out [..., out_q]``, ``k_out [..., out_k]``, ``v_out [..., out_v]``, each exactly :func:`lora_linear`'s
        value for that projection. x is saved once and dX accumulates in one buffer.

    Raises:
        ValueError: as :func:`lora_linear` (naming ``q.weight``, ``k.lora_A``, ...), and q/k/v weights or adapters
            of different dtypes.

    Source: three PEFT ``lora.Linear.forward`` calls on one input (HF attention's q/k/v projections).
    """
    return tuple(_lora_group(x, [("q.", q), ("k.", k), ("v.", v)], dropout, training))


def lora_mlp(x, gate, up, down, *, activation="swiglu", dropout=0.0, training=True):
    """y = down(act(gate(x)) * up(x)), each projection a LoRA linear (HF LlamaMLP / GemmaMLP under PEFT).

    Args:
        x: ``[..., H]`` float32/float16/bfloat16.
        gate, up: :class:`LoraWeights` with weights ``[I, H]``; down: weights ``[H_out, I]``.
        activation: ``"swiglu"`` (silu, Llama/Qwen/Mistral), ``"geglu_tanh"`` (gelu tanh, Gemma),
            ``"geglu_erf"`` (exact gelu).
        dropout, training: as :func:`lora_linear`; one mask per projection (seeds in order gate, up, down).

    Returns:
        ``y [..., H_out]`` in down's compute dtype. Saves x, gate and up outputs and ``[N, r]`` terms only.

    Raises:
        ValueError: shape mismatches (naming e.g. ``down.weight``), dtypes, devices, unknown activation, dropout
            outside [0, 1), a scaling that is not a finite number, a training flag that is not a bool.
        RuntimeError: a second backward through one forward (``retain_graph=True``): the backward overwrites the
            saved gate/up outputs with their gradients, which is how the block saves no extra [N, I] buffer.

    Source: HF ``LlamaMLP.forward`` / ``GemmaMLP.forward`` with PEFT ``lora.Linear`` projections; the GLU backward
    is :mod:`leantune.ops.glu`'s.
    """
    _check_x(x)
    dropout = _check_dropout(dropout)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    gu = [_check_projection(name, proj, x.shape[-1], x.device) for name, proj in (("gate.", gate), ("up.", up))]
    if gu[0][0][0].shape[0] != gu[1][0][0].shape[0]:
        raise ValueError(f"gate.weight and up.weight must have the same rows (intermediate size), got "
                         f"{gu[0][0][0].shape[0]} and {gu[1][0][0].shape[0]}")
    dn = [_check_projection("down.", down, gu[0][0][0].shape[0], x.device)]
    meta_gu = _meta(["gate", "up"], gu, x, dropout, training)
    meta_down = _meta(["down"], dn, x, dropout, training)
    if meta_gu.p != meta_down.p:  # one of the groups has no adapters: one dropout flag for the whole node
        p = max(meta_gu.p, meta_down.p)
        meta_gu, meta_down = meta_gu._replace(p=p), meta_down._replace(p=p)
    flat = [t for tensors, _ in (*gu, *dn) for t in tensors]
    return LoraMLPFunction.apply(meta_gu, meta_down, activation, x, *flat)
