"""FP8 frozen weights (ops/fp8.py, quantize "fp8"): quantisation against the e4m3 rounding rule in float64, the
emulated GEMMs within the error bound of docs/design.md ("FP8 frozen weights"), the LoRA ops over an FP8 base
against float64 of the same quantised arithmetic, and leantune.quantize(model, "fp8") with PEFT in both orders.
All on the torch backend (the reference; the Triton kernels of ops/fp8.py equal it bit for bit: test_fp8_kernels.py)."""

import math

import pytest
import torch
from reference import assert_close, loss_and_grads, rel_err

import leantune
from leantune import ops
from leantune.ops import fp8, fp8_group

F64 = torch.float64
U = 2.0 ** -4  # e4m3 unit roundoff (3 mantissa bits, round to nearest)


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")


def e4m3_round64(v):
    """float64 ``v`` rounded to the e4m3fn grid (spacing 2^(e - 3) for |v| in [2^e, 2^(e+1)), e >= -6; 2^-9 below),
    to nearest even, saturated at +-448: the rounding rule written from the format, not through torch's cast."""
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6))).clamp(min=-6)
    step = torch.exp2(e - 3)
    return (torch.round(v / step) * step).clamp(-448.0, 448.0)


def quantize_rows64(t):
    """(q float64, scale float64) from the module docstring's formulas; the fp32 roundings of s = absmax / 448 and
    t / s are formed in float64 and rounded once to fp32 (exactly the fp32 operations)."""
    t64 = t.to(F64)
    scale = (t64.abs().amax(dim=1) / 448.0).float().clamp(min=2.0 ** -126).to(F64)
    return e4m3_round64((t64 / scale[:, None]).float().to(F64)), scale


def dequant64(q, scale):
    return q.to(F64) * scale.to(F64)[:, None]


def test_quantize_rows_matches_the_e4m3_rounding_rule_with_zero_rows_and_saturation():
    t = torch.randn(37, 50) * torch.logspace(-3, 3, 37)[:, None]
    t[3] = 0.0  # an all-zero row: scale floor, codes 0
    t[5, :7] = torch.tensor([1e-9, -1e-9, 1e-7, 3.0, -2.0, 0.5, 0.0])  # subnormal codes after scaling
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, scale = fp8.quantize_rows(t.to(dtype))
        q64, scale64 = quantize_rows64(t.to(dtype))
        assert q.dtype == fp8.E4M3 and scale.dtype == torch.float32 and scale.shape == (37,)
        assert torch.equal(scale.to(F64), scale64), dtype
        assert torch.equal(q.to(F64), q64), dtype
        assert scale[3] == 2.0 ** -126 and not q[3].float().any()
        assert torch.equal(q.float().abs().amax(dim=1)[torch.arange(37) != 3], torch.full((36,), 448.0))
    # saturation: a value whose fp32 quotient rounds above 448 (and a row holding huge values) stays finite
    big = torch.tensor([[3.0e38, -3.0e38, 1.0], [448.0 * (1 + 2 ** -23), 1.0, -1.0]])
    q, scale = fp8.quantize_rows(big)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() == 448.0


def test_quantize_fp8_dequantises_within_half_an_e4m3_step_and_round_trips():
    w = torch.randn(48, 40, dtype=torch.bfloat16)
    wq = ops.quantize_fp8(w, name="layer")
    assert isinstance(wq, ops.FP8Weight) and wq.shape == (48, 40) and wq.dtype == torch.bfloat16
    assert wq.nbytes == 48 * 40 + 4 * 48
    deq = ops.dequantize_fp8(wq, torch.float32).to(F64)
    scale64 = wq.scale.to(F64)[:, None]
    err = (deq - w.to(F64)).abs()
    assert (err <= U * w.to(F64).abs() + 2.0 ** -10 * scale64).all()  # normal: relative u; subnormal: half spacing
    assert torch.equal(ops.dequantize_fp8(wq), dequant64(wq.qweight, wq.scale).to(torch.bfloat16))


