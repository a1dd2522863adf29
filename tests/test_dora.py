"""DoRA: ``ops.dora_linear`` against float64 formulas, and ``leantune.patch`` on PEFT's DoRA (``use_dora=True``).

The op reference is DoRA's forward written from the paper / PEFT (``m / ||W + s B A||_row`` detached, times
``x W^T + s x A^T B^T``, plus b) in float64, its gradients from float64 autograd. The model test compares the patched
model with PEFT 0.21's own DoRA forward (the unpatched model): loss and every LoRA / magnitude gradient, fp32.

Tensors and models live on ``conftest.DEVICE`` (the CPU here, the Triton backend through the interpreter; the card on
CUDA, where TF32 is off for cuBLAS in every test: the fp32 references keep full fp32 products).
"""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import DEVICE
from reference import F64, fp32_products, rel_err, tolerance
from test_patch_families import assert_grads_close, batch, loss_and_grads, tiny_peft_model

import leantune
from leantune import ops
from leantune.ops.lora import dora_weight_norm


@pytest.fixture(autouse=True)
def _fp32_products():
    with fp32_products():
        yield


def dora_reference(x, weight, lora_A, lora_B, scaling, magnitude, bias):
    """DoRA's forward in float64 from the formula (the norm formed from W + s B A in full, detached)."""
    norm = torch.linalg.vector_norm(weight + scaling * lora_B @ lora_A, dim=1).detach()
    return (magnitude / norm) * (x @ weight.T + scaling * (x @ lora_A.T) @ lora_B.T) + bias


@pytest.mark.parametrize("with_bias", [True, False])
def test_dora_linear_matches_float64_formula(backend, with_bias):
    rows, inner, out, rank, scaling = 7, 24, 20, 3, 0.7
    x = torch.randn(2, rows, inner, device=DEVICE, requires_grad=True)
    weight = torch.randn(out, inner, device=DEVICE) / inner ** 0.5
    lora_A = torch.randn(rank, inner, device=DEVICE, requires_grad=True)
    lora_B = torch.randn(out, rank, device=DEVICE, requires_grad=True)
    magnitude = (torch.rand(out, device=DEVICE) + 0.5).requires_grad_()
    bias = torch.randn(out, device=DEVICE, requires_grad=True) if with_bias else None
    y = ops.dora_linear(x, weight, lora_A, lora_B, scaling, magnitude, bias)
    leaves = [t for t in (x, lora_A, lora_B, magnitude, bias) if t is not None]
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.detach().to(F64).requires_grad_() for t in leaves]
    x64, a64, b64, m64 = ref_leaves[:4]
    bias64 = ref_leaves[4] if with_bias else torch.zeros(out, dtype=F64, device=DEVICE)
    ref = dora_reference(x64, weight.to(F64), a64, b64, scaling, m64, bias64)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.to(F64))
    assert y.dtype == torch.float32 and y.shape == (2, rows, out)
    assert rel_err(y, ref) <= 1e-5
    for name, got, want in zip(["x", "lora_A", "lora_B", "magnitude", "bias"], grads, ref_grads):
        assert rel_err(got, want) <= 1e-5, f"d{name}: {rel_err(got, want):.3g}"


