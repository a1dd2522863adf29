"""Triton device function shared by kernels that multiply a stored activation tile by a small factor tile.

``mixed_dot(acc, lhs, rhs, LOW_LEFT, DOT_MODE, UPCAST)`` returns acc + lhs @ rhs in fp32 without a materialised
upcast copy of the wide operand (the LoRA skinny products in lora.py, the gate/up low-rank adds in glu.py):

- DOT_MODE 0: both tiles upcast to fp32, IEEE dot (exact fp32 FMA; fp32 factors, or fp16 activations).
- DOT_MODE 1: low tile bf16, factor fp32. The factor is split into three bf16 parts hi + mid + lo that sum to it
  exactly (8 + 8 + 8 mantissa bits); every bf16 x bf16 product is exact in fp32, so three bf16 tensor-core dots with
  fp32 accumulation give the fp32 product up to summation order.
- DOT_MODE 2: both tiles of one 16-bit dtype: one native dot with fp32 accumulation.
- DOT_MODE 3: both tiles upcast to fp32, three TF32 tensor-core dots (Triton's ``tf32x3``: each operand split into a
  TF32 head and a TF32 tail, head x head + head x tail + tail x head): relative error ~2^-21 of sum |lhs||rhs| per
  product against fp32 FMA's 2^-24. For fp32 x fp32 products that are added to a 16-bit value and rounded to it
  (:func:`fp32_product_mode`), where the difference is ~2^-12 of the final rounding; the FMA dot of mode 0 left the
  LoRA MLP's fused gate/up pass compute-bound (benchmarks/RESULTS.md, 2026-12-04 eleventh session; the plain
  low-rank add keeps mode 0, faster there). The interpreter computes it as an fp32 product.
- DOT_MODE 4: both tiles upcast to fp32, one TF32 dot (relative error ~2^-11): the MoE grouped GEMMs' fp32 x fp32
  products stored in 16 bits (:mod:`leantune.ops.moe_kernels`).

UPCAST (set under Triton's interpreter, whose bf16 dot is garbage) feeds the dots fp32 copies of the same parts.
"""

import torch
import triton
import triton.language as tl

# DOT_MODE values, for the launchers (the kernels compare against the literals)
DOT_IEEE, DOT_SPLIT3, DOT_NATIVE, DOT_TF32X3, DOT_TF32 = 0, 1, 2, 3, 4


def dot_mode(low_dtype: torch.dtype, factor_dtype: torch.dtype, precision: str = "auto") -> int:
    """DOT_MODE for a product of a stored activation tile (``low_dtype``) and a factor tile (``factor_dtype``);
    ``precision="ieee"`` forces exact fp32 FMA. Raises ValueError for any other precision."""
    if precision not in ("auto", "ieee"):
        raise ValueError(f"precision must be 'auto' or 'ieee', got {precision!r}")
    if precision == "ieee" or low_dtype == torch.float32:
        return DOT_IEEE
    if factor_dtype == low_dtype:
        return DOT_NATIVE
    if low_dtype == torch.bfloat16 and factor_dtype == torch.float32:
        return DOT_SPLIT3
    return DOT_IEEE  # fp16 activations with fp32 factors: no exact fp16 split (range), fp32 FMA


def fp32_product_mode(out_dtype: torch.dtype) -> int:
    """DOT_MODE for an fp32 x fp32 product added to a value stored in ``out_dtype``: ``tf32x3`` when the sum is
    rounded to 16 bits (mode 3: its error is far below that rounding), exact fp32 FMA for an fp32 store."""
    return DOT_TF32X3 if out_dtype in (torch.float16, torch.bfloat16) else DOT_IEEE


@triton.jit
def split3(w):
    """fp32 w as bf16 parts hi + mid + lo with hi + mid + lo == w exactly."""
    hi = w.to(tl.bfloat16)
    rem = w - hi.to(tl.float32)
    mid = rem.to(tl.bfloat16)
    lo = (rem - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def mixed_dot(acc, lhs, rhs, LOW_LEFT: tl.constexpr, DOT_MODE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + lhs @ rhs in fp32; the low-precision tile is lhs when LOW_LEFT, else rhs (the other is the factor)."""
    if DOT_MODE == 0:
        acc = tl.dot(lhs.to(tl.float32), rhs.to(tl.float32), acc, input_precision="ieee")
    elif DOT_MODE == 3:
        acc = tl.dot(lhs.to(tl.float32), rhs.to(tl.float32), acc, input_precision="tf32x3")
    elif DOT_MODE == 4:
        acc = tl.dot(lhs.to(tl.float32), rhs.to(tl.float32), acc, input_precision="tf32")
    elif DOT_MODE == 1:
        if LOW_LEFT:
            hi, mid, lo = split3(rhs.to(tl.float32))
            low = lhs
        else:
            hi, mid, lo = split3(lhs.to(tl.float32))
            low = rhs
        if UPCAST:
            low = low.to(tl.float32)
            hi, mid, lo = hi.to(tl.float32), mid.to(tl.float32), lo.to(tl.float32)
        if LOW_LEFT:  # smallest part first
            acc = tl.dot(low, lo, acc)
            acc = tl.dot(low, mid, acc)
            acc = tl.dot(low, hi, acc)
        else:
            acc = tl.dot(lo, low, acc)
            acc = tl.dot(mid, low, acc)
            acc = tl.dot(hi, low, acc)
    else:
        if UPCAST:
            acc = tl.dot(lhs.to(tl.float32), rhs.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(lhs, rhs, acc)
    return acc