def gemm_bound(x64, w64, sx, sw):
    """The elementwise bound on |x^ w^^T - x w^T| of the module docstring, float64 [M, N]."""
    k = x64.shape[1]
    ax, aw = x64.abs(), w64.abs()
    return ((2 * U + U * U + k * 2.0 ** -24) * (ax @ aw.T)
            + 2.0 ** -10 * (1 + U) * (sx[:, None] * aw.sum(1)[None, :] + sw[None, :] * ax.sum(1)[:, None])
            + 2.0 ** -20 * k * sx[:, None] * sw[None, :])


def test_emulated_gemms_are_within_the_derived_e4m3_bound():
    x, w, dy = torch.randn(33, 96), torch.randn(80, 96) * 0.05, torch.randn(33, 80)
    x[0, :5] = 1e-6  # tiny entries: the subnormal terms of the bound
    wq = ops.quantize_fp8(w)
    y = fp8.fp8_linear(x, wq, out_dtype=torch.float32).to(F64)
    err = (y - x.to(F64) @ w.to(F64).T).abs()
    bound = gemm_bound(x.to(F64), w.to(F64), fp8.quantize_rows(x)[1].to(F64), wq.scale.to(F64))
    assert (err <= bound).all() and err.max() > 0
    assert err.norm() / (x.to(F64) @ w.to(F64).T).norm() < 0.1  # typical error well inside the worst case
    dx = fp8.fp8_grad_input(dy, wq, out_dtype=torch.float32).to(F64)
    # dX = (dY diag(s_w)) Wq: both factors are e4m3-rounded (g per row, Wq per column of the reduction)
    g = dy.to(F64) * wq.scale.to(F64)[None, :]
    ref = dy.to(F64) @ w.to(F64)
    bound = gemm_bound(g, w.to(F64).T / wq.scale.to(F64)[None, :], fp8.quantize_rows(g.float())[1].to(F64),
                       torch.ones(96, dtype=F64))
    bound += U * (g.abs() @ (w.to(F64).abs() / wq.scale.to(F64)[:, None]))  # Wq itself rounded: |dW| <= u|W|
    assert ((dx - ref).abs() <= bound).all()


def lora_factors(n_in, n_out, rank=4, dtype=torch.float32):
    w = torch.randn(n_out, n_in) / math.sqrt(n_in)
    return (ops.quantize_fp8(w.to(dtype)), (torch.randn(rank, n_in) * 0.1).requires_grad_(),
            (torch.randn(n_out, rank) * 0.1).requires_grad_())


def reference_projection(x, dy, w, lora_A, lora_B, scaling):
    """float64 of the op's quantised arithmetic: (y, dX term, dA, dB) for one projection."""
    xq, xs = fp8.quantize_rows(x.detach())
    x64, dy64, a64, b64 = (t.detach().to(F64) for t in (x, dy, lora_A, lora_B))
    y = dequant64(xq, xs) @ dequant64(w.qweight, w.scale).T + scaling * (x64 @ a64.T) @ b64.T
    gq, gs = fp8.quantize_rows(dy.float() * w.scale[None, :])
    dx = dequant64(gq, gs) @ w.qweight.to(F64) + scaling * (dy64 @ b64) @ a64
    return y, dx, scaling * (dy64 @ b64).T @ x64, scaling * dy64.T @ (x64 @ a64.T)


def test_lora_linear_and_qkv_on_an_fp8_base_match_float64_of_the_same_arithmetic():
    x = torch.randn(2, 13, 48, requires_grad=True)
    projs = [lora_factors(48, n) for n in (48, 16, 16)]
    dys = [torch.randn(2, 13, n) for n in (48, 16, 16)]
    y = ops.lora_linear(x, *projs[0], 0.5)
    y.backward(dys[0])
    ref = reference_projection(x.reshape(-1, 48), dys[0].reshape(-1, 48), *projs[0], 0.5)
    for name, out, r in zip(("y", "dx", "dA", "dB"), (y, x.grad, projs[0][1].grad, projs[0][2].grad), ref):
        assert_close(name, out.reshape(r.shape), r, torch.float32)
    x.grad = None
    for _, a, b in projs:
        a.grad = b.grad = None
    outs = ops.lora_qkv(x, *(ops.LoraWeights(w, a, b, s) for (w, a, b), s in zip(projs, (0.5, 2.0, 1.0))))
    torch.autograd.backward(outs, dys)
    dys2d = [dy.reshape(-1, dy.shape[-1]) for dy in dys]
    dx_ref = reference_group_base_dx(dys2d, [w for w, _, _ in projs])  # one e4m3 GEMM over q, k, v
    for (w, a, b), s, out, dy in zip(projs, (0.5, 2.0, 1.0), outs, dys2d):
        y64, _, da64, db64 = reference_projection(x.reshape(-1, 48), dy, w, a, b, s)
        dx_ref = dx_ref + s * (dy.to(F64) @ b.detach().to(F64)) @ a.detach().to(F64)
        assert_close("qkv y", out.reshape(y64.shape), y64, torch.float32)
        assert_close("qkv dA", a.grad, da64, torch.float32)
        assert_close("qkv dB", b.grad, db64, torch.float32)
    assert_close("qkv dx", x.grad.reshape(dx_ref.shape), dx_ref, torch.float32)