def test_lora_qkv_with_dora_projections_matches_float64(backend):
    """q DoRA (with bias), k plain LoRA, v frozen with bias, in one node: each output and every gradient."""
    rows, hidden, rank = 5, 16, 2
    outs, scalings = (12, 8, 8), (0.5, 2.0, 0.0)
    x = torch.randn(rows, hidden, device=DEVICE, requires_grad=True)
    weights = [torch.randn(o, hidden, device=DEVICE) / hidden ** 0.5 for o in outs]
    a_q, a_k = (torch.randn(rank, hidden, device=DEVICE, requires_grad=True) for _ in range(2))
    b_q = torch.randn(outs[0], rank, device=DEVICE, requires_grad=True)
    b_k = torch.randn(outs[1], rank, device=DEVICE, requires_grad=True)
    m_q = (torch.rand(outs[0], device=DEVICE) + 0.5).requires_grad_()
    bias_q = torch.randn(outs[0], device=DEVICE, requires_grad=True)
    bias_v = torch.randn(outs[2], device=DEVICE, requires_grad=True)
    q = ops.DoraWeights(weights[0], a_q, b_q, scalings[0], m_q, bias_q)
    k = ops.LoraWeights(weights[1], a_k, b_k, scalings[1])
    v = ops.LoraWeights(weights[2], None, None, 0.0, bias_v)
    ys = ops.lora_qkv(x, q, k, v)
    leaves = [x, a_q, b_q, m_q, bias_q, a_k, b_k, bias_v]
    dys = [torch.randn_like(y) for y in ys]
    grads = torch.autograd.grad(ys, leaves, dys)
    r = [t.detach().to(F64).requires_grad_() for t in leaves]
    w64 = [w.to(F64) for w in weights]
    refs = (dora_reference(r[0], w64[0], r[1], r[2], scalings[0], r[3], r[4]),
            r[0] @ w64[1].T + scalings[1] * (r[0] @ r[5].T) @ r[6].T,
            r[0] @ w64[2].T + r[7])
    ref_grads = torch.autograd.grad(refs, r, [dy.to(F64) for dy in dys])
    for y, ref in zip(ys, refs):
        assert rel_err(y, ref) <= 1e-5
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        assert rel_err(got, want) <= 1e-5, f"gradient {i}: {rel_err(got, want):.3g}"


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_weight_norm_by_expansion_matches_full_norm(backend, weight_dtype):
    """||W + s B A|| per row from ||W||^2, W A^T and A A^T (no [out, in] temporary) against the norm of the full
    matrix in float64; a bf16 W with fp32 adapters takes the skinny kernel on the Triton path."""
    out, inner, rank, scaling = 33, 40, 5, 1.3
    weight = torch.randn(out, inner, device=DEVICE).to(weight_dtype)
    lora_A, lora_B = torch.randn(rank, inner, device=DEVICE), torch.randn(out, rank, device=DEVICE)
    meta = ops.lora.api._meta(["the"], [((weight, lora_A, lora_B, None), scaling)], torch.empty(1, inner,
                              dtype=weight_dtype, device=DEVICE), 0.0, False)
    got = dora_weight_norm(weight, lora_A, lora_B, scaling, meta)
    want = torch.linalg.vector_norm(weight.to(F64) + scaling * lora_B.to(F64) @ lora_A.to(F64), dim=1)
    assert got.dtype == torch.float32 and got.shape == (out,)
    assert rel_err(got, want) <= 1e-5


def test_frozen_row_norms_are_kept_until_the_weight_changes(backend):
    """||W||^2 of a frozen W is formed once and reused (the same tensor back, no launch); an in-place change of W
    (its version counter) or a trainable W recomputes it, so the norm always follows W."""
    out, inner, rank, scaling = 17, 24, 3, 0.7
    weight = torch.randn(out, inner, device=DEVICE).bfloat16()
    lora_A, lora_B = torch.randn(rank, inner, device=DEVICE), torch.randn(out, rank, device=DEVICE)

    def want():
        return torch.linalg.vector_norm(weight.to(F64) + scaling * lora_B.to(F64) @ lora_A.to(F64), dim=1)

    first = ops.lora.dora._row_sumsq(weight)
    assert ops.lora.dora._row_sumsq(weight) is first
    assert rel_err(dora_weight_norm(weight, lora_A, lora_B, scaling), want()) <= 1e-5
    weight.mul_(-3.0)  # in place: a new version
    assert ops.lora.dora._row_sumsq(weight) is not first
    assert rel_err(dora_weight_norm(weight, lora_A, lora_B, scaling), want()) <= 1e-5
    trainable = weight.float().requires_grad_()
    assert ops.lora.dora._row_sumsq(trainable) is not ops.lora.dora._row_sumsq(trainable)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_column_dot_matches_float64(dtype, monkeypatch):
    """The Triton column dot (DoRA's dm = sum_i dY_ij u_ij): fp32 products and sums of 16-bit inputs read as stored,
    against float64, on shapes off the block sizes, split over rows (partials) and with a column-strided input."""
    from leantune.ops.lora import column_kernels

    for rows, cols, per_sm in ((37, 300, 4), (200, 129, 64), (1, 5, 4)):
        a = torch.randn(rows, cols, device=DEVICE).to(dtype)
        b = torch.randn(rows, 2 * cols, device=DEVICE).to(dtype)[:, ::2]  # column stride 2
        got = column_kernels.column_dot(a, b, per_sm=per_sm)
        want = (a.to(F64) * b.to(F64)).sum(0)
        assert got.dtype == torch.float32 and got.shape == (cols,)
        assert rel_err(got, want) <= 1e-6, (rows, cols)
    assert torch.equal(column_kernels.column_dot(a[:0], b[:0]), torch.zeros(a.shape[1], device=DEVICE))
    with pytest.raises(ValueError, match="column_dot takes two"):
        column_kernels.column_dot(a, b[:, :-1])


