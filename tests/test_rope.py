"""ops.rope vs the float64 formula and its float64 autograd, transformers' apply_rotary_pos_emb, and its errors."""

import importlib

import pytest
import torch
from conftest import DEVICE, ON_GPU
from reference import assert_close, grads64, rel_err, rope_ref
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from leantune import ops

rope_module = importlib.import_module("leantune.ops.rope")  # the module; ops.rope is the function

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (q heads, k heads, head_dim, rotary_dim, cos/sin layout): GQA, MQA, MHA, head dims 64/72/80/96, partial rotary
CASES = {
    "gqa4_2_d64_bsr": (4, 2, 64, 64, "bsr"),
    "gqa9_3_d72_sr": (9, 3, 72, 72, "sr"),
    "mha5_5_d80_bsr": (5, 5, 80, 80, "bsr"),
    "partial_d80_r40_1sr": (6, 2, 80, 40, "1sr"),
    "mqa5_1_d96_r64_bsr": (5, 1, 96, 64, "bsr"),
}


def _low_dtype(backend):
    """bf16 where rounding is compared bit-close; fp16 under the interpreter, which truncates at bf16 stores."""
    return torch.float16 if backend == "triton" and not ON_GPU else torch.bfloat16


def _positions(batch, seq_len, layout):
    """Explicit position ids not starting at 0: per batch row ([B, S], one row restarting as packed sequences do),
    one shared row ([S]) or a batch of one ([1, S])."""
    if layout == "sr":
        return torch.randint(1, 3000, ()) + torch.arange(seq_len)
    starts = torch.randint(1, 3000, (1 if layout == "1sr" else batch, 1))
    pos = starts + torch.arange(seq_len)
    if layout == "bsr" and batch > 1:
        cut = seq_len // 2
        pos[-1, cut:] = torch.arange(seq_len - cut)  # a second packed sequence restarts at position 0
    return pos


