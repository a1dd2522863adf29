"""Float64 references written from the formulas of docs/design.md ("Public op contract"), not from the code under
test, and the comparison rule.

Gradients of a reference come from float64 autograd of these expressions.

Tolerance (docs/design.md, "Tests and tolerance"): relative error ||out - ref|| / ||ref|| (absolute ||out|| when
the reference is exactly zero); float32 <= 1e-5 plus the eager float32 error (which is ~1e-7 unless the float64
value underflows float32's arithmetic, e.g. GELU's 1 + tanh(-13) = 0); bfloat16/float16 no worse than the same formula
run eagerly in that dtype, plus 1e-2.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

F64 = torch.float64


# ------------------------------------------------------------------------------------------------------- comparison
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; ||out|| when ref is all zeros; inf when out holds NaN."""
    out64, ref64 = out.detach().to(F64).cpu(), ref.detach().to(F64).cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference shape {tuple(ref64.shape)}")
    if torch.isnan(out64).any() and not torch.isnan(ref64).any():
        return math.inf
    finite = torch.isfinite(ref64)
    if not torch.equal(torch.isfinite(out64), finite) or not torch.equal(out64[~finite], ref64[~finite]):
        return math.inf  # infinities must sit in the same places with the same sign
    diff = (out64[finite] - ref64[finite]).norm().item()
    scale = ref64[finite].norm().item()
    return diff if scale == 0 else diff / scale


def tolerance(dtype: torch.dtype, eager_err: float = 0.0) -> float:
    """The bar of docs/design.md, "Tests and tolerance": the eager error of the same formula in ``dtype`` plus 1e-5
    in float32, plus 1e-2 in half precision."""
    if dtype in (torch.float32, torch.float64):
        return eager_err + 1e-5
    return eager_err + 1e-2


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, eager=None) -> float:
    """Assert ``out`` is within :func:`tolerance` of ``ref``; ``eager`` is the same formula run in ``dtype``."""
    err = rel_err(out, ref)
    tol = tolerance(dtype, rel_err(eager, ref) if eager is not None else 0.0)
    assert err <= tol, f"{name}: relative error {err:.3g} > tolerance {tol:.3g} ({dtype})"
    return err


@contextlib.contextmanager
def fp32_products():
    """Inside the block, fp32 GEMMs of cuBLAS run in full fp32 (no TF32), whatever another test of the process set;
    restored after. The fp32 parity checks on CUDA need it (TF32's 10-bit mantissa is far past their 1e-5); on a
    machine without CUDA there is no TF32 and the block runs as it is."""
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@contextlib.contextmanager
def recording_sizes():
    """Inside the block, every tensor a torch op returns and every buffer leantune allocates (NaN-filled) adds its
    element count to the yielded list: the tests that no ``[N, V]`` tensor ever exists read its max."""
    from leantune.ops import _runtime

    sizes: list[int] = []

    class RecordSizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype != torch.uint8:  # the interpreter copies raw bytes
                    sizes.append(t.numel())
            return out

    def allocator(shape, dtype, device):
        sizes.append(torch.Size(shape).numel())
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    with _runtime.use_allocator(allocator), RecordSizes():
        yield sizes


def nan_allocator(shape, dtype, device):
    """Allocator for ``_runtime.use_allocator``: float buffers full of NaN, integer buffers full of a sentinel."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(-(2**31) + 7 if t.element_size() >= 4 else -7)


# ------------------------------------------------------------------------------------------------------------ ops
def rms_norm_ref(x, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    """y = x / sqrt(mean(x^2) + eps) * (offset + w), in float64 (the casting mode changes only the roundings)."""
    x = x.to(F64)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (offset + weight.to(F64))
    return y


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(x, cos, sin):
    """x [B, H, S, D]; cos/sin [B, S, R] or [S, R]: y = x*cos + rotate_half(x)*sin on the first R dims."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.to(F64), sin.to(F64)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    x = x.to(F64)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def swiglu_ref(gate, up):
    """silu(gate) * up = gate * sigmoid(gate) * up."""
    g = gate.to(F64)
    return g * torch.sigmoid(g) * up.to(F64)


