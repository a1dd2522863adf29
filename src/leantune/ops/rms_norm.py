r"""RMSNorm with a hand-derived backward that also returns the weight gradient.

Forward (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), per row x of width H, in fp32:

    rstd  = 1 / sqrt(mean(x^2) + eps)
    x_hat = x * rstd
    llama:  y = w * cast(x_hat, x.dtype)                 (HF LlamaRMSNorm; y's dtype is promote(w, x), as HF's)
    gemma:  y = cast(x_hat * (offset + float(w)), x.dtype)   (HF Gemma/Gemma2/Gemma3 RMSNorm, offset = 1)
    weight None: y = cast(x_hat, x.dtype)

Backward. With g = dy * w_eff (w_eff = w, offset + w, or 1), the chain rule through x_hat = x * rstd gives

    dx = rstd * (g - x_hat * mean(g * x_hat))
    dw = sum over rows of dy * x_hat       (llama: x_hat rounded to x.dtype first, as HF's graph has it)

Saved for backward: x and the per-row rstd (fp32, 4 bytes a row); x_hat is recomputed in registers. dw is reduced
in fp32: each program of the backward kernel loops over a block of rows and keeps its partial sum in registers,
writes one fp32 row of partials, and one small reduction over programs finishes it. (Returning dw matters: norm
weights are trainable parameters, and a kernel that drops their gradient silently freezes them.)

FP8 side output (``fp8_out=True``): the forward kernel also writes y quantised per row for an e4m3 GEMM that reads
it (q/k/v or gate/up on an FP8 base, :mod:`leantune.ops.fp8`): s = max(absmax(y) / 448, 2^-126), q = e4m3(y / s) of
y as stored (rounded to its dtype first), from the row already in registers: one more reduction and 1 B + 4 B per
row written, instead of a separate pass that reads y again (2 B bf16) and writes the same. Not differentiable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch, _runtime
from ._fp8_rows import store_row_quantisation, stored_fp32
from .fp8 import E4M3, _quantize_rows_torch

CASTINGS = ("llama", "gemma")
MAX_HIDDEN = 65536  # one row per program in registers


# ------------------------------------------------------------------------------------------------------ kernels
@_launch.bound
@triton.jit(do_not_specialize=["fp8_out"])
def _rms_norm_forward_kernel(
    X, W, Y, RSTD, Q, S,
    stride_x, stride_y, n_rows, n_cols, eps, offset, fp8_out,
    HAS_WEIGHT: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    # fp8_out is a runtime 0/1, not specialised: with and without the side output it is one binary, so y and rstd
    # are bit for bit the same either way (a constexpr gave the FP8 variant its own layouts and reduction order: 1 ulp
    # apart on the card). An int, as the interpreter cannot take a bool argument.
    # A [ROWS, BLOCK] tile per program: more bytes in flight per program when rows are short.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    x_hat = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        if GEMMA:
            y = x_hat * (offset + w)
        else:
            y = x_hat.to(X.dtype.element_ty).to(tl.float32) * w
    else:
        y = x_hat
    y = y.to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    if fp8_out:  # quantize_rows(y) of y as stored: the row is in registers, its absmax one more reduction
        store_row_quantisation(Q, S, stored_fp32(y), rows, cols, row_mask, mask, n_cols)


@_launch.bound
@triton.jit
def _rms_norm_backward_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dx, n_rows, n_cols, offset, blocks_per_program,
    HAS_WEIGHT: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GEMMA:
            w = w + offset
    dw_partial = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(0, blocks_per_program, num_stages=NUM_STAGES):
        rows = (pid * blocks_per_program + i).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows  # the last program's tail rows load zeros and store nothing
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
        x_hat = x * rstd
        if HAS_WEIGHT:
            g = dy * w
            if GEMMA:
                dw_partial += tl.sum(dy * x_hat, axis=0)
            else:
                dw_partial += tl.sum(dy * x_hat.to(X.dtype.element_ty).to(tl.float32), axis=0)
        else:
            g = dy
        c = tl.sum(g * x_hat, axis=1)[:, None] / n_cols
        dx = rstd * (g - x_hat * c)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw_partial, mask=col_mask)


# ----------------------------------------------------------------------------------------------------- launchers
def _tile_rows(n_cols: int) -> int:
    """Rows per tile: ~4K elements per program so short rows still keep enough loads in flight."""
    return max(1, min(16, 4096 // _runtime.next_power_of_2(n_cols)))


def _forward_triton(x, weight, eps, offset, gemma, out_dtype, fp8_out=False, *, rows=None, num_warps=None):
    """(y, rstd, (codes, scales) with ``fp8_out`` else None)."""
    n_rows, n_cols = x.shape
    y = _runtime.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    rstd = _runtime.empty((n_rows,), dtype=torch.float32, device=x.device)
    quantized = None
    if fp8_out:
        quantized = (_runtime.empty((n_rows, n_cols), dtype=E4M3, device=x.device),
                     _runtime.empty((n_rows,), dtype=torch.float32, device=x.device))
    if n_rows == 0:
        return y, rstd, quantized
    block = _runtime.next_power_of_2(n_cols)
    rows = rows or _tile_rows(n_cols)
    _rms_norm_forward_kernel[(_runtime.cdiv(n_rows, rows),)](
        x, weight if weight is not None else x, y, rstd,
        # without the side output Q and S alias rstd with the codes' and scales' dtypes: the same signature
        quantized[0].view(torch.uint8) if fp8_out else rstd.view(torch.uint8), quantized[1] if fp8_out else rstd,
        x.stride(0), y.stride(0), n_rows, n_cols, eps, offset, int(fp8_out),
        HAS_WEIGHT=weight is not None, GEMMA=gemma, BLOCK=block, ROWS=rows,
        num_warps=num_warps or _runtime.num_warps_for(block * rows),
    )
    return y, rstd, quantized


def _backward_triton(dy, x, weight, rstd, offset, gemma, *, rows=None, num_warps=None, per_sm=1, num_stages=1):
    n_rows, n_cols = x.shape
    dx = _runtime.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, None if weight is None else torch.zeros_like(weight)
    block = _runtime.next_power_of_2(n_cols)
    # Measured on the H200 at 16384x4096 bf16: [4, 4096] tiles, 8 warps, one program per SM was fastest (0.124 ms).
    rows = rows or max(1, min(16, 16384 // block))
    n_blocks = _runtime.cdiv(n_rows, rows)
    programs = _runtime.persistent_programs(x.device, n_blocks, per_sm=per_sm)
    blocks_per_program = _runtime.cdiv(n_blocks, programs)
    dw_partial = None
    if weight is not None:
        dw_partial = _runtime.empty((programs, n_cols), dtype=torch.float32, device=x.device)
    _rms_norm_backward_kernel[(programs,)](
        dy, x, weight if weight is not None else x, rstd, dx, dw_partial if dw_partial is not None else rstd,
        dy.stride(0), x.stride(0), dx.stride(0), n_rows, n_cols, offset, blocks_per_program,
        HAS_WEIGHT=weight is not None, GEMMA=gemma, BLOCK=block, ROWS=rows, NUM_STAGES=num_stages,
        num_warps=num_warps or (8 if block * rows <= 16384 else 16),
    )
    dw = None if weight is None else dw_partial.sum(0, dtype=torch.float32).to(weight.dtype)
    return dx, dw


def _forward_torch(x, weight, eps, offset, gemma, out_dtype, fp8_out=False):
    x_f32 = x.float()
    rstd = torch.rsqrt(x_f32.pow(2).mean(-1) + eps)
    x_hat = x_f32 * rstd[:, None]
    if weight is None:
        y = x_hat.to(x.dtype)
    elif gemma:
        y = (x_hat * (offset + weight.float())).to(x.dtype)
    else:
        y = (weight * x_hat.to(x.dtype)).to(out_dtype)
    return y, rstd, _quantize_rows_torch(y) if fp8_out else None


def _backward_torch(dy, x, weight, rstd, offset, gemma):
    x_hat = x.float() * rstd[:, None]
    dy_f32 = dy.float()
    dw = None
    if weight is None:
        g = dy_f32
    elif gemma:
        g = dy_f32 * (offset + weight.float())
        dw = (dy_f32 * x_hat).sum(0).to(weight.dtype)
    else:
        g = dy_f32 * weight.float()
        dw = (dy_f32 * x_hat.to(x.dtype).float()).sum(0).to(weight.dtype)
    dx = rstd[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw


# ------------------------------------------------------------------------------------------------ autograd + API
class RMSNormFunction(torch.autograd.Function):
    """Autograd node of :func:`rms_norm`; saves x (as rows) and rstd [rows] fp32. With ``fp8_out`` it also returns
    the e4m3 codes and scales of y (non-differentiable: backward ignores their incoming gradients)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, gemma, fp8_out=False):
        if weight is not None and not weight.is_contiguous():  # the kernels read w[col] at unit stride
            weight = weight.contiguous()
        x2d = _runtime.as_rows(x)
        impl = _runtime.backend(x.device)
        if weight is None or gemma:
            out_dtype = x.dtype
        else:
            out_dtype = torch.promote_types(weight.dtype, x.dtype)
        forward = _forward_triton if impl == "triton" else _forward_torch
        y, rstd, quantized = forward(x2d, weight, eps, offset, gemma, out_dtype, fp8_out)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.impl, ctx.offset, ctx.gemma, ctx.x_shape = impl, offset, gemma, x.shape
        # not a view of y's rows: HF code may modify a norm's output in place (OLMoE's clip_qkv clamps q_norm's),
        # which autograd forbids on a view made inside a Function; y is not saved, so nothing here sees the change
        y = _runtime.distinct_output(_runtime.reshaped_output(y, x.shape))
        if quantized is None:
            return y
        ctx.mark_non_differentiable(*quantized)
        return y, *quantized

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, dy, *_quantized_grads):
        x2d, weight, rstd = ctx.saved_tensors
        dy2d = _runtime.as_rows(dy)
        backward = _backward_triton if ctx.impl == "triton" else _backward_torch
        dx, dw = backward(dy2d, x2d, weight, rstd, ctx.offset, ctx.gemma)
        if weight is not None and not ctx.needs_input_grad[1]:
            dw = None
        return dx.view(ctx.x_shape), dw, None, None, None, None


