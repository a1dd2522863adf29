"""ops.sink_attention against a float64 reference written from the formula (ops/sink_attention.py's docstring):

    out_hi = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij)),  s_ij = scaling q_hi . k_j, -inf where masked

values and the gradients of q, k, v and the sinks, fp32 on ``conftest.DEVICE`` (SDPA's math / CPU-flash kernels on
the CPU, flash / efficient on the card); and against transformers' gpt-oss ``eager_attention_forward`` with its own
eager mask. The op has no Triton path (torch's SDPA), so there is no backend parametrisation here; the model-level
parity (tests/test_patch_moe.py) runs both backends around it.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE
from reference import F64, assert_close, rel_err

from leantune import ops


def reference(q, k, v, sinks, scaling, allowed):
    """float64 from the formula; ``allowed`` [B|1, 1, L, S] bool."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, -math.inf)
    sink = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ v).transpose(1, 2)


def causal(length, keys, window=None, device=DEVICE):
    i = torch.arange(length, device=device)[:, None] + keys - length
    j = torch.arange(keys, device=device)[None, :]
    allowed = j <= i
    return allowed & (j > i - window) if window is not None else allowed


def inputs(batch, heads, kv_heads, length, keys, dim, sink_std=2.0, dtype=torch.float32):
    q = torch.randn(batch, heads, length, dim, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, kv_heads, keys, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, kv_heads, keys, dim, device=DEVICE, dtype=dtype)
    sinks = torch.randn(heads, device=DEVICE) * sink_std
    return [t.requires_grad_() for t in (q, k, v, sinks)]