def geglu_ref(gate, up, approximate="tanh"):
    """gelu(gate) * up; tanh form 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), erf form 0.5 g (1 + erf(g/sqrt 2)).

    Evaluated through identities free of 1 + (nearly -1), which cancels even in float64 once gelu(g) < ~1e-13 |g|
    (g < ~-6.5): 0.5 (1 + tanh v) = sigmoid(2 v) and 0.5 (1 + erf x) = 0.5 erfc(-x)."""
    g = gate.to(F64)
    if approximate == "tanh":
        act = g * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))
    else:
        act = 0.5 * g * torch.special.erfc(-g / math.sqrt(2))
    return act * up.to(F64)


def cross_entropy_ref(logits, labels, ignore_index=-100, label_smoothing=0.0, softcap=None, z_loss=0.0,
                      reduction="mean", num_items=None):
    """Per valid token l = lse(z) - z[y], smoothed (1-eps) l + eps (lse - mean z), plus z_loss lse^2 (docs/design.md,
    "Public op contract")."""
    z = logits.to(F64)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = labels != ignore_index
    target = torch.where(valid, labels, torch.zeros_like(labels))
    loss = lse - z.gather(-1, target[:, None]).squeeze(-1)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - z.mean(-1))
    if z_loss:
        loss = loss + z_loss * lse**2
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    divisor = float(num_items) if num_items is not None else valid.sum().item()
    return loss.sum() / divisor if divisor > 0 else loss.sum() * 0.0


def linear_cross_entropy_ref(hidden, weight, labels, bias=None, **kwargs):
    """cross_entropy_ref(hidden @ weight.T + bias, labels, ...) in float64."""
    logits = hidden.to(F64) @ weight.to(F64).T
    if bias is not None:
        logits = logits + bias.to(F64)
    return cross_entropy_ref(logits, labels, **kwargs)


def lora_linear_ref(x, weight, lora_A, lora_B, scaling, bias=None, mask=None):
    """y = x W^T + b + s ((m x) A^T) B^T with m the dropout mask already divided by (1 - p)."""
    x64 = x.to(F64)
    y = x64 @ weight.to(F64).T
    if bias is not None:
        y = y + bias.to(F64)
    if lora_A is not None:
        xd = x64 if mask is None else x64 * mask.to(F64)
        y = y + scaling * (xd @ lora_A.to(F64).T) @ lora_B.to(F64).T
    return y


def grads64(fn, inputs, grad_out):
    """(value, grads) of float64 ``fn(*leaves)`` where leaves are float64 copies of ``inputs`` (None stays None)."""
    leaves = [None if t is None else t.detach().to(F64).requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*leaves)
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, wanted, grad_out.to(F64), allow_unused=True)
    it = iter(grads)
    return out.detach(), [None if t is None or not t.requires_grad else next(it) for t in leaves]


