"""ops.moe_activation (the experts' gated activation over g [M, 2I]) against float64 formulas: h and dg for SwiGLU and
gpt-oss's clamped SwiGLU, halves and interleaved layouts, widths past one block, values on and beyond the clamp
bounds, NaN propagation; both backends (the Triton kernels through the interpreter on the CPU)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ON_GPU
from reference import assert_close

from leantune.ops import moe_activation

ALPHA, LIMIT = 1.702, 7.0


def formula(g, activation, interleaved, alpha=ALPHA, limit=LIMIT):
    """h from g as transformers writes it (``GptOssExperts._apply_gate``; ``act_fn(gate) * up``)."""
    gate, up = (g[:, 0::2], g[:, 1::2]) if interleaved else g.chunk(2, dim=-1)
    if activation == "swiglu":
        return F.silu(gate) * up
    gate, up = gate.clamp(min=None, max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def _g(rows, width, dtype, *, bounds=False):
    g = torch.randn(rows, 2 * width, device=DEVICE) * 4
    if bounds:  # exactly on the clamp bounds and far past them, in gate and in up positions of both layouts
        g.view(-1)[::7] = LIMIT
        g.view(-1)[3::11] = -LIMIT
        g.view(-1)[5::13] = 3 * LIMIT
        g.view(-1)[2::17] = -3 * LIMIT
    return g.to(dtype)


def _low(backend):
    """bf16 where the comparison is meaningful; the interpreter truncates bf16 stores: fp16 there (docs/design.md)."""
    return torch.float16 if backend == "triton" and not ON_GPU else torch.bfloat16


@pytest.mark.parametrize("activation", moe_activation.ACTIVATIONS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rows,width", [(3, 5), (2, moe_activation.BLOCK + 37)])
@pytest.mark.parametrize("low", [False, True])
def test_values_and_grads(backend, activation, interleaved, rows, width, low):
    dtype = _low(backend) if low else torch.float32
    g = _g(rows, width, dtype, bounds=True)
    dh = torch.randn(rows, width, device=DEVICE).to(dtype)
    h = moe_activation.gated_forward(g, activation, interleaved, ALPHA, LIMIT)
    dg = moe_activation.gated_backward(dh, g, activation, interleaved, ALPHA, LIMIT)
    g64 = g.double().requires_grad_()
    h64 = formula(g64, activation, interleaved)
    (dg64,) = torch.autograd.grad(h64, g64, dh.double())
    g_eager = g.detach().requires_grad_()  # the same formula in g's dtype: the bar's eager error
    h_eager = formula(g_eager, activation, interleaved)
    (dg_eager,) = torch.autograd.grad(h_eager, g_eager, dh)
    assert h.dtype == dg.dtype == dtype and h.shape == (rows, width) and dg.shape == g.shape
    assert_close("h", h, h64, dtype, eager=h_eager)
    assert_close("dg", dg, dg64, dtype, eager=dg_eager)


@pytest.mark.parametrize("interleaved", [True, False])
def test_clamp_masks_pass_the_gradient_at_the_bounds(backend, interleaved):
    """gate == limit and up == +-limit take the gradient (torch's clamp); past them it is exactly 0."""
    gate = torch.tensor([[LIMIT, LIMIT + 1, 1.0, 1.0, 1.0]], device=DEVICE)
    up = torch.tensor([[0.5, 0.5, LIMIT, -LIMIT, LIMIT + 1]], device=DEVICE)
    g = torch.stack([gate, up], dim=-1).reshape(1, -1) if interleaved else torch.cat([gate, up], dim=-1)
    dg = moe_activation.gated_backward(torch.ones_like(gate), g, "clamped_swiglu", interleaved, ALPHA, LIMIT)
    d_gate, d_up = (dg[:, 0::2], dg[:, 1::2]) if interleaved else dg.chunk(2, dim=-1)
    assert d_gate[0, 0] != 0 and d_gate[0, 1] == 0 and d_up[0, 2] != 0 and d_up[0, 3] != 0 and d_up[0, 4] == 0


@pytest.mark.parametrize("activation", moe_activation.ACTIVATIONS)
def test_nan_propagates(backend, activation):
    g = _g(2, 6, torch.float32)
    g[1, 4] = float("nan")  # row 1's gate 2 (interleaved: even column 4)
    h = moe_activation.gated_forward(g, activation, True, ALPHA, LIMIT)
    dg = moe_activation.gated_backward(torch.ones(2, 6, device=DEVICE), g, activation, True, ALPHA, LIMIT)
    assert torch.isnan(h[1, 2]) and torch.isnan(dg[1, 4]) and torch.isnan(dg[1, 5])
    finite = torch.ones_like(h, dtype=torch.bool)
    finite[1, 2] = False
    assert torch.isfinite(h[finite]).all() and torch.isfinite(dg.view(2, 6, 2)[finite]).all()


def test_empty_rows(backend):
    g = torch.randn(0, 8, device=DEVICE)
    assert moe_activation.gated_forward(g, "clamped_swiglu", True, ALPHA, LIMIT).shape == (0, 4)
    assert moe_activation.gated_backward(torch.randn(0, 4, device=DEVICE), g, "clamped_swiglu", True, ALPHA,
                                         LIMIT).shape == (0, 8)