def _cos_sin(positions, rotary_dim, dtype, base=10000.0):
    """cos/sin [..., S, R] from position ids, built as HF's LlamaRotaryEmbedding does (fp32, halves duplicated)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=DEVICE, dtype=dtype), emb.sin().to(device=DEVICE, dtype=dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _eager(x, cos, sin):
    """HF's expression run in the inputs' own dtypes (the bar for half-precision tolerance)."""
    rotary_dim = cos.shape[-1]
    cos = cos[:, None] if cos.dim() == 3 else cos[None, None]
    sin = sin[:, None] if sin.dim() == 3 else sin[None, None]
    x_rot = x[..., :rotary_dim]
    y = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((y, x[..., rotary_dim:].to(y.dtype)), dim=-1)


def _check(q, k, cos, sin):
    """Values and gradients of ops.rope vs float64, inputs unchanged; returns the outputs."""
    originals = [t.detach().clone() for t in (q, k, cos, sin)]
    q_out, k_out = ops.rope(q, k, cos, sin)
    for x, out in ((q, q_out), (k, k_out)):
        assert out.shape == x.shape
        assert out.dtype == torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    for name, t, orig in zip(["q", "k", "cos", "sin"], (q, k, cos, sin), originals):
        assert torch.equal(t.detach(), orig), f"ops.rope modified {name}"
    for name, x, out, dy, dx in (("q", q, q_out, dq_out, dq), ("k", k, k_out, dk_out, dk)):
        assert dx.dtype == x.dtype and dx.shape == x.shape
        ref, (ref_dx, _, _) = grads64(rope_ref, [x, cos, sin], dy)
        xe = x.detach().clone().requires_grad_()
        ye = _eager(xe, cos, sin)
        eager_dx = torch.autograd.grad(ye, xe, dy.to(ye.dtype))[0]
        assert_close(f"{name}_out", out, ref, out.dtype, None if out.dtype == torch.float32 else ye)
        assert_close(f"d{name}", dx, ref_dx, x.dtype, None if x.dtype == torch.float32 else eager_dx)
    return q_out, k_out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(backend, dtype, case):
    n_q_heads, n_k_heads, head_dim, rotary_dim, layout = CASES[case]
    batch, seq_len = 2, 5
    q = torch.randn(batch, n_q_heads, seq_len, head_dim, device=DEVICE).to(dtype).requires_grad_()
    k = torch.randn(batch, n_k_heads, seq_len, head_dim, device=DEVICE).to(dtype).requires_grad_()
    cos, sin = _cos_sin(_positions(batch, seq_len, layout), rotary_dim, dtype)
    _check(q, k, cos, sin)


def test_adjoint_with_arbitrary_cos_sin(backend):
    """Non-duplicated, unrelated cos/sin: the backward must be the transpose of the forward map, not a rotation by
    -theta (which is only the transpose when the halves are duplicated)."""
    batch, seq_len, head_dim, rotary_dim = 2, 4, 72, 40
    q = torch.randn(batch, 3, seq_len, head_dim, device=DEVICE, requires_grad=True)
    k = torch.randn(batch, 1, seq_len, head_dim, device=DEVICE, requires_grad=True)
    cos = torch.randn(batch, seq_len, rotary_dim, device=DEVICE)
    sin = torch.randn(batch, seq_len, rotary_dim, device=DEVICE)
    q_out, _ = _check(q, k, cos, sin)
    # premise: the rotation by -theta differs from the adjoint for these cos/sin, so _check could have failed
    dy = torch.randn_like(q_out)
    _, (adjoint, _, _) = grads64(rope_ref, [q, cos, sin], dy)
    assert rel_err(rope_ref(dy, cos, -sin), adjoint) > 0.1


def test_packed_qkv_views(backend):
    """q/k as transposed views of one packed projection output, and strided cos/sin."""
    batch, seq_len, n_q_heads, n_kv_heads, head_dim, rotary_dim = 2, 6, 4, 2, 80, 80
    width = (n_q_heads + 2 * n_kv_heads) * head_dim
    qkv = torch.randn(batch, seq_len, width, device=DEVICE, requires_grad=True)
    q = qkv[..., : n_q_heads * head_dim].view(batch, seq_len, n_q_heads, head_dim).transpose(1, 2)
    k = qkv[..., n_q_heads * head_dim : (n_q_heads + n_kv_heads) * head_dim]
    k = k.view(batch, seq_len, n_kv_heads, head_dim).transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = _cos_sin(_positions(batch, seq_len, "bsr"), rotary_dim, torch.float32)
    cos, sin = cos.transpose(0, 1).contiguous().transpose(0, 1), sin.transpose(0, 1).contiguous().transpose(0, 1)
    assert not cos.is_contiguous()
    q_out, k_out = _check(q, k, cos, sin)
    # outputs keep the input's memory layout (so nothing downstream copies)
    assert q_out.transpose(1, 2).is_contiguous() and k_out.transpose(1, 2).is_contiguous()
    # the gradient lands in the packed buffer: q/k parts as the reference, the v part untouched (zero)
    q_out, k_out = ops.rope(q, k, cos, sin)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    (dqkv,) = torch.autograd.grad((q_out, k_out), qkv, (dq_out, dk_out))
    _, (ref_dq, _, _) = grads64(rope_ref, [q, cos, sin], dq_out)
    _, (ref_dk, _, _) = grads64(rope_ref, [k, cos, sin], dk_out)
    dqkv = dqkv.view(batch, seq_len, -1, head_dim).transpose(1, 2)
    assert_close("dq", dqkv[:, :n_q_heads], ref_dq, torch.float32)
    assert_close("dk", dqkv[:, n_q_heads : n_q_heads + n_kv_heads], ref_dk, torch.float32)
    assert torch.count_nonzero(dqkv[:, n_q_heads + n_kv_heads :]) == 0


def test_matches_hf_apply_rotary_pos_emb(backend):
    """Within rounding of HF's expression (3 roundings there, 1 here) and at least as close to float64."""
    dtype = _low_dtype(backend)
    batch, seq_len, n_q_heads, n_kv_heads, head_dim = 2, 7, 6, 2, 64
    config = LlamaConfig(hidden_size=n_q_heads * head_dim, num_attention_heads=n_q_heads,
                         num_key_value_heads=n_kv_heads, head_dim=head_dim)
    rotary = LlamaRotaryEmbedding(config).to(DEVICE)
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=DEVICE).to(dtype)
    cos, sin = rotary(hidden, _positions(batch, seq_len, "bsr").to(DEVICE))
    assert cos.dtype == dtype
    q = (torch.randn(batch, n_q_heads, seq_len, head_dim, device=DEVICE) * 4).to(dtype)
    k = (torch.randn(batch, n_kv_heads, seq_len, head_dim, device=DEVICE) * 4).to(dtype)
    q_out, k_out = ops.rope(q, k, cos, sin)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    eps = torch.finfo(dtype).eps
    for name, x, out, hf in (("q", q, q_out, q_hf), ("k", k, k_out, k_hf)):
        assert out.dtype == hf.dtype == dtype
        ref = rope_ref(x, cos, sin)
        c, s = cos.double()[:, None], sin.double()[:, None]
        # HF rounds x*cos, rotate_half(x)*sin and their sum: each differs by <= eps/2 of its magnitude
        bound = eps * ((x.double() * c).abs() + (_rotate_half(x.double()) * s).abs() + ref.abs())
        assert ((out.double() - hf.double()).abs() <= bound).all(), f"{name}: beyond rounding of HF's result"
        assert rel_err(out, ref) <= rel_err(hf, ref), f"{name}: less accurate than HF's result"
        assert (out == hf).float().mean() >= 0.5
    # mixed dtypes promote as HF's expression does: low-precision q with fp32 cos/sin gives fp32
    cos32, sin32 = _cos_sin(_positions(batch, seq_len, "bsr"), head_dim, torch.float32)
    q_out, k_out = ops.rope(q, k, cos32, sin32)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos32, sin32)
    assert q_out.dtype == q_hf.dtype == torch.float32 and k_out.dtype == k_hf.dtype == torch.float32
    assert_close("q_out fp32", q_out, q_hf, torch.float32)
    assert_close("k_out fp32", k_out, k_hf, torch.float32)