def reference_group_base_dx(dys, ws):
    """float64 of a group's one dX GEMM: g = [dY_1 diag(s_1), ..., dY_k diag(s_k)] quantised per row over all
    parts (codes and scales from the float64 rounding rule), times [Wq_1; ...; Wq_k]."""
    gq, gs = quantize_rows64(torch.cat([dy.float() * w.scale[None, :] for dy, w in zip(dys, ws)], dim=1))
    return (gq * gs[:, None]) @ torch.cat([w.qweight.to(F64) for w in ws], dim=0)


def test_grouped_grad_input_is_one_quantisation_over_the_parts_within_the_e4m3_bound():
    """quantize_grad_outputs is quantize_rows of the side-by-side fp32 products (rows whose parts differ by 10^4
    included: they share one scale); fp8_grad_input_group is float64 of its codes times the stacked weight codes,
    and within the bound of one e4m3 GEMM of reduction length sum out_j, as the separate dX sum is for each part."""
    ws = [ops.quantize_fp8(torch.randn(n, 40) * 0.05) for n in (64, 24, 24)]
    dys = [torch.randn(11, n) * m for n, m in ((64, 1.0), (24, 1e-4), (24, 3.0))]
    dys[1] = torch.randn(11, 48)[:, ::2] * 1e-4  # a strided dY
    g = torch.cat([dy.float() * w.scale[None, :] for dy, w in zip(dys, ws)], dim=1)
    q, scale = fp8_group.quantize_grad_outputs(dys, ws)
    q64, scale64 = quantize_rows64(g)
    assert q.shape == (11, 112) and torch.equal(q.to(F64), q64) and torch.equal(scale.to(F64), scale64)
    dx = fp8_group.fp8_grad_input_group(dys, ws, out_dtype=torch.float32)
    ref = reference_group_base_dx(dys, ws)
    assert_close("grouped dx", dx, ref, torch.float32)
    exact = sum(dy.to(F64) @ dequant64(w.qweight, w.scale) for dy, w in zip(dys, ws))
    wq64 = torch.cat([w.qweight.to(F64) for w in ws], dim=0)
    bound = gemm_bound(g.to(F64), wq64.T, scale.to(F64), torch.ones(40, dtype=F64))
    assert ((dx.to(F64) - exact).abs() <= bound).all()
    for dt in (torch.bfloat16, torch.float16):  # the compute dtype out, and dY's of a low-precision dtype
        dys_dt = [dy.to(dt) for dy in dys]
        got = fp8_group.fp8_grad_input_group(dys_dt, ws, out_dtype=dt)
        assert got.dtype == dt
        assert_close(f"grouped dx {dt}", got, reference_group_base_dx(dys_dt, ws), dt)
    with pytest.raises(ValueError, match=r"dys\[1\]/ws\[1\]: a group's weights share in features \(40\)"):
        fp8_group.quantize_grad_outputs(dys[:2], [ws[0], ops.quantize_fp8(torch.randn(24, 8))])
    with pytest.raises(ValueError, match=r"dys\[2\]/ws\[2\].*dY \(11, 24\) torch.bfloat16"):
        fp8_group.quantize_grad_outputs([dys[0], dys[1], dys[2].bfloat16()], ws)
    with pytest.raises(ValueError, match="dY must have 24 columns"):
        fp8_group.fp8_grad_input_group([dys[0], dys[0]], ws[:2], out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"ws\[1\] must be an FP8Weight, got Tensor"):
        fp8_group.quantize_grad_outputs(dys[:2], [ws[0], torch.ones(24, 40)])
    with pytest.raises(ValueError, match="same non-zero length"):
        fp8_group.quantize_grad_outputs(dys, ws[:2])
    assert fp8_group.grouped_grad_input_ok(dys, ws) and not fp8_group.grouped_grad_input_ok(dys[:1], ws[:1])
    assert not fp8_group.grouped_grad_input_ok(dys[:2], [ws[0], ops.quantize_fp8(torch.randn(24, 8))])


