"""The fused LoRA ops with NF4 frozen weights (QLoRA): the same values and gradients as a float64 reference built from
the dequantised weights, on both backends; the node keeps the 4-bit codes, never a dequantised weight, and
dequantises into workspaces it reuses.

Tensors live on ``conftest.DEVICE`` (the CPU here, the Triton backend through the interpreter; the card on CUDA);
on CUDA every test runs with TF32 off for cuBLAS (the torch backend's fp32 products must stay fp32 for the 1e-5 bar).
"""

import pytest
import reference
import torch
from conftest import DEVICE
from reference import F64, assert_close, fp32_products, grads64, lora_linear_ref, swiglu_ref

from leantune import ops
from leantune.ops import _runtime, dequantize_nf4, quantize_nf4
from leantune.ops.lora import api as lora_api

# interpreter: small widths; every width a multiple of 64 (NF4 blocks) but not of the kernels' tiles
H, INTER, R, ROWS = 192, 320, 4, 13


@pytest.fixture(autouse=True)
def _fp32_products():
    with fp32_products():
        yield


def nf4_proj(n_in, n_out, dtype=torch.float32):
    """(LoraWeights with an NF4 weight [n_out, n_in], its dequantised weight in ``dtype``), all on DEVICE."""
    w = quantize_nf4(torch.randn(n_out, n_in, device=DEVICE) * n_in**-0.5)
    dense = dequantize_nf4(w, dtype=torch.float32).to(dtype)  # what the op must compute with
    a = (torch.randn(R, n_in, device=DEVICE) * n_in**-0.5).requires_grad_()
    b = (torch.randn(n_out, R, device=DEVICE) * R**-0.5).requires_grad_()
    return ops.LoraWeights(w, a, b, 2.0), dense


def test_lora_linear_with_nf4_weight_matches_dequantised_reference(backend):
    proj, dense = nf4_proj(H, INTER)
    x = torch.randn(2, ROWS, H, device=DEVICE, requires_grad=True)
    y = ops.lora_linear(x, *proj)
    dy = torch.randn_like(y)
    gx, ga, gb = torch.autograd.grad(y, [x, proj.lora_A, proj.lora_B], dy)
    ref, (rx, _, ra, rb) = grads64(lambda x, w, a, b: lora_linear_ref(x, w, a, b, 2.0), [x, dense, proj.lora_A,
                                                                                          proj.lora_B], dy)
    assert_close("y", y, ref, torch.float32)
    for name, ours, theirs in (("dx", gx, rx), ("dA", ga, ra), ("dB", gb, rb)):
        assert_close(name, ours, theirs, torch.float32)


def test_lora_qkv_and_mlp_with_nf4_weights_match_dequantised_reference(backend):
    x = torch.randn(ROWS, H, device=DEVICE, requires_grad=True)
    (q, qd), (k, kd), (v, vd) = nf4_proj(H, 256), nf4_proj(H, 64), nf4_proj(H, 64)
    outs = ops.lora_qkv(x, q, k, v)
    dys = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, [x, q.lora_A, k.lora_B], dys)

    def qkv64(x, qa, kb):
        return [lora_linear_ref(x, qd, qa, q.lora_B, 2.0), lora_linear_ref(x, kd, k.lora_A, kb, 2.0),
                lora_linear_ref(x, vd, v.lora_A, v.lora_B, 2.0)]

    leaves = [t.detach().to(F64).requires_grad_() for t in (x, q.lora_A, k.lora_B)]
    refs = qkv64(*leaves)
    want = torch.autograd.grad(refs, leaves, [d.to(F64) for d in dys])
    for o, r in zip(outs, refs):
        assert_close("qkv out", o, r, torch.float32)
    for name, ours, theirs in zip(("dx", "dA_q", "dB_k"), got, want):
        assert_close(name, ours, theirs, torch.float32)

    (gate, gd), (up, ud), (down, dd) = nf4_proj(H, INTER), nf4_proj(H, INTER), nf4_proj(INTER, H)
    y = ops.lora_mlp(x, gate, up, down)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, gate.lora_A, down.lora_B], dy)

    def mlp64(x, ga, db):
        h = swiglu_ref(lora_linear_ref(x, gd, ga, gate.lora_B, 2.0), lora_linear_ref(x, ud, up.lora_A, up.lora_B, 2.0))
        return lora_linear_ref(h, dd, down.lora_A, db, 2.0)

    leaves = [t.detach().to(F64).requires_grad_() for t in (x, gate.lora_A, down.lora_B)]
    ref = mlp64(*leaves)
    want = torch.autograd.grad(ref, leaves, dy.to(F64))
    assert_close("mlp out", y, ref, torch.float32)
    for name, ours, theirs in zip(("dx", "dA_gate", "dB_down"), got, want):
        assert_close(name, ours, theirs, torch.float32)


def test_nf4_node_saves_codes_not_a_dequantised_weight_and_reuses_its_workspaces(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    (gate, _), (up, _), (down, _) = nf4_proj(H, INTER), nf4_proj(H, INTER), nf4_proj(INTER, H)
    x = torch.randn(ROWS, H, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ops.lora_mlp(x, gate, up, down)
    full = {(INTER, H), (H, INTER)}
    assert not [t for t in saved if t.is_floating_point() and tuple(t.shape) in full]  # no dequantised weight kept
    assert any(t.dtype == torch.uint8 and t.data_ptr() == gate.weight.codes.data_ptr() for t in saved)

    lora_api._workspaces.clear()
    allocated = []

    def counting(shape, dtype, device):
        allocated.append(tuple(shape))
        return reference.nan_allocator(shape, dtype, device)

    with _runtime.use_allocator(counting):
        for _ in range(2):
            y = ops.lora_mlp(x, gate, up, down)
            y.sum().backward()
    weight_sized = [s for s in allocated if s in full]
    assert len(weight_sized) == 3, weight_sized  # gate, up, down workspaces: once, not per call or per pass


def test_nf4_weight_of_the_wrong_shape_is_named():
    proj, _ = nf4_proj(H, INTER)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.lora_linear(torch.randn(3, H + 64, device=DEVICE), *proj)