def test_under_autocast_matches_hf(backend):
    """Under autocast q/k come out of the projections in bf16 while cos/sin stay fp32: the result is fp32, as HF's."""
    batch, seq_len, n_heads, head_dim = 2, 5, 3, 32
    hidden_size = n_heads * head_dim
    config = LlamaConfig(hidden_size=hidden_size, num_attention_heads=n_heads, num_key_value_heads=1,
                         head_dim=head_dim)
    rotary = LlamaRotaryEmbedding(config).to(DEVICE)
    q_proj = torch.nn.Linear(hidden_size, hidden_size, bias=False).to(DEVICE)
    k_proj = torch.nn.Linear(hidden_size, head_dim, bias=False).to(DEVICE)
    hidden = torch.randn(batch, seq_len, hidden_size, device=DEVICE)
    positions = _positions(batch, seq_len, "bsr").to(DEVICE)
    results = []
    for apply in (ops.rope, apply_rotary_pos_emb):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            cos, sin = rotary(hidden, positions)
            q = q_proj(hidden).view(batch, seq_len, n_heads, head_dim).transpose(1, 2)
            k = k_proj(hidden).view(batch, seq_len, 1, head_dim).transpose(1, 2)
            assert q.dtype == torch.bfloat16 and cos.dtype == torch.float32
            q_out, k_out = apply(q, k, cos, sin)
            loss = (q_out * q_out.detach().flip(-1)).sum() + (k_out * 2.5).sum()
        grads = torch.autograd.grad(loss, (q_proj.weight, k_proj.weight))
        results.append((q_out, k_out, grads))
    (q_out, k_out, grads), (q_hf, k_hf, grads_hf) = results
    assert q_out.dtype == q_hf.dtype == torch.float32
    assert_close("q_out", q_out, q_hf, torch.float32)
    assert_close("k_out", k_out, k_hf, torch.float32)
    for name, g, g_hf in zip(["dWq", "dWk"], grads, grads_hf):
        assert_close(name, g, g_hf, torch.bfloat16)