def _strided_rows(rows, cols, dtype, scale=1.0):
    """A [rows, cols] tensor with row stride 2 * cols + 3 (a view into a wider buffer: no unit row layout)."""
    return (scale * torch.randn(rows, 2 * cols + 3, device=DEVICE)).to(dtype)[:, 1:cols + 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_column_scale_matches_torch_bitwise(dtype):
    """DoRA's y = g u (+ b) and dY' = g dY on the Triton path (one kernel, fp32 registers, one rounding) against
    torch's fp32 evaluation of the same inputs, ``torch.mul`` / ``torch.addcmul`` into a 16-bit ``out``: bit for bit
    (without a bias on the card too; with one, the CUDA compilers' FMA contraction may differ by one rounding), on
    shapes off the 64 x 128 tile, row-strided and column-strided inputs, 16-bit and fp32 biases, and in place."""
    from leantune.ops.lora import column_kernels

    for rows, cols in ((70, 300), (1, 5), (129, 128)):
        scale = torch.rand(cols, device=DEVICE) * 2 + 0.1
        inputs = (_strided_rows(rows, cols, dtype, 3.0),
                  (3.0 * torch.randn(rows, 2 * cols, device=DEVICE)).to(dtype)[:, ::2])  # column stride 2
        for x in inputs:
            for bias in (None, torch.randn(cols, device=DEVICE).to(dtype), torch.randn(cols, device=DEVICE)):
                got = column_kernels.column_scale(x, scale, bias)
                want = torch.empty(x.shape, dtype=dtype, device=DEVICE)
                if bias is None:
                    torch.mul(x, scale, out=want)
                else:
                    torch.addcmul(bias, x, scale, out=want)
                assert got.dtype == dtype and got.shape == x.shape
                if bias is None or DEVICE == "cpu":
                    assert torch.equal(got, want), (rows, cols, x.stride(), None if bias is None else bias.dtype)
                else:
                    assert (got.float() - want.float()).abs().le(want.float().abs() * 2.0 ** -7).all()
                ref = x.to(F64) * scale.to(F64) + (0.0 if bias is None else bias.to(F64))
                assert rel_err(got, ref) <= 2.0 ** -8  # one 16-bit rounding (bf16 unit roundoff)
        x = inputs[0].contiguous()
        want = torch.mul(x, scale, out=torch.empty_like(x))
        assert column_kernels.column_scale(x, scale, out=x) is x and torch.equal(x, want)  # in place
    assert column_kernels.column_scale(x[:0], scale).shape == (0, x.shape[1])
    with pytest.raises(ValueError, match="scale must be"):
        column_kernels.column_scale(x, scale[:-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scale_column_dot_is_column_scale_and_column_dot_in_one_pass(dtype):
    """DoRA's backward kernel: dY' = g dY bit for bit as :func:`column_scale` (and torch.mul), dm's sum bit for bit as
    :func:`column_dot` with the same split-M partials and within 1e-6 of float64, on shapes off the tiles, split over
    rows (per_sm 64: partials under the interpreter's four programs too), strided inputs, in place into dY."""
    from leantune.ops.lora import column_kernels

    for rows, cols, per_sm in ((37, 300, 4), (200, 129, 64), (1, 5, 4)):
        dy = _strided_rows(rows, cols, dtype)
        u = torch.randn(rows, 2 * cols, device=DEVICE).to(dtype)[:, ::2]  # column stride 2
        scale = torch.rand(cols, device=DEVICE) + 0.5
        scaled, dot = column_kernels.scale_column_dot(dy, u, scale, per_sm=per_sm)
        assert scaled.dtype == dtype and scaled.shape == (rows, cols) and dot.dtype == torch.float32
        assert torch.equal(scaled, torch.mul(dy, scale, out=torch.empty(rows, cols, dtype=dtype, device=DEVICE)))
        assert torch.equal(scaled, column_kernels.column_scale(dy, scale))
        assert torch.equal(dot, column_kernels.column_dot(dy, u, per_sm=per_sm)), (rows, cols)
        assert rel_err(dot, (dy.to(F64) * u.to(F64)).sum(0)) <= 1e-6
        inplace = dy.clone()
        out, dot_inplace = column_kernels.scale_column_dot(inplace, u, scale, out=inplace, per_sm=per_sm)
        assert out is inplace and torch.equal(inplace, scaled) and torch.equal(dot_inplace, dot)
    empty, zeros = column_kernels.scale_column_dot(dy[:0], u[:0], scale)
    assert empty.shape == (0, cols) and torch.equal(zeros, torch.zeros(cols, device=DEVICE))
    with pytest.raises(ValueError, match="scale_column_dot takes"):
        column_kernels.scale_column_dot(dy, u[:, :-1], scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowrank_add_with_dora_scaling_writes_u_and_y_in_one_pass(dtype):
    """DoRA's forward epilogue on the Triton low-rank add (fp32 adapters under a 16-bit base): u = base + s xa B^T
    in place, bit for bit the plain low-rank kernel's u, and y = g u + b bit for bit what :func:`column_scale` (and
    on the CPU torch.mul / torch.addcmul) forms from that u; both within two 16-bit roundings of float64. Shapes off
    the tiles, a row-strided base, ranks below and above one rank block (16), 16-bit and fp32 biases."""
    from leantune.ops.lora import column_kernels, kernels

    for rows, cols, rank in ((70, 300, 3), (1, 5, 1), (129, 130, 20)):
        wide = torch.randn(rows, 2 * cols + 3, device=DEVICE).to(dtype)
        xa, lora_B = torch.randn(rows, rank, device=DEVICE), torch.randn(cols, rank, device=DEVICE) / rank ** 0.5
        scale = torch.rand(cols, device=DEVICE) + 0.5
        for bias in (None, torch.randn(cols, device=DEVICE).to(dtype), torch.randn(cols, device=DEVICE)):
            plain_base, base = wide.clone()[:, 1:cols + 1], wide.clone()[:, 1:cols + 1]
            want_u, _ = kernels.lowrank_add_triton(plain_base, xa, lora_B.T, 0.7, dtype, None, 0, 0.0, None)
            u, y = kernels.lowrank_add_scale_triton(base, xa, lora_B.T, 0.7, dtype, scale, bias)
            assert u is base and torch.equal(u, want_u) and y.dtype == dtype
            assert torch.equal(y, column_kernels.column_scale(u, scale, bias))
            if DEVICE == "cpu":
                torch_y = torch.empty(rows, cols, dtype=dtype, device=DEVICE)
                if bias is None:
                    torch.mul(u, scale, out=torch_y)
                else:
                    torch.addcmul(bias, u, scale, out=torch_y)
                assert torch.equal(y, torch_y)
            u64 = wide[:, 1:cols + 1].to(F64) + 0.7 * xa.to(F64) @ lora_B.T.to(F64)
            y64 = scale.to(F64) * u64 + (0.0 if bias is None else bias.to(F64))
            assert rel_err(u, u64) <= 2.0 ** -7 and rel_err(y, y64) <= 2.0 ** -6, (rows, cols, rank)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_mlp_with_dora_16bit_step_matches_float64(backend, dtype):
    """A 16-bit gated MLP under fp32 adapters, every projection DoRA: gate with a bias, up with a frozen magnitude
    (dY' alone: the plain scale kernel on the Triton path), down trained (dY' and dm in one kernel); rows and
    widths off the tiles. The output and every gradient within the 16-bit bar of float64 (tests/reference.py)."""
    rows, hidden, inter, rank = 70, 40, 130, 4
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype).requires_grad_()
    leaf = lambda *shape: torch.randn(*shape, device=DEVICE, requires_grad=True)  # noqa: E731
    w_g, w_u = ((torch.randn(inter, hidden, device=DEVICE) / hidden ** 0.5).to(dtype) for _ in range(2))
    w_d = (torch.randn(hidden, inter, device=DEVICE) / inter ** 0.5).to(dtype)
    a_g, b_g, a_u, b_u = leaf(rank, hidden), leaf(inter, rank), leaf(rank, hidden), leaf(inter, rank)
    a_d, b_d = leaf(rank, inter), leaf(hidden, rank)
    m_g, m_d = ((torch.rand(n, device=DEVICE) + 0.5).requires_grad_() for n in (inter, hidden))
    m_u = torch.rand(inter, device=DEVICE) + 0.5
    bias_g = torch.randn(inter, device=DEVICE).to(dtype).requires_grad_()
    y = ops.lora_mlp(x, ops.DoraWeights(w_g, a_g, b_g, 0.5, m_g, bias_g), ops.DoraWeights(w_u, a_u, b_u, 2.0, m_u),
                     ops.DoraWeights(w_d, a_d, b_d, 1.5, m_d), activation="swiglu")
    leaves = [x, a_g, b_g, m_g, bias_g, a_u, b_u, a_d, b_d, m_d]
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)

    def formula(t, weights, m_up):
        gate = dora_reference(t[0], weights[0], t[1], t[2], 0.5, t[3], t[4])
        up = dora_reference(t[0], weights[1], t[5], t[6], 2.0, m_up, 0.0)
        return dora_reference(torch.nn.functional.silu(gate) * up, weights[2], t[7], t[8], 1.5, t[9], 0.0)

    r = [t.detach().to(F64).requires_grad_() for t in leaves]
    ref = formula(r, [w.to(F64) for w in (w_g, w_u, w_d)], m_u.to(F64))
    ref_grads = torch.autograd.grad(ref, r, dy.to(F64))
    e = [t.detach().to(dtype).requires_grad_() for t in leaves]
    eager = formula(e, [w_g, w_u, w_d], m_u.to(dtype))
    eager_grads = torch.autograd.grad(eager, e, dy)
    assert y.dtype == dtype
    assert rel_err(y, ref) <= tolerance(dtype, rel_err(eager, ref))
    for i, (got, want, base) in enumerate(zip(grads, ref_grads, eager_grads)):
        assert rel_err(got, want) <= tolerance(dtype, rel_err(base, want)), f"gradient {i}: {rel_err(got, want):.3g}"


def test_dora_magnitude_gradient_of_a_bf16_step_matches_float64(backend):
    """dm of a bf16 DoRA projection (the column dot on the Triton path, torch's chunks otherwise) within the bf16 bar
    of float64 autograd, like x's and the adapters' gradients."""
    rows, inner, out, rank, scaling = 45, 40, 130, 4, 0.5
    x = torch.randn(rows, inner, device=DEVICE).bfloat16().requires_grad_()
    weight = (torch.randn(out, inner, device=DEVICE) / inner ** 0.5).bfloat16()
    lora_A = torch.randn(rank, inner, device=DEVICE, requires_grad=True)
    lora_B = torch.randn(out, rank, device=DEVICE, requires_grad=True)
    magnitude = (torch.rand(out, device=DEVICE) + 0.5).requires_grad_()
    y = ops.dora_linear(x, weight, lora_A, lora_B, scaling, magnitude)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, lora_A, lora_B, magnitude), dy)
    leaves = [t.detach().to(F64).requires_grad_() for t in (x, lora_A, lora_B, magnitude)]
    ref = dora_reference(leaves[0], weight.to(F64), leaves[1], leaves[2], scaling, leaves[3], 0.0)
    ref_grads = torch.autograd.grad(ref, leaves, dy.to(F64))
    bf = [t.detach().bfloat16().requires_grad_() for t in (x, lora_A, lora_B, magnitude)]
    eager = dora_reference(bf[0], weight, bf[1], bf[2], scaling, bf[3], 0.0)
    eager_grads = torch.autograd.grad(eager, bf, dy)
    for got, want, base in zip(grads, ref_grads, eager_grads):
        assert rel_err(got, want) <= tolerance(torch.bfloat16, rel_err(base, want))