@pytest.mark.parametrize("grouped", (False, True))
def test_lora_mlp_on_an_fp8_base_is_its_composition_of_fp8_lora_linears(monkeypatch, grouped):
    """The node's passes equal lora_linear (proven above against float64) composed with ops.swiglu; with the
    grouped dX GEMM (the default) gate's and up's base dX terms are instead one fp8_grad_input_group of their dY's."""
    monkeypatch.setattr(fp8_group, "GROUPED_GRAD_INPUT", grouped)
    x = torch.randn(19, 32, requires_grad=True)
    gate, up, down = lora_factors(32, 48), lora_factors(32, 48), lora_factors(48, 32)
    dy = torch.randn(19, 32)
    y = ops.lora_mlp(x, *(ops.LoraWeights(*p, 0.5) for p in (gate, up, down)))
    y.backward(dy)
    got = [x.grad] + [t.grad for p in (gate, up, down) for t in p[1:]]
    x2 = x.detach().clone().requires_grad_()
    for p in (gate, up, down):
        p[1].grad = p[2].grad = None
    g, u = ops.lora_linear(x2, *gate, 0.5), ops.lora_linear(x2, *up, 0.5)
    g.retain_grad(), u.retain_grad()
    y2 = ops.lora_linear(ops.swiglu(g, u), *down, 0.5)
    y2.backward(dy)
    dx_ref = x2.grad
    if grouped:  # swap the two separate base terms for the group's one
        dgu, wgu = [g.grad, u.grad], [gate[0], up[0]]
        dx_ref = (dx_ref - sum(fp8.fp8_grad_input(d, w, out_dtype=torch.float32) for d, w in zip(dgu, wgu))
                  + fp8_group.fp8_grad_input_group(dgu, wgu, out_dtype=torch.float32))
        separate = x2.grad.to(F64)
        assert rel_err(got[0], separate) > 1e-4  # the grouped path is the one taken: its rounding differs
    assert_close("mlp y", y, y2, torch.float32)
    for name, out, ref in zip(("dx", "dA_g", "dB_g", "dA_u", "dB_u", "dA_d", "dB_d"), got,
                              [dx_ref] + [t.grad for p in (gate, up, down) for t in p[1:]]):
        assert_close(name, out, ref, torch.float32)


def test_bad_input_raises_a_clear_value_error():
    with pytest.raises(ValueError, match="w1: FP8 needs a 2-D"):
        ops.quantize_fp8(torch.randn(64), name="w1")
    with pytest.raises(ValueError, match="FP8 needs a 2-D"):
        ops.quantize_fp8(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="inf or NaN"):
        ops.quantize_fp8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="scale must be a float32 tensor of shape"):
        ops.FP8Weight(torch.zeros(4, 4, dtype=fp8.E4M3), torch.ones(3), torch.bfloat16)
    with pytest.raises(ValueError, match="qweight must be a contiguous 2-D float8_e4m3fn"):
        ops.FP8Weight(torch.zeros(4, 4), torch.ones(4), torch.bfloat16)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        fp8.quantize_rows(torch.ones(2, 3, 4))
    w = ops.quantize_fp8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="weight"):
        ops.lora_linear(torch.randn(3, 12), w, None, None, 0.0)


# -------------------------------------------------------------------------------------------- quantize + PEFT
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
VOCAB = 160


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config)


def peft_model(base, order, quant_type="fp8"):
    import copy

    model = copy.deepcopy(base)
    if order == "before":
        assert leantune.quantize(model, quant_type)["layers"] == 2 * 7
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                       init_lora_weights=False))
    if order == "after":
        leantune.quantize(model, quant_type)
    return model


