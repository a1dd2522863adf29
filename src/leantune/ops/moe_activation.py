r"""The experts' gated activation h = act(g) over gate_up's output g ``[M, 2I]`` (:mod:`leantune.ops.moe`).

Layouts and activations (transformers 5.17 ``models/*/modeling_*.py``):

    gate, up = g[:, :I], g[:, I:]                 (halves: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)
             = g[:, 0::2], g[:, 1::2]             (interleaved: gpt-oss)
    swiglu:          h = silu(gate) * up = gate s up,                       s = sigmoid(gate)
    clamped_swiglu:  gc = min(gate, limit), uc = clamp(up, -limit, limit),
                     h = (uc + 1) gc sigmoid(alpha gc)       (gpt-oss ``GptOssExperts._apply_gate``: 1.702, 7.0)

Backward, dh ``[M, I]`` -> dg ``[M, 2I]`` in g's layout (product rule; sigmoid' = s (1 - s)):

    swiglu:   d_gate = dh up s (1 + gate (1 - s)),  d_up = dh gate s
    clamped:  d_gate = dh (uc + 1) (s + alpha gc s (1 - s)) [gate <= limit],  d_up = dh gc s [-limit <= up <= limit]
              with s = sigmoid(alpha gc); torch's clamp passes the gradient at the bound, and so do these masks.

Everything in fp32 from the stored values, each output rounded once to g's dtype. NaN: min and clamp keep it (as
torch's), and the masks multiply, so a NaN factor stays NaN.

Implementations. The halves with SwiGLU are :mod:`leantune.ops.glu`'s kernels (dg written into the halves of one
buffer). Every other case on the Triton backend: one kernel each way (``_gated_forward_kernel``,
``_gated_backward_kernel``): a program owns ``BLOCK`` columns of h in one row and reads gate and up where the layout
puts them (interleaved: the even and odd elements of one span of g). Bytes per h element: forward reads 2, writes 1;
backward reads 3, writes 2, where the fp32 torch chain made ~10 passes over fp32 copies (benchmarks/RESULTS.md,
2026-12-04, the MoE rows). The torch backend: that chain (``_forward_torch``, ``_backward_torch``), the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _launch, _runtime
from .glu import glu_backward, glu_forward

ACTIVATIONS = ("swiglu", "clamped_swiglu")
BLOCK = 1024  # h columns per program


# ------------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _load_gate_up(G, stride_g, n_cols, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
    """This program's row, h columns and mask, gate and up in fp32, and their offsets within the row of g."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    if INTERLEAVED:
        gate_at, up_at = 2 * cols, 2 * cols + 1
    else:
        gate_at, up_at = cols, cols + n_cols
    gate = tl.load(G + row * stride_g + gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(G + row * stride_g + up_at, mask=mask, other=0.0).to(tl.float32)
    return row, cols, mask, gate, up, gate_at, up_at


@triton.jit
def _gated(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """(h, d_gate / dh, d_up / dh) in fp32 (the unused ones are dead code in the forward and compiled away)."""
    if ACTIVATION == "swiglu":
        s = tl.sigmoid(gate)
        h = gate * s * up
        d_gate = up * s * (1.0 + gate * (1.0 - s))
        d_up = gate * s
    else:
        gc = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        uc = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
        s = tl.sigmoid(alpha * gc)
        h = (uc + 1.0) * gc * s
        d_gate = (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)) * (gate <= limit).to(tl.float32)
        d_up = gc * s * ((up >= -limit) & (up <= limit)).to(tl.float32)
    return h, d_gate, d_up


@_launch.bound
@triton.jit
def _gated_forward_kernel(G, H, stride_g, stride_h, n_cols, alpha, limit,
                          ACTIVATION: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
    row, cols, mask, gate, up, _, _ = _load_gate_up(G, stride_g, n_cols, INTERLEAVED, BLOCK)
    h, _, _ = _gated(gate, up, alpha, limit, ACTIVATION)
    tl.store(H + row * stride_h + cols, h.to(H.dtype.element_ty), mask=mask)


@_launch.bound
@triton.jit
def _gated_backward_kernel(DH, G, DG, stride_dh, stride_g, stride_dg, n_cols, alpha, limit,
                           ACTIVATION: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
    row, cols, mask, gate, up, gate_at, up_at = _load_gate_up(G, stride_g, n_cols, INTERLEAVED, BLOCK)
    dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    _, d_gate, d_up = _gated(gate, up, alpha, limit, ACTIVATION)
    tl.store(DG + row * stride_dg + gate_at, (dh * d_gate).to(DG.dtype.element_ty), mask=mask)
    tl.store(DG + row * stride_dg + up_at, (dh * d_up).to(DG.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------- launchers
def _forward_triton(g, activation, interleaved, alpha, limit):
    g = _runtime.as_rows(g)
    n_rows, n_cols = g.shape[0], g.shape[1] // 2
    h = _runtime.empty((n_rows, n_cols), dtype=g.dtype, device=g.device)
    if h.numel():
        _gated_forward_kernel[(n_rows, _runtime.cdiv(n_cols, BLOCK))](
            g, h, g.stride(0), h.stride(0), n_cols, float(alpha), float(limit),
            ACTIVATION=activation, INTERLEAVED=interleaved, BLOCK=BLOCK, num_warps=4)
    return h


def _backward_triton(dh, g, activation, interleaved, alpha, limit):
    dh, g = _runtime.as_rows(dh), _runtime.as_rows(g)
    n_rows, n_cols = dh.shape
    dg = _runtime.empty(g.shape, dtype=g.dtype, device=g.device)
    if dh.numel():
        _gated_backward_kernel[(n_rows, _runtime.cdiv(n_cols, BLOCK))](
            dh, g, dg, dh.stride(0), g.stride(0), dg.stride(0), n_cols, float(alpha), float(limit),
            ACTIVATION=activation, INTERLEAVED=interleaved, BLOCK=BLOCK, num_warps=4)
    return dg


def _split(g: torch.Tensor, interleaved: bool):
    return (g[:, 0::2], g[:, 1::2]) if interleaved else g.chunk(2, dim=-1)


def _forward_torch(g, activation, interleaved, alpha, limit):
    gate, up = (t.float() for t in _split(g, interleaved))
    if activation == "swiglu":
        return (F.silu(gate) * up).to(g.dtype)
    gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
    return ((uc + 1) * gc * torch.sigmoid(alpha * gc)).to(g.dtype)


def _backward_torch(dh, g, activation, interleaved, alpha, limit):
    gate, up = (t.float() for t in _split(g, interleaved))
    dh = dh.float()
    if activation == "swiglu":
        sig = torch.sigmoid(gate)
        d_gate, d_up = dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig
    else:
        gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
        sig = torch.sigmoid(alpha * gc)
        d_gate = dh * (uc + 1) * (sig + alpha * gc * sig * (1 - sig)) * (gate <= limit)
        d_up = dh * gc * sig * ((up >= -limit) & (up <= limit))
    if interleaved:
        return torch.stack([d_gate, d_up], dim=-1).reshape(g.shape).to(g.dtype)
    return torch.cat([d_gate, d_up], dim=-1).to(g.dtype)


def _glu_route(activation: str, interleaved: bool) -> bool:
    return activation == "swiglu" and not interleaved  # ops.glu's kernels on both backends


def gated_forward(g: torch.Tensor, activation: str, interleaved: bool, alpha: float, limit: float) -> torch.Tensor:
    """h ``[M, I]`` in g's dtype from g ``[M, 2I]`` (module docstring), without autograd. Internal to
    :mod:`leantune.ops.moe`, which checks its arguments (activation in ACTIVATIONS, g 2-D with an even width)."""
    if _glu_route(activation, interleaved):
        return glu_forward(*g.chunk(2, dim=-1), "swiglu")
    if _runtime.backend(g.device) == "triton":
        return _forward_triton(g, activation, interleaved, alpha, limit)
    return _forward_torch(g, activation, interleaved, alpha, limit)


def gated_backward(dh: torch.Tensor, g: torch.Tensor, activation: str, interleaved: bool, alpha: float,
                   limit: float) -> torch.Tensor:
    """dL/dg ``[M, 2I]`` in g's dtype and layout from dh ``[M, I]`` (module docstring), without autograd."""
    if _glu_route(activation, interleaved):
        dg = _runtime.empty(g.shape, dtype=g.dtype, device=g.device)
        glu_backward(dh, *g.chunk(2, dim=-1), "swiglu", out=dg.chunk(2, dim=-1))  # written into dg's halves
        return dg
    if _runtime.backend(g.device) == "triton":
        return _backward_triton(dh, g, activation, interleaved, alpha, limit)
    return _backward_torch(dh, g, activation, interleaved, alpha, limit)
