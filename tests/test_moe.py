"""ops.moe_experts vs a float64 per-expert reference written from the formula (ops/moe.py docstring): values and
gradients of x, top_k_weights and every LoRA factor; routing edge cases; bf16; deferred index checks; input errors."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ON_GPU
from reference import assert_close, grads64

from leantune import ops


def moe_ref(x, w, a1, b1, a2, b2, *, index, w1, w2, s1, s2, bias1=None, bias2=None, activation="swiglu",
            interleaved=False, transposed=False, alpha=1.702, limit=7.0):
    """y[n] = sum_j w[n, j] down_e(act(gate_up_e(x[n]))) in float64, one expert at a time."""
    w1, w2 = w1.to(x.dtype), w2.to(x.dtype)  # float64 for the reference, the eager dtype for its error
    if transposed:
        w1, w2 = w1.transpose(-2, -1), w2.transpose(-2, -1)
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        rows, slots = (index == e).nonzero(as_tuple=True)
        xe = x[rows]
        g = xe @ w1[e].T + (0 if a1 is None else s1 * (xe @ a1[e].T) @ b1[e].T)
        if bias1 is not None:
            g = g + bias1[e].to(x.dtype)
        gate, up = (g[:, 0::2], g[:, 1::2]) if interleaved else g.chunk(2, dim=-1)
        if activation == "swiglu":
            h = F.silu(gate) * up
        else:
            gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = (uc + 1) * gc * torch.sigmoid(alpha * gc)
        o = h @ w2[e].T + (0 if a2 is None else s2 * (h @ a2[e].T) @ b2[e].T)
        if bias2 is not None:
            o = o + bias2[e].to(x.dtype)
        y = y.index_add(0, rows, o * w[rows, slots].unsqueeze(1))
    return y


def _case(n, hidden, inter, n_experts, k, rank, dtype=torch.float32, *, bias=False, transposed=False,
          index=None, lora=True):
    x = torch.randn(n, hidden, device=DEVICE).to(dtype).requires_grad_()
    if index is None:
        index = torch.rand(n, n_experts, device=DEVICE).argsort(-1)[:, :k]
    w = torch.rand(n, k, device=DEVICE).to(dtype).requires_grad_()
    shape1, shape2 = (n_experts, 2 * inter, hidden), (n_experts, hidden, inter)
    if transposed:
        shape1, shape2 = (n_experts, hidden, 2 * inter), (n_experts, inter, hidden)
    w1 = (torch.randn(shape1, device=DEVICE) / hidden**0.5).to(dtype)
    w2 = (torch.randn(shape2, device=DEVICE) / inter**0.5).to(dtype)
    factors = [None] * 4
    if lora:
        factors = [(torch.randn(s, device=DEVICE) * 0.3).requires_grad_() for s in
                   ((n_experts, rank, hidden), (n_experts, 2 * inter, rank), (n_experts, rank, inter),
                    (n_experts, hidden, rank))]
    biases = [torch.randn(n_experts, 2 * inter, device=DEVICE).to(dtype),
              torch.randn(n_experts, hidden, device=DEVICE).to(dtype)] if bias else [None, None]
    return x, index, w, w1, w2, factors, biases


def _run(case, nf4=False, **options):
    """The op vs moe_ref; ``nf4``: the stacks quantised (ops.quantize_nf4), the reference over their dequantised
    values (the op must equal the float64 formula over exactly those weights)."""
    x, index, w, w1, w2, (a1, b1, a2, b2), (bias1, bias2) = case
    transposed = options.pop("transposed", False)
    q1, q2 = w1, w2
    if nf4:
        q1, q2 = ops.quantize_nf4(w1), ops.quantize_nf4(w2)
        w1, w2 = ops.dequantize_nf4(q1, dtype=torch.float32), ops.dequantize_nf4(q2, dtype=torch.float32)
    gate_up = ops.ExpertWeights(q1, a1, b1, 0.5, bias1, transposed)
    down = ops.ExpertWeights(q2, a2, b2, 1.5, bias2, transposed)
    y = ops.moe_experts(x, index, w, gate_up, down, **options)
    inputs = [x, w, a1, b1, a2, b2]
    dy = torch.randn_like(y)
    wanted = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(y, wanted, dy)

    def ref(*leaves):
        return moe_ref(*leaves, index=index, w1=w1, w2=w2, s1=0.5, s2=1.5, bias1=bias1, bias2=bias2,
                       transposed=transposed, **options)

    y64, g64 = grads64(ref, inputs, dy)
    names = ["y", "dx", "dw", "dA1", "dB1", "dA2", "dB2"]
    for name, out, expected in zip(names, [y, *grads], [y64, *[g for g in g64 if g is not None]]):
        assert out.dtype == (inputs[names.index(name) - 1].dtype if name != "y" else x.dtype)
        assert_close(name, out, expected, x.dtype)


@pytest.mark.parametrize("n,hidden,inter,n_experts,k,rank", [
    (7, 12, 10, 4, 2, 3), (13, 20, 6, 5, 1, 2), (1, 8, 8, 4, 2, 4), (9, 9, 7, 3, 3, 5)])
@pytest.mark.parametrize("activation,interleaved", [("swiglu", False), ("swiglu", True), ("clamped_swiglu", True)])
def test_values_and_grads(backend, n, hidden, inter, n_experts, k, rank, activation, interleaved):
    _run(_case(n, hidden, inter, n_experts, k, rank), activation=activation, interleaved=interleaved)


@pytest.mark.parametrize("lora", [True, False])
def test_bias_transposed_gpt_oss_layout(backend, lora):
    case = _case(11, 12, 6, 4, 2, 3, bias=True, transposed=True, lora=lora)
    _run(case, activation="clamped_swiglu", interleaved=True, transposed=True, limit=1.5)  # clamps bite


def test_without_lora(backend):
    _run(_case(6, 16, 8, 4, 2, 2, lora=False))


@pytest.mark.parametrize("routing", ["empty_expert", "one_expert", "duplicates", "last_expert"])
def test_routing_edge_cases(backend, routing):
    n, k, n_experts = 10, 2, 4
    if routing == "empty_expert":  # expert 1 gets no token
        index = torch.tensor([0, 2, 3], device=DEVICE)[torch.rand(n, 3, device=DEVICE).argsort(-1)[:, :k]]
    elif routing == "one_expert":  # every pair to expert 2 (top_k 1)
        index, k = torch.full((n, 1), 2, device=DEVICE), 1
    elif routing == "duplicates":  # ties in top-k resolved to one expert twice: both slots count
        index = torch.randint(0, n_experts, (n, 1), device=DEVICE).repeat(1, k)
    else:
        index = torch.full((n, k), n_experts - 1, device=DEVICE)
    _run(_case(n, 12, 6, n_experts, k, 3, index=index))


@pytest.mark.parametrize("n, k", [(0, 2), (5, 0), (0, 0)])
def test_no_pairs_give_zero_output_and_zero_gradients(backend, n, k):
    """No token, or k = 0 (no expert chosen): y = 0 of x's shape, and every differentiable input, the adapters
    included, gets a zero gradient (not None), as an empty routing inside a real step would."""
    x, _, w, w1, w2, (a1, b1, a2, b2), _ = _case(n, 12, 6, 4, max(k, 1), 3)
    index = torch.zeros(n, k, dtype=torch.long, device=DEVICE)
    w = torch.rand(n, k, device=DEVICE).requires_grad_()
    y = ops.moe_experts(x, index, w, ops.ExpertWeights(w1, a1, b1, 0.5), ops.ExpertWeights(w2, a2, b2, 1.5))
    assert y.shape == x.shape and not y.any()
    grads = torch.autograd.grad(y.sum(), [x, w, a1, b1, a2, b2])
    assert all(g is not None and not g.any() for g in grads)


def test_router_ties_from_topk(backend):
    """A router whose probabilities tie (uniform logits): the op takes whatever top-k torch picked."""
    probs = torch.full((8, 4), 0.25, device=DEVICE)
    weights, index = torch.topk(probs, 2, dim=-1)
    _run(_case(8, 12, 6, 4, 2, 2, index=index))


@pytest.mark.parametrize("dtype,nf4", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)])
def test_half_precision(backend, dtype, nf4):
    """Values and gradients within the eager formula's error in that dtype + 1e-2 (docs/design.md); ``nf4``: the
    stacks in NF4, both formulas over the values the backend dequantises them to in ``dtype`` (the interpreter
    truncates fp32 -> bf16 at a store, docs/design.md "Backends": the weights the op really multiplies by). Under
    the interpreter the bf16 cases run in fp16, as every bf16 comparison there (its truncating bf16 stores put dw
    past the eager error + 1e-2 in ~3% of draws: 0.0183 against 0.0173, seed 1321961944)."""
    if backend == "triton" and not ON_GPU and dtype == torch.bfloat16:
        dtype = torch.float16
    x, index, w, w1, w2, factors, _ = _case(17, 24, 16, 4, 2, 4, dtype)
    q1, q2 = w1, w2
    if nf4:
        q1, q2 = ops.quantize_nf4(w1), ops.quantize_nf4(w2)
        w1, w2 = ops.dequantize_nf4(q1, dtype=dtype), ops.dequantize_nf4(q2, dtype=dtype)
    y = ops.moe_experts(x, index, w, ops.ExpertWeights(q1, *factors[:2], 0.5), ops.ExpertWeights(q2, *factors[2:], 1.5))
    dy = torch.randn_like(y)
    inputs = [x, w, *factors]
    grads = torch.autograd.grad(y, inputs, dy)

    def run(cast, leaves):
        out = moe_ref(*leaves, index=index, w1=w1.to(cast), w2=w2.to(cast), s1=0.5, s2=1.5)
        return out, torch.autograd.grad(out, leaves, dy.to(cast))

    ref, ref_grads = run(torch.float64, [t.detach().double().requires_grad_() for t in inputs])
    eager, eager_grads = run(dtype, [t.detach().to(dtype).requires_grad_() for t in inputs])
    assert y.dtype == dtype and grads[2].dtype == torch.float32  # adapters keep their fp32
    for name, out, expected, base in zip(["y", "dx", "dw", "dA1", "dB1", "dA2", "dB2"], [y, *grads],
                                         [ref, *ref_grads], [eager, *eager_grads]):
        assert_close(name, out, expected, dtype, eager=base)


@pytest.mark.parametrize("n,hidden,inter,n_experts,k,rank,transposed", [
    (9, 16, 6, 4, 2, 3, False),  # down's 96 weights per expert: 64-blocks that span two experts
    (7, 32, 8, 3, 2, 2, True)])
def test_nf4_stacks(backend, monkeypatch, n, hidden, inter, n_experts, k, rank, transposed):
    """NF4 expert stacks (QLoRA): values and grads against the float64 formula over the dequantised weights, the
    stack dequantised in forward and again in backward (the backend's dequantiser) and never saved for backward."""
    from leantune.ops import moe

    calls = []
    original = moe.dequantize_nf4
    monkeypatch.setattr(moe, "dequantize_nf4", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        _run(_case(n, hidden, inter, n_experts, k, rank, transposed=transposed), nf4=True,
             activation="clamped_swiglu" if transposed else "swiglu", interleaved=transposed, transposed=transposed)
    assert len(calls) == 4  # 2 stacks x (forward + backward)
    stacks = {(n_experts, 2 * inter, hidden), (n_experts, hidden, 2 * inter), (n_experts, hidden, inter),
              (n_experts, inter, hidden)}
    assert saved and not stacks & set(saved)  # the node saved no dequantised stack


def test_grouped_mm_padding_matches_matmul(backend):
    """The torch grouped GEMM pads widths that are not 16-byte aligned: exact against per-group matmuls."""
    from leantune.ops import moe

    a, b = torch.randn(9, 5, device=DEVICE), torch.randn(3, 5, 7, device=DEVICE)
    offsets = torch.tensor([4, 4, 9], dtype=torch.int32, device=DEVICE)
    out = moe.torch_grouped_mm(a, b, offsets)
    ref = torch.cat([a[:4] @ b[0], a[4:] @ b[2]])
    assert torch.allclose(out, ref, atol=1e-5)
    outer = moe.torch_grouped_outer(a, torch.randn(9, 3, device=DEVICE), offsets)
    assert outer.shape == (3, 5, 3) and torch.all(outer[1] == 0)


def test_backend_runs_its_grouped_gemms(backend, monkeypatch):
    """The Triton backend goes through ops.moe_kernels (one launch per grouped GEMM), the torch one never does."""
    from leantune.ops import moe_kernels

    calls = []
    for name in ("grouped_mm", "grouped_outer"):
        original = getattr(moe_kernels, name)
        monkeypatch.setattr(moe_kernels, name, lambda *a, __o=original, **k: calls.append(1) or __o(*a, **k))
    _run(_case(5, 8, 4, 3, 2, 2))
    # forward: 4 grouped_mm; backward: 4 grouped_mm + 4 grouped_outer
    assert len(calls) == (12 if backend == "triton" else 0)


@pytest.mark.parametrize("activation,interleaved,fused", [("swiglu", False, True), ("swiglu", True, False),
                                                          ("clamped_swiglu", True, False)])
def test_activation_runs_one_pass_each_way(backend, monkeypatch, activation, interleaved, fused):
    """SwiGLU over g's two halves goes through ops.glu (h once in forward and again in backward's recompute, dg
    once, written into dg's halves); other layouts and the clamped SwiGLU through ops.moe_activation's kernels on the
    Triton backend, its torch chain on the torch one. Values: test_values_and_grads, tests/test_moe_activation.py."""
    act = importlib.import_module("leantune.ops.moe_activation")
    calls = []
    own = "triton" if backend == "triton" else "torch"
    for name in ("glu_forward", "glu_backward", f"_forward_{own}", f"_backward_{own}"):
        original = getattr(act, name)
        monkeypatch.setattr(act, name, lambda *a, __o=original, __n=name, **k: calls.append(__n) or __o(*a, **k))
    _run(_case(6, 8, 4, 3, 2, 2), activation=activation, interleaved=interleaved)
    names = ("glu_forward", "glu_backward") if fused else (f"_forward_{own}", f"_backward_{own}")
    assert calls == [names[0], names[0], names[1]]


def test_deferred_index_check(backend):
    x, index, w, w1, w2, (a1, b1, a2, b2), _ = _case(5, 8, 4, 3, 2, 2)
    index = index.clone()
    index[3, 1] = 7
    gate_up, down = ops.ExpertWeights(w1, a1, b1, 0.5), ops.ExpertWeights(w2, a2, b2, 1.5)
    with pytest.raises(ValueError, match=r"top_k_index must be in \[0, 3\).*found 7"):
        ops.moe_experts(x, index, w, gate_up, down)
    y = ops.moe_experts(x, index, w, gate_up, down, checks="deferred")
    assert torch.isnan(y).all()
    with pytest.raises(ValueError, match=r"top_k_index must be in \[0, 3\).*found 7"):
        ops.raise_deferred_errors()
    ops.raise_deferred_errors()  # cleared
    index[3, 1] = 1
    assert torch.isfinite(ops.moe_experts(x, index, w, gate_up, down, checks="deferred")).all()


def test_input_errors():
    x, index, w, w1, w2, (a1, b1, a2, b2), _ = _case(5, 8, 4, 3, 2, 2)
    gate_up, down = ops.ExpertWeights(w1, a1, b1, 0.5), ops.ExpertWeights(w2, a2, b2, 1.5)
    bad = [
        (dict(top_k_index=index.float()), "top_k_index must be int64 or int32"),
        (dict(top_k_index=index[:4]), "top_k_index must have shape"),
        (dict(top_k_weights=w[:, :1]), "top_k_weights must have shape"),
        (dict(hidden_states=x.double()), "hidden_states must be float32"),
        (dict(gate_up=ops.ExpertWeights(w1[:, :7])), "gate_up.weight must map"),
        (dict(down=ops.ExpertWeights(w2[:2])), "down.weight must hold 3 experts"),
        (dict(down=ops.ExpertWeights(w2.transpose(-2, -1).contiguous())), "down.weight must map"),
        (dict(gate_up=ops.ExpertWeights(w1, a1, None, 0.5)), "both tensors or both None"),
        (dict(gate_up=ops.ExpertWeights(w1, a1[:, :, :3], b1, 0.5)), r"gate_up.lora_A must have shape \(3, r, 8\)"),
        (dict(down=ops.ExpertWeights(w2, a2, b2[:, :, :1], 1.0)), "down.lora_B must have shape"),
        (dict(down=ops.ExpertWeights(w2, bias=torch.zeros(3, 7, device=DEVICE))), "down.bias must have shape"),
        (dict(gate_up=ops.ExpertWeights(w1.clone().requires_grad_())), "gate_up.weight must be frozen"),
        (dict(gate_up=(w1, None, None, 0.0)), "gate_up must be an ops.ExpertWeights"),
        (dict(down=ops.ExpertWeights(ops.quantize_nf4(torch.randn(3, 64, device=DEVICE)))),
         "down.weight must be 3-D"),
        (dict(activation="gelu"), "activation must be one of"),
        (dict(limit=0.0), "limit must be > 0"),
        (dict(checks="later"), "checks must be one of"),
        (dict(gate_up=ops.ExpertWeights(w1, a1, b1, float("nan"))), "gate_up.scaling must be finite"),
    ]
    for change, message in bad:
        args = dict(hidden_states=x, top_k_index=index, top_k_weights=w, gate_up=gate_up, down=down)
        options = {k: change.pop(k) for k in list(change) if k in ("activation", "limit", "checks")}
        args.update(change)
        with pytest.raises(ValueError, match=message):
            ops.moe_experts(**args, **options)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_matches_hf_gpt_oss_experts(backend, implementation):
    """ops.moe_experts in gpt-oss's configuration against transformers' ``GptOssExperts`` forward on the same
    weights: transposed stacks with biases, interleaved clamped SwiGLU with the module's alpha and limit, gate and
    up scaled so that both clamps bite. LoRA enters HF's module as ``W + s (B A)^T`` (``functional_call``), so HF's
    autograd gives the reference gradients of x, the routing weights and every A, B. HF's "eager" loop runs in
    float64 (the truth), its default "grouped_mm" in fp32 (torch._grouped_mm takes no float64)."""
    from torch.func import functional_call
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    n, hidden, inter, n_experts, k, rank, s1, s2 = 11, 12, 8, 4, 2, 3, 0.5, 1.5  # HF's grouped_mm: 16-byte rows
    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=n_experts,
                          num_experts_per_tok=k)
    config._experts_implementation = implementation
    module = GptOssExperts(config).to(DEVICE).requires_grad_(False)
    with torch.no_grad():
        module.gate_up_proj.normal_(0.0, 1.0)  # [E, H, 2I]
        module.gate_up_proj_bias.normal_(0.0, 1.0)
        module.gate_up_proj_bias[:, :2] = torch.tensor([12.0, -12.0])  # gate 0 above limit, up 0 below -limit
        module.down_proj.normal_(0.0, inter**-0.5)
        module.down_proj_bias.normal_(0.0, 1.0)
    x, index, w, *_, (a1, b1, a2, b2), _ = _case(n, hidden, inter, n_experts, k, rank, transposed=True)
    weights = [module.gate_up_proj, module.down_proj, module.gate_up_proj_bias, module.down_proj_bias]
    gate_up = ops.ExpertWeights(weights[0], a1, b1, s1, weights[2], transposed=True)
    down = ops.ExpertWeights(weights[1], a2, b2, s2, weights[3], transposed=True)
    y = ops.moe_experts(x, index, w, gate_up, down, activation="clamped_swiglu", interleaved=True,
                        alpha=module.alpha, limit=module.limit)
    dy = torch.randn_like(y)
    leaves = [x, w, a1, b1, a2, b2]
    grads = torch.autograd.grad(y, leaves, dy)

    ref_dtype = torch.float64 if implementation == "eager" else torch.float32
    ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in leaves]
    rx, rw, ra1, rb1, ra2, rb2 = ref_leaves
    stacks = {  # HF's [E, in, out] layout: the delta s B A ([E, out, in]) transposed
        "gate_up_proj": weights[0].to(ref_dtype) + s1 * (rb1 @ ra1).transpose(-2, -1),
        "down_proj": weights[1].to(ref_dtype) + s2 * (rb2 @ ra2).transpose(-2, -1),
        "gate_up_proj_bias": weights[2].to(ref_dtype), "down_proj_bias": weights[3].to(ref_dtype),
    }
    ref = functional_call(module, stacks, (rx, index, rw))
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.to(ref_dtype))

    g = torch.einsum("nh,nkhf->nkf", rx.detach(), stacks["gate_up_proj"].detach()[index]) + weights[2][index]
    gate, up = g[..., 0::2], g[..., 1::2]
    assert (gate > module.limit).any() and (up.abs() > module.limit).any(), "the clamps must bite"
    for name, out, expected in zip(["y", "dx", "dw", "dA1", "dB1", "dA2", "dB2"], [y, *grads], [ref, *ref_grads]):
        assert_close(name, out, expected, torch.float32)