def test_quantize_fp8_in_both_orders_with_peft_trains_and_saves(tiny_llama, tmp_path):
    from leantune.quantize import FP8Linear

    ids = torch.randint(0, VOCAB, (2, 24))
    dense = peft_model(tiny_llama, "none")
    dense_loss, dense_grads = loss_and_grads(dense, ids)
    results = []
    for order in ("after", "before"):
        model = peft_model(tiny_llama, order)
        q_proj = model.base_model.model.model.layers[1].self_attn.q_proj
        assert type(q_proj) is peft.tuners.lora.Linear and isinstance(q_proj.base_layer, FP8Linear)
        assert q_proj.lora_A["default"].weight.dtype == torch.float32  # PEFT read compute_dtype, not float8
        embed, head = model.base_model.model.model.embed_tokens, model.base_model.model.lm_head
        assert embed.weight.dtype == head.weight.dtype == torch.float32
        results.append((model, *loss_and_grads(model, ids)))
    (after, loss_after, grads_after), (before, loss, grads) = results
    assert torch.equal(loss, loss_after) and all(torch.equal(grads[n], grads_after[n]) for n in grads)
    # e4m3 per GEMM: typical relative error ~ u / sqrt(3) on each output; the loss moves by far less (measured
    # 1e-3 here); 2u / 10 leaves room and still fails for a wrong scale or a missing term
    assert abs(loss.item() - dense_loss.item()) <= 0.2 * U * dense_loss.item(), (loss.item(), dense_loss.item())
    leantune.patch(before)
    with pytest.MonkeyPatch.context() as mp:  # the per-projection dX of PEFT's modules: the same e4m3 roundings
        mp.setattr(fp8_group, "GROUPED_GRAD_INPUT", False)
        patched_loss, patched_grads = loss_and_grads(before, ids)
    assert before.base_model.model.leantune_summary["counts"]["lora"] == 2 * 7
    # the fused ops round fp32 activations differently (by ulps) from HF's modules; near an e4m3 midpoint an ulp
    # flips a code by one step (relative u), rarely (~ulp / step per element) but by far more than fp32's bar: one
    # flip in a [tokens, features] block moves its product by ~u / sqrt(features) (measured up to 4e-4 here). The
    # gradients sum a handful of such flips: worst relative error 6.6e-3 over 40 seeds, 1.03e-2 at seed 462769052;
    # 2e-2 keeps every seed and still fails for a wrong scale or a missing term (errors of order 1)
    assert rel_err(patched_loss, loss) <= 1e-4
    for n in grads:
        assert rel_err(patched_grads[n], grads[n]) <= 2e-2, n
    # the default, one dX GEMM for q/k/v and one for gate/up: other roundings (one row scale over the parts), as
    # far from the unquantised model's gradients as the per-projection ones (ratio measured 0.98-1.05 over seeds)
    grouped_loss, grouped_grads = loss_and_grads(before, ids)
    assert torch.equal(grouped_loss, patched_loss)  # the forward is unchanged

    def flat(g):
        return torch.cat([g[n].flatten() for n in grads])

    assert rel_err(flat(grouped_grads), flat(dense_grads)) <= 1.15 * rel_err(flat(grads), flat(dense_grads))
    assert 1e-4 < rel_err(flat(grouped_grads), flat(grads)) <= 3e-2  # taken, and an e4m3-sized difference
    opt = torch.optim.AdamW([p for p in before.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(8):
        opt.zero_grad()
        step_loss = before(input_ids=ids, labels=ids).loss
        step_loss.backward()
        opt.step()
        first = step_loss.item() if first is None else first
    assert step_loss.item() < first
    state = after.base_model.model.state_dict()
    key = "model.layers.0.mlp.down_proj.base_layer.weight"
    assert state[key].dtype == fp8.E4M3 and state[key.replace("weight", "weight_scale")].shape == (64,)
    after.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    fresh = peft_model(tiny_llama, "after")
    fresh.base_model.model.load_state_dict(state)
    assert torch.equal(loss_and_grads(fresh, ids)[0], loss_after)


def test_quantize_fp8_bytes_and_errors(tiny_llama):
    import copy

    model = copy.deepcopy(tiny_llama)
    done = leantune.quantize(model, "fp8")
    n_weights = done["bytes_before"] // 4  # fp32 model
    n_rows = sum(m.out_features for _, m in model.named_modules() if type(m).__name__ == "FP8Linear")
    assert done["bytes_after"] == n_weights + 4 * n_rows
    with pytest.raises(ValueError, match="quant_type must be one of"):
        leantune.quantize(copy.deepcopy(tiny_llama), "fp4")


@pytest.mark.parametrize("impl,quant_type", [("leantune+fp8", "fp8"), ("leantune+nf4fp8", "nf4-fp8")])
def test_bench_build_leantune_fp8_matches_the_whole_model_quantised(tmp_path, impl, quant_type):
    """``leantune+fp8``'s (``leantune+nf4fp8``'s) layer-by-layer build holds what building the bf16 model whole and
    quantising it gives (same e4m3 weights and scales, or NF4 codes and FP8 scales; same first loss)."""
    import dataclasses

    from leantune.bench import build
    from leantune.bench.step import RunSpec

    transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True).save_pretrained(tmp_path / "tiny")
    spec = RunSpec(impl, str(tmp_path / "tiny"), seq=24, batch=2, gc=False, warmup=0, steps=1, device="cpu")
    layerwise, config = build.build(spec)
    whole, _ = build.build(dataclasses.replace(spec, impl="hf+peft"))
    leantune.quantize(whole, quant_type)
    leantune.patch(whole)
    ours, theirs = ({**m.state_dict(), **dict(m.named_buffers())} for m in (layerwise, whole))
    assert ours.keys() == theirs.keys()
    assert any(t.dtype == (fp8.E4M3 if quant_type == "fp8" else torch.uint8) for t in ours.values())
    assert (quant_type == "nf4-fp8") == any(n.endswith("fp8_scale") for n in ours)
    assert all(torch.equal(ours[n].float(), theirs[n].float()) for n in ours)
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        assert torch.equal(layerwise(input_ids=ids, labels=ids).loss, whole(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("quant_type", ["fp8", "nf4", "nf4-fp8"])
def test_quantized_layers_keep_their_storage_through_dtype_casts(tiny_llama, quant_type):
    """``model.to(torch.bfloat16)``, ``.half()``, ``.float()`` after quantize: the codes, scales and tables keep their
    dtypes and bits (a cast of the e4m3 codes or fp32 scales would change them), the layers compute in the new
    dtype, and the model runs in it."""
    import copy

    from leantune.quantize import FP8Linear, NF4Linear

    model = copy.deepcopy(tiny_llama)
    leantune.quantize(model, quant_type)
    layers = [m for m in model.modules() if isinstance(m, (FP8Linear, NF4Linear))]
    assert len(layers) == 2 * 7
    stored = [{n: b.clone() for n, b in m.named_buffers() if b is not None} for m in layers]
    ids = torch.randint(0, VOCAB, (2, 9))
    for cast, dtype in ((lambda m: m.to(torch.bfloat16), torch.bfloat16), (lambda m: m.half(), torch.float16),
                        (lambda m: m.float(), torch.float32)):
        cast(model)
        for m, before in zip(layers, stored):
            after = dict(m.named_buffers())
            assert all(after[n].dtype == b.dtype and torch.equal(after[n].reshape(-1).view(torch.uint8),
                                                                 b.reshape(-1).view(torch.uint8))
                       for n, b in before.items()), (cast, type(m).__name__)
            assert m.compute_dtype == dtype
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        assert logits.dtype == dtype and torch.isfinite(logits).all()


def test_quantize_over_another_type_and_meta_weights_are_refused(tiny_llama):
    import copy

    model = copy.deepcopy(tiny_llama)
    leantune.quantize(model, "fp8")
    for quant_type in ("nf4", "nf4-fp8"):
        with pytest.raises(ValueError, match="already quantised otherwise .*model.layers.0.self_attn.q_proj in fp8"):
            leantune.quantize(model, quant_type)
    assert leantune.quantize(model, "fp8")["layers"] == 0  # the same type again: nothing left to quantise
    with torch.device("meta"):
        meta_model = transformers.AutoModelForCausalLM.from_config(tiny_llama.config)
    with pytest.raises(ValueError, match="q_proj: its weight is on the meta device"):
        leantune.quantize(meta_model, "fp8")