def test_dora_linear_rejects_bad_input():
    x, weight = torch.randn(3, 8), torch.randn(6, 8)
    lora_A, lora_B, magnitude = torch.randn(2, 8), torch.randn(6, 2), torch.rand(6) + 0.5
    with pytest.raises(ValueError, match="magnitude"):
        ops.dora_linear(x, weight, lora_A, lora_B, 1.0, torch.rand(5))
    with pytest.raises(ValueError, match="lora_A and lora_B must be tensors"):
        ops.dora_linear(x, weight, None, None, 1.0, magnitude)
    with pytest.raises(ValueError, match="dropout must be 0 when training"):
        ops.dora_linear(x, weight, lora_A, lora_B, 1.0, magnitude, dropout=0.1, training=True)
    # dropout inactive in eval: served
    y = ops.dora_linear(x, weight, lora_A, lora_B, 1.0, magnitude, dropout=0.1, training=False)
    assert y.shape == (3, 6)


def _dora_model(family, device=None):
    """A tiny PEFT DoRA model on ``device`` (None: the CPU) with its magnitudes moved off their init
    (m = ||W + s B A||, so m / n != 1)."""
    model = tiny_peft_model(family, device=device, use_dora=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1.0 + 0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize(("family", "impl", "shape"), [("llama", "torch", (2, 11)), ("qwen2", "torch", (2, 11)),
                                                       ("llama", "triton", (1, 6))])
def test_patched_dora_matches_peft(family, impl, shape, monkeypatch):
    """Patched vs PEFT's DoRA forward: loss and every lora_A / lora_B / magnitude gradient (qwen2: q/k/v biases)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", impl)
    model = _dora_model(family, DEVICE)
    model.train()
    input_ids, labels = batch(*shape, pad_last=1, device=DEVICE)
    ref_loss, _, ref_grads = loss_and_grads(model, input_ids, labels)
    assert sum("lora_magnitude_vector" in name for name in ref_grads) == 14
    calls = collections.Counter()
    for name in ("dora_linear", "lora_qkv", "lora_linear", "lora_mlp"):
        original = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, __n=name, __f=original, **k: calls.update([__n]) or __f(*a, **k))
    leantune.patch(model)
    summary = model.leantune_summary
    assert summary["counts"]["lora"] == 14 and summary["counts"]["dora"] == 14 and summary["unpatched"] == {}
    assert summary["counts"]["lora_qkv"] == 2 and summary["counts"]["lora_mlp"] == 2
    assert any("ops.dora_linear" in part for part in summary["fused"])
    loss, _, grads = loss_and_grads(model, input_ids, labels)
    # per layer: q/k/v in one lora_qkv node, the MLP in one lora_mlp node, o_proj through dora_linear
    assert calls == {"lora_qkv": 2, "lora_mlp": 2, "dora_linear": 2}, calls
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads, tol=1e-4)
    leantune.unpatch(model)


def test_dora_with_dropout_in_training_keeps_peft_forward(monkeypatch):
    """DoRA with lora_dropout in training: PEFT's forward, the summary says why; in eval the op serves it."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_peft_model("llama", device=DEVICE, use_dora=True, lora_dropout=0.1)
    model.train()
    input_ids, labels = batch(device=DEVICE)
    torch.manual_seed(0)
    ref_loss, _, _ = loss_and_grads(model, input_ids, labels)
    leantune.patch(model)
    summary = model.leantune_summary
    assert summary["counts"]["lora"] == 0 and len(summary["unpatched"]) == 14
    assert all("DoRA with lora_dropout in training" in why for why in summary["unpatched"].values())
    torch.manual_seed(0)  # PEFT's forward both times: the same masks
    loss, _, _ = loss_and_grads(model, input_ids, labels)
    assert rel_err(loss, ref_loss) <= 1e-5
    model.eval()
    leantune.patch(model)
    assert model.leantune_summary["counts"]["dora"] == 14


def test_dora_linear_frozen_magnitude_and_bf16_base(backend):
    """Only the adapters train (x and magnitude without grad); a bf16 base under fp32 adapters (PEFT's default
    autocast_adapter_dtype) stays within the bf16 bar of the float64 formula (docs/design.md tolerance rule)."""
    rows, inner, out, rank, scaling = 9, 32, 24, 4, 0.5
    x = torch.randn(rows, inner, device=DEVICE).bfloat16()
    weight = (torch.randn(out, inner, device=DEVICE) / inner ** 0.5).bfloat16()
    lora_A = torch.randn(rank, inner, device=DEVICE, requires_grad=True)
    lora_B = torch.randn(out, rank, device=DEVICE, requires_grad=True)
    magnitude = torch.rand(out, device=DEVICE) + 0.5
    y = ops.dora_linear(x, weight, lora_A, lora_B, scaling, magnitude)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (lora_A, lora_B), dy)
    ref_leaves = [t.detach().to(F64).requires_grad_() for t in (lora_A, lora_B)]
    ref = dora_reference(x.to(F64), weight.to(F64), *ref_leaves, scaling, magnitude.to(F64), 0.0)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.to(F64))
    bf = [t.detach().bfloat16().requires_grad_() for t in (lora_A, lora_B)]
    eager = dora_reference(x, weight, *bf, scaling, magnitude.bfloat16(), 0.0)
    eager_grads = torch.autograd.grad(eager, bf, dy)
    assert y.dtype == torch.bfloat16 and grads[0].dtype == torch.float32
    assert rel_err(y, ref) <= tolerance(torch.bfloat16, rel_err(eager, ref))
    for got, want, base in zip(grads, ref_grads, eager_grads):
        assert rel_err(got, want) <= tolerance(torch.bfloat16, rel_err(base, want))