def check(tensors, allowed, scaling, dtype=torch.float32, **kwargs):
    q, k, v, sinks = tensors
    out = ops.sink_attention(q, k, v, sinks, scaling=scaling, **kwargs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    leaves64 = [t.detach().to(F64).requires_grad_() for t in (q, k, v, sinks)]
    ref = reference(*leaves64, scaling, allowed)
    refs = torch.autograd.grad(ref, leaves64, grad_out.to(F64))
    # the same formula in the inputs' dtype (docs/design.md, "Tests and tolerance"): dsinks sums terms of both signs
    # over every query of a head, and its fp32 rounding is that cancellation's, whoever computes it
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    eager = reference(*leaves, scaling, allowed)
    eagers = torch.autograd.grad(eager, leaves, grad_out)
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    assert_close("out", out, ref, dtype, eager)
    for name, got, want, same_dtype in zip(("dq", "dk", "dv", "dsinks"), grads, refs, eagers):
        assert_close(name, got, want, dtype, same_dtype)
    return out


@pytest.mark.parametrize("dim", [8, 64])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("window", [None, 4, 20])
@pytest.mark.parametrize("length", [9, 13])
def test_matches_formula(dim, heads, kv_heads, window, length):
    """Causal (is_causal on the padded lengths) and sliding windows shorter and longer than the sequence, GQA and
    not, head dims whose D + 1 pads to 16 and 72, lengths not a multiple of 8; sinks of std 2 so that they matter."""
    tensors = inputs(2, heads, kv_heads, length, length, dim)
    check(tensors, causal(length, length, window), dim ** -0.5, sliding_window=window)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("window", [None, 3])
def test_padding_mask(kind, window):
    """A given mask is the whole pattern: causal AND window AND padding (left padding on row 0, right on row 1),
    boolean or additive as transformers' eager builds it (0 / finfo.min). Padded queries see only the sink: their
    output is 0, as the formula says."""
    length, dim = 11, 8
    tensors = inputs(2, 4, 2, length, length, dim)
    keep = torch.ones(2, length, dtype=torch.bool, device=DEVICE)
    keep[0, :3] = False
    keep[1, -2:] = False
    allowed = (causal(length, length, window)[None] & keep[:, None, :])[:, None]  # [B, 1, L, S]
    mask = allowed if kind == "bool" else torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    check(tensors, allowed, dim ** -0.5, attention_mask=mask, sliding_window=window)


@pytest.mark.parametrize("window", [None, 4])
def test_fewer_queries_than_keys(window):
    """New tokens on a cache (L < S, no mask): the band is aligned bottom-right, query i is token S - L + i."""
    tensors = inputs(1, 4, 1, 3, 10, 8)
    check(tensors, causal(3, 10, window), 8 ** -0.5, sliding_window=window)


def test_dummy_query_and_sink_matter():
    """The check can fail: without the sinks (the plain causal softmax) or shifted by one query, the reference
    disagrees far beyond the bar, so the op's agreement is the sinks and the alignment."""
    q, k, v, sinks = inputs(1, 2, 2, 9, 9, 8)
    out = ops.sink_attention(q, k, v, sinks, scaling=0.3)
    ref = reference(q.double(), k.double(), v.double(), sinks.double(), 0.3, causal(9, 9))
    no_sinks = reference(q.double(), k.double(), v.double(), torch.full_like(sinks.double(), -math.inf), 0.3,
                         causal(9, 9))
    shifted = reference(q.double(), k.double(), v.double(), sinks.double(), 0.3, causal(9, 9).roll(-1, dims=0))
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(no_sinks, ref) > 1e-2 and rel_err(shifted, ref) > 1e-2


def test_bf16_within_bar():
    """bf16 inputs, bf16 sinks (a bf16 model's parameter): within the usual bf16 bar of the float64 formula on the
    bf16 values (the eager formula in bf16 plus 1e-2)."""
    q, k, v, sinks = inputs(2, 4, 2, 13, 13, 64, dtype=torch.bfloat16)
    sinks = sinks.detach().to(torch.bfloat16).requires_grad_()
    out = ops.sink_attention(q, k, v, sinks, scaling=0.125, sliding_window=5)
    allowed = causal(13, 13, 5)
    ref = reference(q.double(), k.double(), v.double(), sinks.double(), 0.125, allowed)
    eager = reference(q, k, v, sinks, 0.125, allowed)  # the same formula run in bf16
    assert_close("out", out, ref, torch.bfloat16, eager)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, sinks))
    assert all(g is not None and g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("window", [None, 4])
def test_matches_transformers_gpt_oss_eager(window):
    """Against transformers 5.17's gpt-oss ``eager_attention_forward`` with its own eager mask (0 / finfo.min, from
    ``masking_utils``), fp32: output and every gradient within 1e-5."""
    from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function
    from transformers.models.gpt_oss import modeling_gpt_oss

    length, dim, heads, kv_heads = 9, 8, 4, 2
    q, k, v, sinks = inputs(2, heads, kv_heads, length, length, dim)
    function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    mask = eager_mask(2, length, length, mask_function=function, device=DEVICE)
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(sinks.detach().clone())
    module.num_key_value_groups = heads // kv_heads
    module.training = False
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    hf, _ = modeling_gpt_oss.eager_attention_forward(module, *leaves, mask, scaling=dim ** -0.5)
    out = ops.sink_attention(q, k, v, sinks, scaling=dim ** -0.5, attention_mask=mask, sliding_window=window)
    grad_out = torch.randn_like(out)
    hf_grads = torch.autograd.grad(hf, [*leaves, module.sinks], grad_out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    assert rel_err(out, hf) <= 1e-5
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, hf_grads):
        assert rel_err(got, want) <= 1e-5, name
    # HF's mask holds the window: with it and without (the op's own band), the same result
    own = ops.sink_attention(q, k, v, sinks, scaling=dim ** -0.5, sliding_window=window)
    assert rel_err(own, out) <= 1e-6


def test_errors():
    q, k, v, sinks = (t.detach() for t in inputs(1, 4, 2, 5, 5, 8))
    with pytest.raises(ValueError, match="sinks"):
        ops.sink_attention(q, k, v, sinks[:2], scaling=1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ops.sink_attention(q, k[:, :1].expand(1, 3, 5, 8), v[:, :1].expand(1, 3, 5, 8), sinks, scaling=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        ops.sink_attention(q, k, v, sinks, scaling=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="attention_mask"):
        ops.sink_attention(q, k, v, sinks, scaling=1.0, attention_mask=torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key = value"):
        ops.sink_attention(q, k, v[..., :4], sinks, scaling=1.0)


def test_negative_scaling_and_integer_masks_are_refused():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    sinks = torch.randn(2)
    with pytest.raises(ValueError, match="scaling must be > 0"):
        ops.sink_attention(q, k, v, sinks, scaling=-0.3)
    with pytest.raises(ValueError, match="attention_mask must be bool"):
        ops.sink_attention(q, k, v, sinks, scaling=0.3, attention_mask=torch.ones(5, 5, dtype=torch.int64))


def test_a_sink_of_minus_infinity_is_plain_causal_attention():
    """exp(-inf) = 0 in the denominator: causal SDPA's output, and a zero sink gradient (the padded product
    -inf * 0 gave all zeros); a sink on another device or not a tensor is named."""
    q, k, v = (torch.randn(1, 2, 5, 8, device=DEVICE, requires_grad=True) for _ in range(3))
    sinks = torch.full((2,), -math.inf, device=DEVICE, requires_grad=True)
    out = ops.sink_attention(q, k, v, sinks, scaling=0.3)
    causal = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                              scale=0.3).transpose(1, 2)
    assert rel_err(out, causal) <= 1e-6
    out.sum().backward()
    assert torch.equal(sinks.grad, torch.zeros_like(sinks)) and torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="all tensors must be on one device.*attention_mask on meta"):
        ops.sink_attention(q, k, v, sinks, scaling=0.3, attention_mask=torch.ones(5, 5, dtype=torch.bool,
                                                                                  device="meta"))
    with pytest.raises(ValueError, match=r"sinks must be a \[H\] = \[2\] tensor, got list"):
        ops.sink_attention(q, k, v, [0.0, 0.0], scaling=0.3)
