"""Run every op once on random inputs against a float64 eager evaluation of its formula and print the errors.

This is what ``leantune check`` prints: the norm, RoPE, GLU, loss, LoRA, DoRA, log-prob, distillation and MoE
experts ops of ``leantune.ops`` (13; the FP8/NF4 quantisers and sink attention are proven by the tests). It is a
smoke check for a fresh install; the real proofs are the tests.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .. import ops

F64 = torch.float64


def _rel(out, ref) -> float:
    out, ref = out.detach().to(F64), ref.detach().to(F64)
    scale = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / scale if scale else diff


def _value_and_grads(fn, inputs):
    """Run ``fn`` on leaves cloned from ``inputs``; return (output, grads of sum(out * probe))."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(1)
    probes = [torch.randn_like(o, dtype=F64) for o in outs]
    total = sum((o.to(F64) * p).sum() for o, p in zip(outs, probes))
    grads = torch.autograd.grad(total, [t for t in leaves if t.requires_grad])
    return outs, grads


def _cases(device):
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    n, h, v, r = 37, 96, 333, 8
    x, w = randn(n, h), 1 + randn(h, scale=0.1)
    q, k = randn(2, 6, 13, 16), randn(2, 2, 13, 16)
    theta = torch.arange(13, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(8) / 8))
    cos, sin = torch.cat([theta.cos()] * 2, -1).to(device), torch.cat([theta.sin()] * 2, -1).to(device)
    gate, up = randn(n, 2 * h), randn(n, 2 * h)
    logits, labels = randn(n, v, scale=3), torch.randint(0, v, (n,), generator=g).to(device)
    big_w = randn(v, h, scale=0.1)
    lora_a, lora_b = randn(r, h, scale=0.1), randn(h, r, scale=0.1)

    def rot(t):
        return torch.cat((-t[..., t.shape[-1] // 2:], t[..., : t.shape[-1] // 2]), -1)

    yield "rms_norm", lambda a, b: ops.rms_norm(a, b), \
        lambda a, b: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * b, [x, w]
    yield "rope", lambda a, b: ops.rope(a, b, cos, sin), \
        lambda a, b: (a * cos.to(F64) + rot(a) * sin.to(F64), b * cos.to(F64) + rot(b) * sin.to(F64)), [q, k]
    yield "swiglu", ops.swiglu, lambda a, b: F.silu(a) * b, [gate, up]
    yield "geglu", ops.geglu, lambda a, b: F.gelu(a, approximate="tanh") * b, [gate, up]
    yield "cross_entropy", lambda a: ops.cross_entropy(a, labels), lambda a: F.cross_entropy(a, labels), [logits]
    yield "linear_cross_entropy", lambda a, b: ops.linear_cross_entropy(a, b, labels), \
        lambda a, b: F.cross_entropy(a @ b.T, labels), [x, big_w]
    yield "lora_linear", lambda a, b, c: ops.lora_linear(a, big_w[:h], b, c, 2.0), \
        lambda a, b, c: a @ big_w[:h].T.to(F64) + 2.0 * (a @ b.T) @ c.T, [x, lora_a, lora_b]

    def lora_ref(a, weight, lora_A, lora_B):  # PEFT's y = x W^T + s (x A^T) B^T, s = 2
        return a @ weight.T.to(a.dtype) + 2.0 * (a @ lora_A.T) @ lora_B.T

    qkv_w = [big_w[:h], big_w[h:h + 32], big_w[h + 32:h + 64]]
    qkv_ab = [t for out in (h, 32, 32) for t in (randn(r, h, scale=0.1), randn(out, r, scale=0.1))]
    yield "lora_qkv", lambda a, *ab: ops.lora_qkv(a, *(ops.LoraWeights(w, ab[2 * j], ab[2 * j + 1], 2.0)
                                                       for j, w in enumerate(qkv_w))), \
        lambda a, *ab: tuple(lora_ref(a, w, ab[2 * j], ab[2 * j + 1]) for j, w in enumerate(qkv_w)), [x, *qkv_ab]
    inter = 160
    mlp_w = [big_w[:inter], big_w[inter:2 * inter], randn(h, inter, scale=0.1)]
    mlp_ab = [t for (out, inn) in ((inter, h), (inter, h), (h, inter))
              for t in (randn(r, inn, scale=0.1), randn(out, r, scale=0.1))]
    yield "lora_mlp", lambda a, *ab: ops.lora_mlp(a, *(ops.LoraWeights(w, ab[2 * j], ab[2 * j + 1], 2.0)
                                                       for j, w in enumerate(mlp_w))), \
        lambda a, *ab: lora_ref(F.silu(lora_ref(a, mlp_w[0], *ab[0:2])) * lora_ref(a, mlp_w[1], *ab[2:4]),
                                mlp_w[2], *ab[4:6]), [x, *mlp_ab]
    magnitude = 1 + randn(h, scale=0.1)

    def dora_ref(a, lora_A, lora_B, m):  # (m / ||W + s B A||, detached) (x W^T + s (x A^T) B^T), s = 2
        weight = big_w[:h].to(a.dtype)
        norm = (weight + 2.0 * lora_B @ lora_A).norm(dim=1).detach()
        return (m / norm) * lora_ref(a, weight, lora_A, lora_B)

    yield "dora_linear", lambda a, b, c, m: ops.dora_linear(a, big_w[:h], b, c, 2.0, m), dora_ref, \
        [x, lora_a, lora_b, magnitude]
    yield "linear_log_probs", lambda a, b: ops.linear_log_probs(a, b, labels), \
        lambda a, b: torch.log_softmax(a @ b.T, -1).gather(-1, labels[:, None])[:, 0], [x, big_w]
    teacher_x, teacher_w = randn(n, 48), randn(v, 48, scale=0.1)

    def jsd_ref(a, b, beta=0.5):  # generalised JSD (TRL's): beta KL(t || m) + (1 - beta) KL(s || m), batch mean
        s_log = torch.log_softmax(a @ b.T, -1)
        t_log = torch.log_softmax(teacher_x.to(a.dtype) @ teacher_w.T.to(a.dtype), -1)
        m_log = torch.logsumexp(torch.stack([s_log + math.log(1 - beta), t_log + math.log(beta)]), 0)
        kl_t = (t_log.exp() * (t_log - m_log)).sum(-1)
        kl_s = (s_log.exp() * (s_log - m_log)).sum(-1)
        return (beta * kl_t + (1 - beta) * kl_s).mean()

    yield "linear_distillation_loss", lambda a, b: ops.linear_distillation_loss(a, b, teacher_x, teacher_w), \
        jsd_ref, [x, big_w]
    experts, k, inter_e = 4, 2, 24
    top_k_index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]).to(device)
    stack_gu, stack_d = randn(experts, 2 * inter_e, h, scale=0.1), randn(experts, h, inter_e, scale=0.1)
    e_ab = [randn(experts, r, h, scale=0.1), randn(experts, 2 * inter_e, r, scale=0.1),
            randn(experts, r, inter_e, scale=0.1), randn(experts, h, r, scale=0.1)]

    def experts_op(a, weights, a1, b1, a2, b2):
        return ops.moe_experts(a, top_k_index, weights, ops.ExpertWeights(stack_gu, a1, b1, 2.0),
                               ops.ExpertWeights(stack_d, a2, b2, 2.0))

    def experts_ref(a, weights, a1, b1, a2, b2):  # per token: sum over its k experts of weight * down(swiglu)
        out = torch.zeros_like(a)
        for slot in range(k):
            e = top_k_index[:, slot]
            gu = torch.einsum("nh,noh->no", a, stack_gu[e].to(a.dtype)) + 2.0 * torch.einsum(
                "nr,nor->no", torch.einsum("nh,nrh->nr", a, a1[e]), b1[e])
            hid = F.silu(gu[:, :inter_e]) * gu[:, inter_e:]
            dn = torch.einsum("ni,nhi->nh", hid, stack_d[e].to(a.dtype)) + 2.0 * torch.einsum(
                "nr,nhr->nh", torch.einsum("ni,nri->nr", hid, a2[e]), b2[e])
            out = out + weights[:, slot:slot + 1] * dn
        return out

    yield "moe_experts", experts_op, experts_ref, [x, torch.rand(n, k, generator=g).to(device), *e_ab]


def run_check(device: str | None = None) -> bool:
    """Print one line per op (forward and gradient relative errors vs float64); True when all are within 1e-4."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"leantune op check on {device} (float32 inputs; relative error vs float64 eager formula)")
    print(f"{'op':<26}{'forward':>12}{'gradients':>12}{'ms':>9}  status")
    ok = True
    for name, fn, ref_fn, inputs in _cases(device):
        start = time.perf_counter()
        try:
            outs, grads = _value_and_grads(fn, inputs)
        except NotImplementedError:
            print(f"{name:<26}{'-':>12}{'-':>12}{'-':>9}  not built yet")
            continue
        ms = (time.perf_counter() - start) * 1e3
        ref_outs, ref_grads = _value_and_grads(ref_fn, [t.to(F64) for t in inputs])
        fwd = max(_rel(o, r) for o, r in zip(outs, ref_outs))
        bwd = max(_rel(a, b) for a, b in zip(grads, ref_grads))
        good = fwd <= 1e-4 and bwd <= 1e-4 and not (math.isnan(fwd) or math.isnan(bwd))
        ok &= good
        print(f"{name:<26}{fwd:>12.2e}{bwd:>12.2e}{ms:>9.1f}  {'ok' if good else 'FAIL'}")
    return ok