def log_probs_ref(hidden, weight, tokens, bias=None, temperature=1.0, softcap=None, ignore_index=-100):
    """(logp, entropy) per row in float64: z = softcap(h W^T + b) / T, logp = z_y - lse(z), H = -sum p log p; both 0
    at ignored rows (ops.linear_log_probs' docstring)."""
    x = hidden.to(F64) @ weight.to(F64).T
    if bias is not None:
        x = x + bias.to(F64)
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    log_p = torch.log_softmax(x / temperature, dim=-1)
    valid = tokens != ignore_index
    picked = log_p.gather(-1, torch.where(valid, tokens, 0)[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    zero = torch.zeros((), dtype=F64, device=picked.device)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


# ------------------------------------------------------------------------------------- RL and preference losses
def grpo_ref(lp, mask, adv, old, ref, loss_type, beta, eps_low, eps_high, level="token", max_len=None, delta=None,
             sampler_weights=None):
    """GRPO (ops.preference's docstring; TRL 1.16's loss types) in float64, written token by token."""
    lp, mask, adv, old = (t.to(F64) for t in (lp, mask, adv, old))
    ratio = torch.exp(lp - old)
    if level == "sequence":
        ratio = torch.exp(((lp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1))
    adv = adv[:, None] if adv.dim() == 1 else adv
    capped = ratio if delta is None else ratio.clamp(max=delta)
    surrogate = torch.minimum(capped * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    loss = -surrogate if sampler_weights is None else -surrogate * sampler_weights.to(F64)
    if beta:
        ref = ref.to(F64)
        loss = loss + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    loss = loss * mask
    if loss_type == "grpo":
        return (loss.sum(1) / mask.sum(1).clamp_min(1)).mean()
    if loss_type == "dr_grpo":
        return loss.sum() / (loss.shape[0] * (max_len or loss.shape[1]))
    return loss.sum() / mask.sum().clamp_min(1)  # bnpo, and dapo with num_items = sum(mask)


def dpo_ref(c, r, rc, rr, beta, loss_type, label_smoothing=0.0, len_c=None, len_r=None):
    d = (c.to(F64) - rc.to(F64)) - (r.to(F64) - rr.to(F64))
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * torch.log(torch.sigmoid(beta * d)) \
            - label_smoothing * torch.log(torch.sigmoid(-beta * d))
    elif loss_type == "hinge":
        loss = torch.clamp(1 - beta * d, min=0)
    else:
        d = (c.to(F64) - rc.to(F64)) / len_c.to(F64) - (r.to(F64) - rr.to(F64)) / len_r.to(F64)
        loss = (d - 1 / (2 * beta)) ** 2
    return loss.mean()


def orpo_ref(c, r, beta, nll):
    c, r = c.to(F64), r.to(F64)
    odds = torch.log(torch.exp(c) / (1 - torch.exp(c))) - torch.log(torch.exp(r) / (1 - torch.exp(r)))
    return nll.to(F64) - beta * torch.log(torch.sigmoid(odds)).mean()


def simpo_ref(c, r, beta, gamma, label_smoothing=0.0):
    x = beta * (c.to(F64) - r.to(F64)) - gamma
    loss = -(1 - label_smoothing) * torch.log(torch.sigmoid(x)) - label_smoothing * torch.log(torch.sigmoid(-x))
    return loss.mean()


def kto_ref(c, r, rc, rr, kl_lp, ref_kl, beta, w_d, w_u):
    z = (kl_lp.to(F64) - ref_kl.to(F64)).mean().clamp_min(0).detach()
    chosen = w_d * (1 - torch.sigmoid(beta * ((c.to(F64) - rc.to(F64)) - z)))
    rejected = w_u * (1 - torch.sigmoid(beta * (z - (r.to(F64) - rr.to(F64)))))
    return torch.cat([chosen, rejected]).mean()


def distillation_ref(hidden, weight, teacher_hidden, teacher_weight, labels=None, bias=None, beta=0.5,
                     temperature=1.0, reduction="batchmean"):
    """Generalised JSD between softmax(student / T) and softmax(teacher / T) (ops.distillation), float64, from
    the probabilities themselves: beta 0 KL(Q||P), 1 KL(P||Q), else beta KL(Q||M) + (1 - beta) KL(P||M)."""
    s = hidden.to(F64) @ weight.to(F64).T + (0 if bias is None else bias.to(F64))
    t = teacher_hidden.to(F64) @ teacher_weight.to(F64).T
    p, q = torch.softmax(s / temperature, -1), torch.softmax(t / temperature, -1)

    def kl(a, b):
        return (a * torch.log(a / b)).sum(-1)

    if beta == 0:
        rows = kl(q, p)
    elif beta == 1:
        rows = kl(p, q)
    else:
        mix = beta * q + (1 - beta) * p
        rows = beta * kl(q, mix) + (1 - beta) * kl(p, mix)
    if labels is not None:
        rows = rows * (labels != -100)
    if reduction == "sum":
        return rows.sum()
    count = rows.shape[0] if labels is None else int((labels != -100).sum())
    return rows.sum() / max(count, 1)


def loss_and_grads(model, ids):
    """(loss, {name: gradient} of the trainable parameters) of one causal-LM step on ``ids`` (labels = ids)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