def rms_norm(x, weight=None, eps=1e-6, *, offset=0.0, casting="llama", fp8_out=False):
    """Root-mean-square normalisation of the last dim, with gradients for ``x`` and ``weight``.

    Args:
        x: ``[..., H]`` float32/float16/bfloat16, any strides.
        weight: ``[H]`` float tensor or None (no scale).
        eps: added to mean(x^2) before the square root.
        offset: ``casting="gemma"`` only: the scale is ``offset + weight`` formed in fp32 (Gemma passes 1.0).
        casting: ``"llama"`` (HF LlamaRMSNorm, Mistral, Qwen2/3: ``weight * x_hat.to(x.dtype)``) or ``"gemma"``
            (HF Gemma RMSNorm: ``(x_hat * (offset + weight.float())).to(x.dtype)``).
        fp8_out: also return y quantised per row for an FP8 GEMM that reads it (``lora_qkv``/``lora_mlp``/
            ``lora_linear``'s ``x_quantized``): on the Triton path written by the same kernel pass from the row in
            registers (no separate quantisation pass over y); on the torch path ``quantize_rows`` of y.

    Returns:
        ``y`` of x's shape; dtype ``promote(weight, x)`` for llama with a weight (as HF), else ``x.dtype``. With
        ``fp8_out``: ``(y, (codes, scales))``, codes ``float8_e4m3fn [rows, H]`` (rows = x's leading dims
        flattened) and scales fp32 ``[rows]``, bit for bit :func:`~leantune.ops.fp8.quantize_rows` of y as stored
        (s = max(absmax / 448, 2^-126), :mod:`leantune.ops.fp8`; NaN/inf in y propagate as there). They carry no
        gradient; y's backward is unchanged.

    Raises:
        ValueError: non-float or unsupported dtype, weight not ``[H]``, tensors on different devices, unknown
            ``casting``, ``offset`` not a finite number or non-zero with ``casting="llama"`` or without a weight, eps
            negative or not finite, H = 0 or > 65536, or ``fp8_out`` not a bool.
        RuntimeError: ``LEANTUNE_BACKEND=triton`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _runtime.check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., H], got a 0-dim tensor")
    eps = _runtime.check_real("eps", eps, low=0.0)
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    offset = _runtime.check_real("offset", offset)
    if casting == "llama" and offset != 0.0:
        raise ValueError(f"offset must be 0 with casting='llama' (use casting='gemma' for 1 + w), got {offset}")
    if weight is None and offset != 0.0:
        raise ValueError(f"offset must be 0 without a weight (the scale is offset + weight), got {offset}")
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError(f"x's last dim (the normalised one) must be >= 1, got shape {tuple(x.shape)}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"x's last dim must be <= {MAX_HIDDEN}, got {hidden}")
    if weight is not None:
        _runtime.check_tensor("weight", weight)
        _runtime.check_shape("weight", weight, (hidden,), "x's last dim")
    _runtime.check_same_device(x=x, weight=weight)
    if not isinstance(fp8_out, bool):
        raise ValueError(f"fp8_out must be True or False, got {fp8_out!r}")
    _runtime.backend(x.device)  # raise configuration errors before any work
    if not fp8_out:
        return RMSNormFunction.apply(x, weight, eps, offset, casting == "gemma")
    y, codes, scales = RMSNormFunction.apply(x, weight, eps, offset, casting == "gemma", True)
    return y, (codes, scales)