@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh"])
def test_lora_mlp_with_dora_projections_matches_float64(backend, activation):
    """gate DoRA with a bias, up plain LoRA, down DoRA, in one node: the output and every gradient."""
    rows, hidden, inter, rank = 5, 16, 24, 2
    act = {"swiglu": torch.nn.functional.silu,
           "geglu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[activation]
    x = torch.randn(rows, hidden, device=DEVICE, requires_grad=True)
    leaf = lambda *shape: torch.randn(*shape, device=DEVICE, requires_grad=True)  # noqa: E731
    w_g, w_u = (torch.randn(inter, hidden, device=DEVICE) / hidden ** 0.5 for _ in range(2))
    w_d = torch.randn(hidden, inter, device=DEVICE) / inter ** 0.5
    a_g, b_g, a_u, b_u = leaf(rank, hidden), leaf(inter, rank), leaf(rank, hidden), leaf(inter, rank)
    a_d, b_d = leaf(rank, inter), leaf(hidden, rank)
    m_g = (torch.rand(inter, device=DEVICE) + 0.5).requires_grad_()
    m_d = (torch.rand(hidden, device=DEVICE) + 0.5).requires_grad_()
    bias_g = leaf(inter)
    y = ops.lora_mlp(x, ops.DoraWeights(w_g, a_g, b_g, 0.5, m_g, bias_g), ops.LoraWeights(w_u, a_u, b_u, 2.0),
                     ops.DoraWeights(w_d, a_d, b_d, 1.5, m_d), activation=activation)
    leaves = [x, a_g, b_g, m_g, bias_g, a_u, b_u, a_d, b_d, m_d]
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    r = [t.detach().to(F64).requires_grad_() for t in leaves]
    gate = dora_reference(r[0], w_g.to(F64), r[1], r[2], 0.5, r[3], r[4])
    up = r[0] @ w_u.to(F64).T + 2.0 * (r[0] @ r[5].T) @ r[6].T
    ref = dora_reference(act(gate) * up, w_d.to(F64), r[7], r[8], 1.5, r[9], 0.0)
    ref_grads = torch.autograd.grad(ref, r, dy.to(F64))
    assert rel_err(y, ref) <= 1e-5
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        assert rel_err(got, want) <= 1e-5, f"gradient {i}: {rel_err(got, want):.3g}"


def test_fused_gate_up_and_qkv_with_dora_match_peft(monkeypatch):
    """Phi-3 (fused qkv_proj and gate_up_proj): every DoRA projection through ops.dora_linear, as PEFT's DoRA."""
    import test_patch_structures as structures
    from peft import LoraConfig, get_peft_model

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    targets = list(structures.FAMILIES["phi3"].projections)
    model = get_peft_model(structures.tiny_model("phi3", DEVICE), LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False, use_dora=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1.0 + 0.3 * torch.randn_like(param))
    model.train()
    input_ids = torch.randint(3, structures.VOCAB, (2, 9), device=DEVICE)
    ref_loss, ref_grads = structures.loss_and_grads(model, input_ids, input_ids)
    calls = collections.Counter()
    original = ops.dora_linear
    monkeypatch.setattr(ops, "dora_linear", lambda *a, **k: calls.update(["dora_linear"]) or original(*a, **k))
    leantune.patch(model)
    assert model.leantune_summary["counts"]["dora"] == 8 and model.leantune_summary["unpatched"] == {}
    loss, grads = structures.loss_and_grads(model, input_ids, input_ids)
    assert calls["dora_linear"] == 8  # per layer qkv_proj, o_proj, gate_up_proj, down_proj
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads, tol=1e-4)
