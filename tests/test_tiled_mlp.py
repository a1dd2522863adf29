"""Tiled MLP: float64 references on both backends (the fused LoRA MLP per tile), the whole model tiled vs untiled
(bit-identical where per-row results do not depend on the tile; parameter gradients are summed over tiles),
dropout masks reproduced in the recompute, and composition with checkpointing and offloaded checkpoints.

The float64 references, the dropout recompute and the functional case run on ``conftest.DEVICE`` (the CPU here, the
Triton backend through the interpreter; the card on CUDA, TF32 off for cuBLAS there). The tiled-vs-untiled cases stay
on the CPU on purpose: their bit-identity across tile sizes is a property of the CPU's GEMMs (cuBLAS may pick another
kernel, another summation order, for another row count).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from reference import assert_close, fp32_products, grads64, lora_linear_ref, rel_err, swiglu_ref
from test_offload import NON_REENTRANT, VOCAB, step, tiny_llama_lora
from torch.utils.checkpoint import checkpoint

import leantune
from leantune import ops
from leantune.patch.offload import enable_offloaded_checkpoints
from leantune.patch.tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, tiled_mlp

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def first_mlp(model):
    return model.get_base_model().model.layers[0].mlp


def lora_params(mlp):
    """[(weight, lora_A, lora_B, scaling)] of gate, up, down (PEFT layout)."""
    out = []
    for name in MLP_PROJECTIONS:
        proj = getattr(mlp, name)
        out.append((proj.base_layer.weight, proj.lora_A["default"].weight, proj.lora_B["default"].weight,
                    proj.scaling["default"]))
    return out


def mlp_ref(x, *tensors, scalings):
    """down(silu(gate(x)) * up(x)), each projection x W^T + s (x A^T) B^T, from the formulas (float64)."""
    (gw, ga, gb), (uw, ua, ub), (dw, da, db) = tensors[0:3], tensors[3:6], tensors[6:9]
    gate = lora_linear_ref(x, gw, ga, gb, scalings[0])
    up = lora_linear_ref(x, uw, ua, ub, scalings[1])
    return lora_linear_ref(swiglu_ref(gate, up), dw, da, db, scalings[2])


@pytest.mark.parametrize("shape", [(2, 7), (1, 13)])
def test_tiled_lora_mlp_matches_float64(backend, shape, monkeypatch):
    """Each tile runs ops.lora_mlp (Triton through the interpreter or on the card, or torch); tile 5 divides neither 14
    nor 13."""
    with fp32_products():
        _check_tiled_lora_mlp(shape, monkeypatch)


def _check_tiled_lora_mlp(shape, monkeypatch):
    model = tiny_llama_lora().to(DEVICE)
    leantune.patch(model)
    enable_tiled_mlp(model, tile_tokens=5)
    mlp = first_mlp(model)
    calls, real = [], ops.lora_mlp

    def counting(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(ops, "lora_mlp", counting)
    x = torch.randn(*shape, 64, device=DEVICE, requires_grad=True)
    params = lora_params(mlp)
    assert all(t.device.type == DEVICE for w, a, b, _ in params for t in (w, a, b))
    leaves = [x] + [t for w, a, b, _ in params for t in (w, a, b)]
    y = mlp(x)
    grad_y = torch.randn_like(y)
    grads = torch.autograd.grad(y, [t for t in leaves if t.requires_grad], grad_y)
    tokens = shape[0] * shape[1]
    tiles = [(1, 5, 64)] * (tokens // 5) + [(1, tokens % 5, 64)]
    assert calls == tiles + tiles  # each tile once in the forward, once recomputed in the backward
    ref_y, ref_grads = grads64(lambda *t: mlp_ref(*t, scalings=[s for *_, s in params]), leaves, grad_y)
    assert_close("y", y, ref_y, torch.float32)
    names = ["x"] + [f"{p}.{t}" for p in MLP_PROJECTIONS for t in ("weight", "lora_A", "lora_B")]
    got = iter(grads)
    for name, leaf, ref in zip(names, leaves, ref_grads):
        if leaf.requires_grad:
            assert_close(f"d{name}", next(got), ref, torch.float32)


@pytest.mark.parametrize("patched", [False, True], ids=["hf", "leantune"])
def test_model_tiled_equals_untiled(patched, monkeypatch):
    """Tile 48 over 2 x 61 tokens (does not divide): loss and every gradient outside the MLP bit-identical (dX rows
    do not depend on the tile here); MLP LoRA gradients are summed over tiles: equal within fp32 rounding. On the CPU
    on purpose (module docstring)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_llama_lora()
    if patched:
        leantune.patch(model)
    input_ids = torch.randint(3, VOCAB, (2, 61))
    ref_loss, ref_grads = step(model, input_ids)
    for tile_tokens, exact in ((48, True), (7, False), (200, True)):
        enable_tiled_mlp(model, tile_tokens=tile_tokens)
        loss, grads = step(model, input_ids)
        if exact:
            assert torch.equal(loss, ref_loss)
        assert rel_err(loss, ref_loss) <= 1e-6
        for name, ref in ref_grads.items():
            in_mlp = any(p in name for p in MLP_PROJECTIONS) and tile_tokens < 122
            if exact and not in_mlp:
                assert torch.equal(grads[name], ref), f"{name} not bit-identical with tile {tile_tokens}"
            assert rel_err(grads[name], ref) <= 1e-5, f"{name}: tile {tile_tokens}"
    disable_tiled_mlp(model)
    assert "forward" not in first_mlp(model).__dict__ or patched
    loss, grads = step(model, input_ids)
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())


