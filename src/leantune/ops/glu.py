r"""SwiGLU / GeGLU: the gated MLP activation h = act(gate) * up, with a hand-derived backward.

Forward (Shazeer 2020, "GLU Variants Improve Transformer"; HF ``LlamaMLP``/``GemmaMLP``:
``act_fn(gate_proj(x)) * up_proj(x)``), elementwise, in fp32, rounded once to ``promote(gate, up)``:

    swiglu:      act(g) = silu(g) = g * s,                 s = sigmoid(g)          (Llama, Mistral, Qwen)
    geglu_tanh:  act(g) = 0.5 g (1 + tanh(u)) = g * t,     u = k (g + c g^3), t = sigmoid(2u)
                                                                       (Gemma: gelu_pytorch_tanh)
    geglu_erf:   act(g) = 0.5 g (1 + erf(g / sqrt 2)) = g * P,  P = Phi(g) = 0.5 erfc(-g / sqrt 2), the normal CDF
                                                                                          (torch's exact GELU)
    h = act(g) * u_p                     (u_p: the ``up`` input; k = sqrt(2/pi), c = 0.044715)

The tanh form uses the identity 0.5 (1 + tanh(u)) = sigmoid(2u) (Hendrycks & Gimpel 2016 state the tanh form), which
needs no tanh instruction and stays accurate where tanh(u) is near -1; likewise Phi is formed from erfc, so neither
form loses precision to 1 + (nearly -1) for negative gates (torch's fp32 expressions do, HF's bf16 ones then round).

Backward. h is linear in u_p, and act depends on g only, so with dh the incoming gradient

    d_up   = dh * act(g)
    d_gate = dh * u_p * act'(g)

where (product rule on g * sigmoid(.), sigmoid' = s (1 - s), Phi' = phi = exp(-g^2/2) / sqrt(2 pi)):

    silu'(g)       = s + g s (1 - s)                    = s (1 + g (1 - s))
    gelu_tanh'(g)  = t + g t (1 - t) * 2 u'(g)          with 2 u'(g) = 2 k (1 + 3 c g^2)
                   (= 0.5 (1 + tanh u) + 0.5 g (1 - tanh^2 u) k (1 + 3 c g^2), the textbook form)
    gelu_erf'(g)   = Phi(g) + g phi(g)                  = 0.5 (1 + erf(g / sqrt 2)) + g exp(-g^2 / 2) / sqrt(2 pi)

Saved for backward: gate and up only (the inputs, no copies); sigmoid, erfc and exp are recomputed in registers. The
Triton kernels are purely bandwidth bound (fwd reads 2, writes 1 tensor; bwd reads 3, writes 2): each program handles
one block of ``BLOCK`` elements, of the flattened tensors when they are contiguous, else of one row of ``[rows, I]``
views (e.g. gate/up as the two halves of a fused gate_up projection, no copy). Offsets are int64, so tensors of more
than 2^31 elements work. Differences from HF's eager expression: HF rounds act(g) to the model dtype, then rounds the
product again; we round once, so we are at least as close to the exact value.

``glu_forward``/``glu_backward`` are the autograd-free entry points for fused callers (the LoRA MLP, whose fused
low-rank forward :mod:`leantune.ops.lora.glu_lowrank` reuses ``glu_activation`` and ``check_inputs``);
``glu_backward(..., inplace=True)`` writes d_gate over gate and d_up over up, for buffers the caller owns.

FP8 side output (``glu_forward(..., fp8_out=True)``, for the down projection's e4m3 GEMM on an FP8 base,
:mod:`leantune.ops.fp8`): per-token quantisation needs the whole row's absmax, so in this mode a program owns one
row of ``[rows, I]`` (not the flat blocks): rows up to ``fp8.MAX_ONE_BLOCK`` (16384: I = 14336 at 8B) are one
register block, from which h is stored and the codes are written (s = max(absmax / 448, 2^-126) of h as stored);
wider rows (I = 28672) go block by block, storing h and its running absmax, then read h back (just written, mostly
L2 on the card) for the codes. DRAM bytes per element, bf16: read gate + up 4, write h 2, write codes 1 (+ 4 per
row), against 4 + 2 + a separate quantisation pass over h (read 2, write 1): 2 B less per element, 117 MB per
layer at 4096 tokens x 14336 (0.03 ms at 4 TB/s, predicted, not measured). The torch path: h, then
``quantize_rows(h)`` (the reference the kernel equals bit for bit, tests/test_fp8_fused.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _launch, _runtime
from ._fp8_rows import quantized_row_pass, row_absmax, stored_fp32
from .fp8 import E4M3, MAX_ONE_BLOCK, _quantize_rows_torch

ACTIVATIONS = ("swiglu", "geglu_tanh", "geglu_erf")
APPROXIMATIONS = {"tanh": "geglu_tanh", "none": "geglu_erf"}
BLOCK = 4096  # elements per program: large, so each thread keeps several 16-byte loads in flight

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_RSQRT_2 = 1.0 / math.sqrt(2.0)
_RSQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# ------------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _normal_cdf(g):
    """Phi(g) = 0.5 erfc(-g / sqrt 2) in fp32, accurate in both tails (0.5 (1 + erf) cancels for g < -3).

    erfc(z), z >= 0, from Numerical Recipes' ``erfcc`` (Chebyshev fit, fractional error < 1.2e-7): one exp, no
    erfc instruction (Triton's interpreter has no libdevice).
    """
    z = tl.abs(g) * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    half_erfc = 0.5 * t * tl.exp(poly - z * z)
    return tl.where(g < 0, half_erfc, 1.0 - half_erfc)


@triton.jit
def glu_activation(g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g) in fp32 (the unused one is dead code in the forward and compiled away)."""
    if ACTIVATION == "swiglu":
        s = tl.sigmoid(g)
        act = g * s
        d_act = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "geglu_tanh":
        # t = 0.5 (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3)
        t = tl.sigmoid(2.0 * 0.7978845608028654 * g * (1.0 + 0.044715 * g * g))
        act = g * t
        d_act = t + g * t * (1.0 - t) * (2.0 * 0.7978845608028654) * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        cdf = _normal_cdf(g)
        act = g * cdf
        d_act = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    return act, d_act


@_launch.bound
@triton.jit
def _glu_forward_kernel(
    G, U, H, Q, S,
    stride_g, stride_u, stride_h, n_cols, blocks_per_row,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, FP8_OUT: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    if FP8_OUT:  # one program per row: h block by block with its absmax, then the row's e4m3 codes
        rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
        row_mask = rows >= 0  # one row, always in range
        cols = tl.arange(0, BLOCK)
        mask = (cols < n_cols)[None, :]
        absmax = tl.zeros([1], dtype=tl.float32)
        if ONE_BLOCK:
            h = _glu_row_block(G, U, H, rows, cols, mask, stride_g, stride_u, stride_h, ACTIVATION)
            absmax = row_absmax(absmax, h, mask)
        else:
            h = tl.zeros([1, BLOCK], dtype=tl.float32)  # unused: the codes pass reads h back
            for start in range(0, n_cols, BLOCK):
                block_mask = (start + cols < n_cols)[None, :]
                absmax = row_absmax(absmax, _glu_row_block(G, U, H, rows, start + cols, block_mask, stride_g,
                                                           stride_u, stride_h, ACTIVATION), block_mask)
        quantized_row_pass(H, Q, S, h, absmax, rows, cols, row_mask, mask, stride_h, n_cols, BLOCK, ONE_BLOCK)
    else:
        _glu_flat_block(G, U, H, stride_g, stride_u, stride_h, n_cols, blocks_per_row, ACTIVATION, BLOCK)


@triton.jit
def _glu_row_block(G, U, H, rows, cols, mask, stride_g, stride_u, stride_h, ACTIVATION: tl.constexpr):
    """h = act(g) * u for one [1, BLOCK] block, stored; returns the fp32 value of h as stored."""
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, _ = glu_activation(g, ACTIVATION)
    h = (act * u).to(H.dtype.element_ty)
    tl.store(H + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
    return stored_fp32(h)


@triton.jit
def _glu_flat_block(G, U, H, stride_g, stride_u, stride_h, n_cols, blocks_per_row, ACTIVATION: tl.constexpr,
                    BLOCK: tl.constexpr):
    # one block of one row; contiguous inputs come as a single row of numel elements
    tile = tl.program_id(0).to(tl.int64)
    row = tile // blocks_per_row
    cols = (tile % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = glu_activation(g, ACTIVATION)
    tl.store(H + row * stride_h + cols, (act * u).to(H.dtype.element_ty), mask=mask)


@_launch.bound
@triton.jit
def _glu_backward_kernel(
    DH, G, U, DG, DU,
    stride_dh, stride_g, stride_u, stride_dg, stride_du, n_cols, blocks_per_row,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    # DG/DU may be G/U themselves (inplace): every element is loaded before its own store, by the same program
    tile = tl.program_id(0).to(tl.int64)
    row = tile // blocks_per_row
    cols = (tile % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act, d_act = glu_activation(g, ACTIVATION)
    tl.store(DU + row * stride_du + cols, (dh * act).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + row * stride_dg + cols, (dh * u * d_act).to(DG.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------- launchers
def _layout(*tensors):
    """(views, n_rows, n_cols): flat 1-row views when all are contiguous, else ``[rows, I]`` views (unit last
    stride)."""
    if all(t.is_contiguous() for t in tensors):
        return [t.view(1, -1) for t in tensors], 1, tensors[0].numel()
    views = [_runtime.as_rows(t) for t in tensors]
    return views, views[0].shape[0], views[0].shape[1]


def _grid(n_rows, n_cols, block):
    blocks_per_row = _runtime.cdiv(n_cols, block)
    return (n_rows * blocks_per_row,), blocks_per_row


def _block_for(n_cols, block):
    return min(block or BLOCK, _runtime.next_power_of_2(n_cols))


def _forward_triton(gate, up, activation, out_dtype, fp8_out=False, *, block=None, num_warps=None):
    """h (and with ``fp8_out`` its (codes, scales) per row of ``[rows, I]``); ``block``/``num_warps`` override the
    defaults (for tuning on the GPU)."""
    if fp8_out:  # whole rows per program: [rows, I] views, never the flat layout
        g2d, u2d = _runtime.as_rows(gate), _runtime.as_rows(up)
        n_rows, n_cols = g2d.shape
        block = block or min(MAX_ONE_BLOCK, _runtime.next_power_of_2(n_cols))
        grid, blocks_per_row = (n_rows,), _runtime.cdiv(n_cols, block)
        codes = _runtime.empty((n_rows, n_cols), dtype=E4M3, device=gate.device)
        scales = _runtime.empty((n_rows,), dtype=torch.float32, device=gate.device)
    else:
        (g2d, u2d), n_rows, n_cols = _layout(gate, up)
        block = _block_for(n_cols, block)
        grid, blocks_per_row = _grid(n_rows, n_cols, block)
    h = _runtime.empty((n_rows, n_cols), dtype=out_dtype, device=gate.device)
    _glu_forward_kernel[grid](
        g2d, u2d, h, codes.view(torch.uint8) if fp8_out else h, scales if fp8_out else h,
        g2d.stride(0), u2d.stride(0), h.stride(0), n_cols, blocks_per_row,
        ACTIVATION=activation, BLOCK=block, FP8_OUT=fp8_out, ONE_BLOCK=blocks_per_row == 1,
        num_warps=num_warps or _runtime.num_warps_for(block),
    )
    return (h.view(gate.shape), (codes, scales)) if fp8_out else h.view(gate.shape)


def _backward_triton(dh, gate, up, activation, inplace, *, out=None, block=None, num_warps=None):
    (dh2d, g2d, u2d, *out2d), n_rows, n_cols = _layout(dh, gate, up, *(out or ()))
    if inplace:  # contiguous (checked), so g2d/u2d are views of the caller's buffers
        d_gate, d_up = g2d, u2d
    elif out is not None:  # views of the caller's tensors, written through their row strides
        d_gate, d_up = out2d
    else:
        d_gate = _runtime.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
        d_up = _runtime.empty((n_rows, n_cols), dtype=up.dtype, device=up.device)
    block = _block_for(n_cols, block)
    grid, blocks_per_row = _grid(n_rows, n_cols, block)
    _glu_backward_kernel[grid](
        dh2d, g2d, u2d, d_gate, d_up,
        dh2d.stride(0), g2d.stride(0), u2d.stride(0), d_gate.stride(0), d_up.stride(0), n_cols, blocks_per_row,
        ACTIVATION=activation, BLOCK=block, num_warps=num_warps or _runtime.num_warps_for(block),
    )
    if inplace:
        if not torch.compiler.is_compiling():  # the kernel wrote behind autograd's back: let saved-tensor checks
            torch.autograd.graph.increment_version(gate)  # see the change (traced, the writes are functionalised)
            torch.autograd.graph.increment_version(up)
        return gate, up
    if out is not None:
        return tuple(out)
    return d_gate.view(gate.shape), d_up.view(up.shape)


def _activation_torch(g, activation, *, derivative=True):
    """act(g) and act'(g) (None unless ``derivative``) for fp32 g: the formulas of the kernel, in torch. SiLU uses
    torch's fused ``silu`` (g * sigmoid(g) in one vectorised pass on the CPU, where each separate elementwise op is
    a pass through memory)."""
    if activation == "swiglu":
        if not derivative:
            return F.silu(g), None
        s = torch.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    if activation == "geglu_tanh":
        t = torch.sigmoid(2.0 * _SQRT_2_OVER_PI * g * (1.0 + 0.044715 * g * g))
        if not derivative:
            return g * t, None
        return g * t, t + g * t * (1.0 - t) * (2.0 * _SQRT_2_OVER_PI) * (1.0 + 3.0 * 0.044715 * g * g)
    cdf = 0.5 * torch.erfc(-g * _RSQRT_2)  # not 0.5 (1 + erf): that cancels for g < -3
    if not derivative:
        return g * cdf, None
    return g * cdf, cdf + g * torch.exp(-0.5 * g * g) * _RSQRT_2PI


def _forward_torch(gate, up, activation, out_dtype):
    act, _ = _activation_torch(gate.float(), activation, derivative=False)
    return act.mul_(up).to(out_dtype)  # act is a new fp32 buffer: the product is formed in it


def _backward_torch(dh, gate, up, activation, inplace):
    if activation == "swiglu" and gate.dtype == up.dtype == torch.float32:
        # CPU fast path, same formulas: d_gate = (dh * up) * s (1 + g (1 - s)) is torch's fused silu_backward;
        # results go straight into the buffers (gate's and up's when the caller owns them), no fp32 copies
        dh_f32 = dh.float()
        dh_up = dh_f32 * up
        d_up = torch.mul(dh_f32, F.silu(gate), out=up if inplace else None)
        d_gate = torch.ops.aten.silu_backward.grad_input(dh_up, gate, grad_input=gate if inplace else dh_up)
        return d_gate, d_up
    act, d_act = _activation_torch(gate.float(), activation)
    dh_f32 = dh.float()
    d_up = dh_f32 * act
    d_gate = dh_f32 * up.float() * d_act
    if inplace:  # both results are formed before either input is overwritten
        return gate.copy_(d_gate), up.copy_(d_up)
    return d_gate.to(gate.dtype), d_up.to(up.dtype)


def _forward(gate, up, activation, impl, fp8_out=False):
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    if impl == "triton" and gate.numel():
        return _forward_triton(gate, up, activation, out_dtype, fp8_out)
    if gate.numel():
        h = _forward_torch(gate, up, activation, out_dtype)
    else:
        h = _runtime.empty(gate.shape, dtype=out_dtype, device=gate.device)
    return (h, _quantize_rows_torch(h.reshape(math.prod(h.shape[:-1]), h.shape[-1]))) if fp8_out else h


def _backward(dh, gate, up, activation, impl, inplace, out=None):
    if gate.numel() == 0:
        if inplace:
            return gate, up
        if out is not None:
            return tuple(out)
        return (_runtime.empty(gate.shape, dtype=gate.dtype, device=gate.device),
                _runtime.empty(up.shape, dtype=up.dtype, device=up.device))
    if impl == "triton":
        return _backward_triton(dh, gate, up, activation, inplace, out=out)
    d_gate, d_up = _backward_torch(dh, gate, up, activation, inplace)
    if out is not None:
        return out[0].copy_(d_gate), out[1].copy_(d_up)
    return d_gate, d_up


# ------------------------------------------------------------------------------------------------------ checks
def check_inputs(gate, up, activation, dh=None):
    _runtime.check_tensor("gate", gate)
    _runtime.check_tensor("up", up)
    if dh is not None:
        _runtime.check_tensor("dh", dh)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _runtime.check_shape("up", up, gate.shape, "gate's shape")
    if dh is not None:
        _runtime.check_shape("dh", dh, gate.shape, "gate's shape")
    device = _runtime.check_same_device(gate=gate, up=up, dh=dh)
    return _runtime.backend(device)  # raises configuration errors before any work


def _overlap(a, b):
    """Whether two contiguous tensors share any byte (two halves of one buffer do not). Under torch.compile: False
    (dynamo has no data pointers; the traced in-place writes are functionalised, so no overlap can corrupt them)."""
    if torch.compiler.is_compiling() or a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


# ------------------------------------------------------------------------------------------------ autograd + API
def glu_forward(gate, up, activation, *, fp8_out=False):
    """h = act(gate) * up without autograd (for fused callers); see :func:`swiglu` for shapes and dtypes.

    Args:
        gate, up: same shape (at least 1-D), float32/float16/bfloat16, one device, any strides.
        activation: one of ``ACTIVATIONS``: ``"swiglu"``, ``"geglu_tanh"``, ``"geglu_erf"``.
        fp8_out: also return h quantised per row for the e4m3 GEMM that reads it (the LoRA MLP's down projection
            on an FP8 base): module docstring, "FP8 side output".

    Returns:
        a new contiguous ``h`` of gate's shape, dtype ``promote(gate, up)``; with ``fp8_out`` ``(h, (codes,
        scales))``: codes ``float8_e4m3fn [rows, I]`` (rows = the leading dims flattened), scales fp32 ``[rows]``,
        bit for bit :func:`~leantune.ops.fp8.quantize_rows` of h as stored.

    Raises:
        ValueError: unsupported dtype, shape mismatch, different devices, unknown activation, a 0-dim gate with
            ``fp8_out``.
    """
    impl = check_inputs(gate, up, activation)
    if fp8_out and gate.dim() == 0:
        raise ValueError("gate must have at least one dimension [..., I] with fp8_out=True, got a 0-dim tensor")
    with torch.no_grad():
        return _forward(gate, up, activation, impl, fp8_out)


def glu_backward(dh, gate, up, activation, *, inplace=False, out=None):
    """(d_gate, d_up) of h = act(gate) * up for incoming ``dh``, without autograd (formulas in the module docstring).

    Args:
        dh: gradient of h, gate's shape, any float dtype.
        gate, up: the forward inputs (same shape, one device).
        activation: one of ``ACTIVATIONS``.
        inplace: write d_gate into gate's buffer and d_up into up's buffer and return them (gate and up must be
            contiguous and must not overlap); saves two allocations where the caller owns gate/up.
        out: ``(d_gate, d_up)`` tensors to write the results into and return instead (gate's / up's shape and
            dtype, gate's device, unit last stride, e.g. the two halves of one ``[..., 2I]`` gradient buffer, which
            saves the concatenation); not with ``inplace``.

    Returns:
        ``(d_gate, d_up)`` with gate's / up's dtype and shape.

    Raises:
        ValueError: as :func:`glu_forward`, dh's shape differs from gate's, ``inplace`` with non-contiguous
            or overlapping gate/up, or ``out`` not as above.
    """
    impl = check_inputs(gate, up, activation, dh)
    if out is not None:
        _check_out(out, gate, up, inplace)
    if inplace:
        check_inplace(gate, up)
    with torch.no_grad():
        return _backward(dh, gate, up, activation, impl, inplace, out)


def check_inplace(gate, up):
    """``inplace=True``'s conditions: gate and up contiguous, not overlapping (ValueError naming the argument)."""
    for name, t in (("gate", gate), ("up", up)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous with inplace=True, got strides {tuple(t.stride())}")
    if _overlap(gate, up):
        raise ValueError("gate and up must not overlap in memory with inplace=True")


def _check_out(out, gate, up, inplace):
    if inplace:
        raise ValueError("out and inplace=True are exclusive")
    if not isinstance(out, (tuple, list)) or len(out) != 2 or not all(isinstance(t, torch.Tensor) for t in out):
        raise ValueError(f"out must be a pair of tensors (d_gate, d_up), got {type(out).__name__}")
    for name, t, ref in (("out[0]", out[0], gate), ("out[1]", out[1], up)):
        if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
            raise ValueError(f"{name} must have shape {tuple(ref.shape)}, dtype {ref.dtype} and device "
                             f"{ref.device}, got {tuple(t.shape)}, {t.dtype}, {t.device}")
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit last stride, got strides {tuple(t.stride())}")
    if _runtime.rows_overlap(*out):
        raise ValueError("out[0] and out[1] must not overlap in memory")


class GLUFunction(torch.autograd.Function):
    """Autograd node of :func:`swiglu` / :func:`geglu`; saves gate and up (the caller's tensors, no copies). No
    ``torch.amp.custom_fwd``/``custom_bwd``: elementwise only, nothing autocast-eligible (re-entering autocast in
    backward cost host time on every call)."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        impl = _runtime.backend(gate.device)
        h = _forward(gate, up, activation, impl)
        ctx.save_for_backward(gate, up)
        ctx.activation, ctx.impl = activation, impl
        return _runtime.distinct_output(h)  # the torch path's h is an in-place product: see distinct_output

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        d_gate, d_up = _backward(dh, gate, up, ctx.activation, ctx.impl, inplace=False)
        return (d_gate if ctx.needs_input_grad[0] else None), (d_up if ctx.needs_input_grad[1] else None), None


def swiglu(gate, up):
    """SwiGLU: ``silu(gate) * up`` (HF LlamaMLP's ``act_fn(gate_proj(x)) * up_proj(x)`` with ``hidden_act="silu"``).

    Args:
        gate, up: ``[..., I]`` of one shape, float32/float16/bfloat16 (may differ: torch promotion), one device,
            any strides.

    Returns:
        ``h`` of gate's shape, dtype ``promote(gate, up)`` (bf16 in a bf16 model), computed in fp32 and rounded once.
        Gradients flow to both inputs; only gate and up are saved for backward.

    Raises:
        ValueError: non-float or unsupported dtype, shape mismatch, tensors on different devices.
        RuntimeError: ``LEANTUNE_BACKEND=triton`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    check_inputs(gate, up, "swiglu")
    return GLUFunction.apply(gate, up, "swiglu")


def geglu(gate, up, approximate="tanh"):
    """GeGLU: ``gelu(gate, approximate) * up`` (HF GemmaMLP with ``gelu_pytorch_tanh``: ``approximate="tanh"``).

    Args:
        gate, up: as :func:`swiglu`.
        approximate: ``"tanh"``: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))); ``"none"``: 0.5 g (1 + erf(g/sqrt 2))
            (the two forms of ``torch.nn.functional.gelu``).

    Returns:
        as :func:`swiglu`.

    Raises:
        ValueError: as :func:`swiglu`, or an unknown ``approximate``.
        RuntimeError: as :func:`swiglu`.
    """
    if not isinstance(approximate, str) or approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    activation = APPROXIMATIONS[approximate]
    check_inputs(gate, up, activation)
    return GLUFunction.apply(gate, up, activation)
