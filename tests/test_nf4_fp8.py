"""NF4 storage with FP8 compute (ops/nf4_fp8.py ``with_fp8_compute`` / ``dequantize_nf4_fp8``, quantize "nf4-fp8"):
the scales and codes against the e4m3 rule in float64 and bit for bit against quantising the fp32 dequantised
weight, on both backends (the Triton kernel through the interpreter on CPU), the fused LoRA ops on such a weight
against the same ops on that FP8Weight, what the nodes keep, the errors, and a PEFT model quantised either way."""

import copy

import pytest
import reference
import test_fp8
import torch
from conftest import DEVICE
from test_fp8 import VOCAB, U, e4m3_round64, loss_and_grads, peft_model, rel_err

import leantune
from leantune import ops
from leantune.ops import _runtime, fp8, fp8_group
from leantune.ops.lora import api as lora_api
from leantune.ops.nf4 import dequantize_nf4, quantize_nf4
from leantune.ops.nf4_fp8 import dequantize_nf4_fp8, with_fp8_compute

F64 = torch.float64
# (rows, cols): 280 blocks (3 kernel programs, the last partial), a zero row, rows of 130 blocks, one block a row
SHAPES = [(40, 448), (72, 128), (3, 8320), (5, 64)]


def nf4_fp8(shape, scale=None):
    w = torch.randn(shape, device=DEVICE) * (scale or shape[1] ** -0.5)
    w[1] = 0.0  # an all-zero row: scale 2^-126, codes 0
    return with_fp8_compute(quantize_nf4(w))


@pytest.mark.parametrize("shape", SHAPES)
def test_codes_and_scales_follow_the_e4m3_rule_and_equal_quantising_the_fp32_weight(backend, shape):
    w = nf4_fp8(shape)
    v = dequantize_nf4(w, dtype=torch.float32)
    scale64 = (v.to(F64).abs().amax(dim=1) / 448.0).float().clamp(min=2.0 ** -126)
    assert torch.equal(w.fp8_scale, scale64)
    out = torch.full(shape, float("nan"), device=DEVICE).to(fp8.E4M3)  # poisoned workspace
    got = dequantize_nf4_fp8(w, out=out)
    assert got.qweight is out and got.scale is w.fp8_scale and got.dtype == w.dtype
    want = e4m3_round64((v.to(F64) / scale64.to(F64)[:, None]).float().to(F64))
    assert torch.equal(got.qweight.to(F64), want)
    ref = fp8.quantize_fp8(v)
    assert torch.equal(got.qweight.view(torch.uint8), ref.qweight.view(torch.uint8))
    assert torch.equal(got.scale, ref.scale)
    assert torch.all(got.qweight[1].to(F64) == 0) and got.scale[1] == 2.0 ** -126
    fresh = dequantize_nf4_fp8(w)  # allocated: the same codes
    assert torch.equal(fresh.qweight.view(torch.uint8), ref.qweight.view(torch.uint8))


H, INTER, R, ROWS = 128, 192, 4, 13


def proj(n_in, n_out):
    """(LoraWeights over an NF4 weight with FP8 compute, the same over its FP8Weight)."""
    w = nf4_fp8((n_out, n_in))
    a = (torch.randn(R, n_in, device=DEVICE) * n_in ** -0.5).requires_grad_()
    b = (torch.randn(n_out, R, device=DEVICE) * R ** -0.5).requires_grad_()
    return ops.LoraWeights(w, a, b, 2.0), ops.LoraWeights(fp8.quantize_fp8(dequantize_nf4(w, dtype=torch.float32)),
                                                          a, b, 2.0)


def test_fused_ops_on_nf4_fp8_weights_equal_the_ops_on_their_fp8_weights(backend):
    x = torch.randn(2, ROWS, H, device=DEVICE, requires_grad=True)
    (q, q8), (k, k8), (v, v8) = proj(H, 64), proj(H, 128), proj(H, 64)
    (gate, gate8), (up, up8), (down, down8) = proj(H, INTER), proj(H, INTER), proj(INTER, H)
    leaves = [x, q.lora_A, k.lora_B, gate.lora_A, down.lora_B]
    results = []
    for weights in ((q, k, v, gate, up, down), (q8, k8, v8, gate8, up8, down8)):
        outs = [ops.lora_linear(x, *weights[0])[0], *ops.lora_qkv(x, *weights[:3]), ops.lora_mlp(x, *weights[3:])]
        torch.manual_seed(7)
        dys = [torch.randn_like(o) for o in outs]
        results.append((outs, torch.autograd.grad(outs, leaves, dys)))
    (outs, grads), (outs8, grads8) = results
    for name, ours, theirs in zip(("linear", "q", "k", "v", "mlp", "dx", "dA_q", "dB_k", "dA_gate", "dB_down"),
                                  [*outs, *grads], [*outs8, *grads8]):
        assert torch.isfinite(ours).all() and torch.equal(ours, theirs), name