@pytest.mark.parametrize("patched", [False, True], ids=["hf", "leantune"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_dropout_masks_reproduced_in_recompute(patched, checkpointed, monkeypatch):
    """With LoRA dropout, each tile's recompute draws its forward masks again: gradients equal those of the same
    tiles run with autograd from the same seed (without the RNG restore they would not)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_llama_lora(lora_dropout=0.3).to(DEVICE)  # on CUDA: the recompute restores CUDA's RNG state
    if patched:
        leantune.patch(model)
    mlp = first_mlp(model)
    inner = mlp.forward
    enable_tiled_mlp(model, tile_tokens=4)
    x = torch.randn(2, 5, 64, device=DEVICE, requires_grad=True)
    grad_y = torch.randn(2, 5, 64, device=DEVICE)
    wanted = [x] + [p for p in mlp.parameters() if p.requires_grad]

    torch.manual_seed(1234)
    tokens = x.reshape(-1, 64)
    ref_y = torch.cat([inner(tokens[s:s + 4][None]) for s in range(0, 10, 4)], dim=1).view(2, 5, 64)
    ref_grads = torch.autograd.grad(ref_y, wanted, grad_y)

    torch.manual_seed(1234)
    y = checkpoint(mlp, x, use_reentrant=False) if checkpointed else mlp(x)
    grads = torch.autograd.grad(y, wanted, grad_y)
    assert torch.equal(y, ref_y)
    assert torch.equal(grads[0], ref_grads[0])
    for g, ref in zip(grads[1:], ref_grads[1:]):
        assert rel_err(g, ref) <= 1e-5


def test_tiled_with_checkpointing_and_offload(monkeypatch):
    """On the CPU on purpose: the loss is bit-identical across tile sizes there (module docstring)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_llama_lora()
    leantune.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    input_ids = torch.randint(3, VOCAB, (3, 23))
    ref_loss, ref_grads = step(model, input_ids)
    enable_offloaded_checkpoints(model, min_bytes=0)
    enable_tiled_mlp(model, tile_tokens=48)
    loss, grads = step(model, input_ids)
    assert torch.equal(loss, ref_loss)
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) <= 1e-5, name


def test_functional_matches_float64_without_input_grad():
    """A plain callable with parameters; x needs no gradient (the first layer of a frozen stack)."""
    w1 = torch.randn(40, 24, device=DEVICE, requires_grad=True)
    w2 = torch.randn(24, 40, device=DEVICE, requires_grad=True)
    x = torch.randn(3, 11, 24, device=DEVICE)

    def forward(h):
        return F.silu(h @ w1.T) @ w2.T

    with fp32_products():
        y = tiled_mlp(forward, x, [w1, w2], tile_tokens=6)
        grad_y = torch.randn_like(y)
        d1, d2 = torch.autograd.grad(y, [w1, w2], grad_y)
    ref_y, (_, r1, r2) = grads64(lambda h, a, b: F.silu(h @ a.T) @ b.T, [x, w1, w2], grad_y)
    assert_close("y", y, ref_y, torch.float32)
    assert_close("dw1", d1, r1, torch.float32)
    assert_close("dw2", d2, r2, torch.float32)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_bad_tile_tokens_named(bad):
    with pytest.raises(ValueError, match="tile_tokens must be an int >= 1"):
        tiled_mlp(lambda h: h, torch.randn(4, 8), tile_tokens=bad)
    with pytest.raises(ValueError, match="tile_tokens"):
        enable_tiled_mlp(tiny_llama_lora(), tile_tokens=bad)


def test_recompute_runs_under_the_forwards_autocast():
    """The backward (autograd's thread, autocast off there) recomputes each tile under the forward's autocast."""
    w = torch.randn(16, 8, requires_grad=True)
    seen = []

    def forward(h):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return torch.tanh(h @ w.T)

    x = torch.randn(2, 5, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tiled_mlp(forward, x, [w], tile_tokens=4)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert seen == [(False, True, torch.bfloat16)] * 3 + [(True, True, torch.bfloat16)] * 3
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    ref_y, (ref_x, ref_w) = grads64(lambda h, a: torch.tanh(h @ a.T), [x, w], torch.ones(2, 5, 16))
    eager_x = torch.autograd.grad(torch.tanh(x.bfloat16() @ w.bfloat16().T).float().sum(), x)[0]
    assert_close("dx", x.grad, ref_x, torch.bfloat16, eager=eager_x)
    assert_close("y", y, ref_y, torch.bfloat16, eager=torch.tanh(x.bfloat16() @ w.bfloat16().T))