def test_many_head_blocks(monkeypatch):
    """Small tiles force several head blocks per row, the last ones partly masked (q 9 heads, k 3)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    monkeypatch.setattr(rope_module, "MAX_TILE_ELEMENTS", 128)
    q = torch.randn(1, 9, 3, 40, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 3, 3, 40, device=DEVICE, requires_grad=True)
    cos, sin = _cos_sin(_positions(1, 3, "bsr"), 40, torch.float32)
    _check(q, k, cos, sin)


def test_gradient_for_q_only(backend):
    """k without grad and k_out unused: dq is still right, k gets nothing."""
    q = torch.randn(2, 3, 4, 48, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 1, 4, 48, device=DEVICE)
    cos, sin = _cos_sin(_positions(2, 4, "sr"), 32, torch.float32)
    q_out, _ = ops.rope(q, k, cos, sin)
    dy = torch.randn_like(q_out)
    q_out.backward(dy)
    _, (ref_dq, _, _) = grads64(rope_ref, [q, cos, sin], dy)
    assert_close("dq", q.grad, ref_dq, torch.float32)
    assert k.grad is None


def test_saves_only_cos_and_sin(backend):
    q = torch.randn(1, 4, 3, 64, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 2, 3, 64, device=DEVICE, requires_grad=True)
    cos, sin = _cos_sin(_positions(1, 3, "bsr"), 64, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ops.rope(q, k, cos, sin)
    assert len(saved) == 2 and saved[0] is cos and saved[1] is sin


def test_empty_sequence(backend):
    q = torch.randn(2, 4, 0, 64, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 0, 64, device=DEVICE, requires_grad=True)
    cos, sin = torch.ones(0, 64, device=DEVICE), torch.zeros(0, 64, device=DEVICE)
    q_out, k_out = ops.rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad.shape == q.shape


def test_errors_before_any_kernel(backend):
    q = torch.randn(2, 4, 5, 64, device=DEVICE)
    k = torch.randn(2, 2, 5, 64, device=DEVICE)
    cos, sin = torch.randn(2, 5, 64, device=DEVICE), torch.randn(2, 5, 64, device=DEVICE)
    cos_grad = cos.clone().requires_grad_()
    cases = [
        ((q[0], k, cos, sin), "q must be 4-D"),
        ((q, k[None], cos, sin), "k must be 4-D"),
        ((q, k[:1], cos, sin), "k must be .* B=2"),
        ((q, k[:, :, :4], cos, sin), "k must be .* S=5"),
        ((q, k[..., :32], cos, sin), "k must be .* D=64"),
        ((q, k, cos[0, 0], sin[0, 0]), r"cos must be \[B, S, R\] or \[S, R\]"),
        ((q, k, cos, sin[:, :, :32]), "sin must have cos's shape"),
        ((q, k, cos[:, :4], sin[:, :4]), "sequence length must be q's S=5"),
        ((q, k, cos.repeat(2, 1, 1)[:3], sin.repeat(2, 1, 1)[:3]), "batch must be q's B=2 or 1"),
        ((q, k, torch.randn(5, 66, device=DEVICE), torch.randn(5, 66, device=DEVICE)),
         r"rotary_dim\) must be even and in \[2, D=64\], got 66"),
        ((q, k, cos[..., :33], sin[..., :33]), "must be even"),
        ((q.int(), k, cos, sin), "q must be float32, float16 or bfloat16"),
        ((q, k.double(), cos, sin), "k must be float32, float16 or bfloat16"),
        ((q, k, cos.double(), sin), "cos must be float32"),
        ((q, k, cos, sin.long()), "sin must be float32"),
        ((q, k, cos_grad, sin), "cos and sin must not require grad"),
        ((q, k, cos, sin.to("meta")), "one device"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.rope(*args)


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.rope(q, q, torch.ones(3, 8), torch.zeros(3, 8))


def test_unusual_strides_are_handled(backend):
    """The kernel assumes unit stride along the head dim and one stride set for cos and sin; inputs that break either
    (q with a strided head dim, cos/sin as strided views of different buffers) give the same result."""
    batch, seq_len, head_dim = 2, 5, 16
    q = torch.randn(batch, 4, seq_len, 2 * head_dim, device=DEVICE)[..., ::2].requires_grad_()
    k = torch.randn(batch, 2, seq_len, head_dim, device=DEVICE).requires_grad_()
    assert q.stride(-1) == 2
    cos, sin = _cos_sin(_positions(batch, seq_len, "bsr"), head_dim, torch.float32)
    cos = torch.cat((cos, cos), dim=-1)[..., ::2]  # values differ from sin's partner now: any cos/sin is allowed
    sin = sin.transpose(0, 1).contiguous().transpose(0, 1)
    assert cos.stride(-1) == 2 and sin.stride() != cos.stride()
    _check(q, k, cos, sin)