def test_nodes_keep_the_nf4_codes_and_reuse_one_e4m3_workspace_per_weight(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    (gate, _), (up, _), (down, _) = proj(H, INTER), proj(H, INTER), proj(INTER, H)
    x = torch.randn(ROWS, H, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ops.lora_mlp(x, gate, up, down)
    full = {(INTER, H), (H, INTER)}
    assert not [t for t in saved if tuple(t.shape) in full]  # neither e4m3 nor dense weights kept
    assert any(t.data_ptr() == gate.weight.codes.data_ptr() for t in saved)
    assert any(t.data_ptr() == gate.weight.fp8_scale.data_ptr() for t in saved)
    lora_api._workspaces.clear()
    allocated = []

    def counting(shape, dtype, device):
        allocated.append((tuple(shape), dtype))
        return reference.nan_allocator(shape, dtype, device)

    with _runtime.use_allocator(counting):
        for _ in range(2):
            ops.lora_mlp(x, gate, up, down).sum().backward()
    e4m3_sized = [s for s, dtype in allocated if s in full and dtype == fp8.E4M3]
    assert len(e4m3_sized) == 3, e4m3_sized  # gate, up, down: once each, not per call or per pass
    assert not [s for s, dtype in allocated if s in full and dtype != fp8.E4M3]  # no dense dequantisation


def test_errors_name_the_weight_and_what_was_expected():
    w = quantize_nf4(torch.randn(8, 128), name="layers.0.q_proj")
    with pytest.raises(ValueError, match="with_fp8_compute"):
        dequantize_nf4_fp8(w)
    with pytest.raises(ValueError, match="must be an NF4Weight"):
        with_fp8_compute(torch.randn(8, 128))
    with pytest.raises(ValueError, match=r"layers.0.q_proj: FP8 compute needs a 2-D .* multiple of 64"):
        with_fp8_compute(quantize_nf4(torch.randn(4, 96), name="layers.0.q_proj"))
    with pytest.raises(ValueError, match=r"layers.0.q_proj: FP8 compute needs a 2-D"):
        with_fp8_compute(quantize_nf4(torch.randn(2, 4, 64), name="layers.0.q_proj"))
    import dataclasses

    with pytest.raises(ValueError, match=r"fp8_scale must be a float32 tensor of shape \(8,\)"):
        dataclasses.replace(w, fp8_scale=torch.ones(7))
    with pytest.raises(ValueError, match=r"fp8_scale must be a float32 tensor"):
        dataclasses.replace(w, fp8_scale=torch.ones(8, dtype=torch.float64))
    good = with_fp8_compute(w)
    with pytest.raises(ValueError, match=r"out must be a contiguous float8_e4m3fn tensor of shape \(8, 128\)"):
        dequantize_nf4_fp8(good, out=torch.empty(8, 128))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_nf4_fp8(good, out=torch.empty(128, 8, dtype=fp8.E4M3).t())
    assert ops.fp8_gemms(good) and not ops.fp8_gemms(w) and not ops.fp8_gemms(torch.randn(2, 2))


# ------------------------------------------------------------------------------------------ quantize + PEFT
tiny_llama = test_fp8.tiny_llama  # the fixture: a tiny random Llama with hidden 64, intermediate 192


def test_quantize_nf4_fp8_with_peft_in_both_orders_patched_and_trained(tiny_llama, monkeypatch):
    from leantune.quantize import NF4Linear

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    ids = torch.randint(0, VOCAB, (2, 24))
    nf4_loss, _ = loss_and_grads(peft_model(tiny_llama, "after", "nf4"), ids)
    (after, (loss_after, grads_after)), (before, (loss, grads)) = [
        (m, loss_and_grads(m, ids)) for m in (peft_model(tiny_llama, o, "nf4-fp8") for o in ("after", "before"))]
    q_proj = before.base_model.model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj.base_layer, NF4Linear) and q_proj.base_layer.fp8_scale is not None
    assert "fp8 compute" in repr(q_proj.base_layer)
    assert torch.equal(loss, loss_after) and all(torch.equal(grads[n], grads_after[n]) for n in grads)
    # one more e4m3 rounding of each frozen weight and the GEMM inputs: the loss moves far less than u
    assert 0 < abs(loss.item() - nf4_loss.item()) <= 0.2 * U * nf4_loss.item(), (loss.item(), nf4_loss.item())
    state = before.base_model.model.state_dict()
    assert len([k for k in state if k.endswith("fp8_scale")]) == 2 * 7  # saved with the codes
    leantune.patch(before)
    with pytest.MonkeyPatch.context() as mp:  # the per-projection dX of PEFT's modules
        mp.setattr(fp8_group, "GROUPED_GRAD_INPUT", False)
        patched_loss, patched_grads = loss_and_grads(before, ids)
    assert before.base_model.model.leantune_summary["counts"]["lora"] == 2 * 7
    assert rel_err(patched_loss, loss) <= 1e-4  # as for "fp8": ulp-level input differences flip rare codes
    for n in grads:  # a flipped e4m3 code moves its element by 2^-3: up to 1.22e-2 on a 4-rank B (seed 1254651776)
        assert rel_err(patched_grads[n], grads[n]) <= 2e-2, n
    opt = torch.optim.AdamW([p for p in before.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(6):
        opt.zero_grad()
        step_loss = before(input_ids=ids, labels=ids).loss
        step_loss.backward()
        opt.step()
        first = step_loss.item() if first is None else first
    assert step_loss.item() < first


def test_quantize_nf4_fp8_bytes_and_refusal(tiny_llama):
    nf4_done = leantune.quantize(copy.deepcopy(tiny_llama), "nf4")
    model = copy.deepcopy(tiny_llama)
    done = leantune.quantize(model, "nf4-fp8")
    rows = sum(m.out_features for m in model.modules() if type(m).__name__ == "NF4Linear")
    assert done["layers"] == 14 and done["bytes_after"] == nf4_done["bytes_after"] + 4 * rows
    odd = copy.deepcopy(tiny_llama)
    odd.model.layers[0].mlp.down_proj = torch.nn.Linear(96, 64, bias=False)  # in = 96: not whole 64-blocks a row
    before = [type(m) for m in odd.modules()]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: NF4 with FP8 compute needs in_features"):
        leantune.quantize(odd, "nf4-fp8")
    assert [type(m) for m in odd.modules()] == before  # unchanged
