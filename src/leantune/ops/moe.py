"""Mixture-of-experts experts block: routed tokens through per-expert gated MLPs with LoRA as low-rank products.

Forward (token n, its k routed slots j, expert e = top_k_index[n, j], weight w = top_k_weights[n, j]):

    y[n]  = sum_j w[n, j] * o(n, j)
    o     = h W2_e^T + b2_e + s2 (h A2_e^T) B2_e^T                  (down projection)
    h     = act(g)                                                  (gated activation of g [2I] -> [I])
    g     = x[n] W1_e^T + b1_e + s1 (x[n] A1_e^T) B1_e^T            (gate_up projection)

``W + s B A`` is never formed for the stack: the low-rank terms are t = x A_e^T ([r] per pair) times B_e^T.
Activations (gate, up: the halves of g, or its even / odd columns when ``interleaved``):
    swiglu:          h = silu(gate) * up                            (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)
    clamped_swiglu:  gc = min(gate, limit), uc = clamp(up, -limit, limit), h = (uc + 1) * gc * sigmoid(alpha gc)
                     (gpt-oss, ``GptOssExperts._apply_gate``: alpha 1.702, limit 7.0, interleaved)

Backward, per pair with dy = dL/dy[n] (every sum over one expert's pairs is a grouped outer product):
    dw[n, j] = <dy[n], o>;  do = w dy[n]
    u2 = do B2_e;  dh = do W2_e + s2 u2 A2_e;  dA2_e = s2 sum u2^T h;  dB2_e = s2 sum do^T t2   (t2 = h A2_e^T)
    dg from dh: swiglu  d_gate = dh * up * sig * (1 + gate (1 - sig)), d_up = dh * silu(gate);
                clamped d_gate = dh (uc + 1) (sig + alpha gc sig (1 - sig)) [gate <= limit],
                        d_up = dh gc sig [-limit <= up <= limit]   (torch's clamp passes the gradient at the bound)
    u1 = dg B1_e;  dx_pair = dg W1_e + s1 u1 A1_e;  dA1_e = s1 sum u1^T x;  dB1_e = s1 sum dg^T t1
    dx[n] = sum_j dx_pair(n, j).  The frozen W and biases get no gradient.

Routing on the device, never read on the host: the N*k (token, slot) pairs are sorted by expert with a stable
argsort of ``top_k_index.flatten()`` (ties keep token order, so results are deterministic), ``offsets[e]`` (the
cumulative end row of expert e's pairs, ``torch._grouped_mm``'s ``offs``) is ``searchsorted`` of the sorted experts;
an expert with no token has an empty row range. The output and dx are summed over slots through the inverse
permutation (a [N, k, H] view), not by atomics.

Saved for backward: x, the pair order, gate_up's pre-activation g [N k, 2I], the low-rank t1, t2 [N k, r] (fp32), and o
[N k, H] only when top_k_weights needs a gradient; h is recomputed from g. Dtypes: everything runs in the compute
dtype (hidden_states', or autocast's), fp32 accumulation; the low-rank factors are cast to it as PEFT's
``get_delta_factors`` casts them to the weight's dtype; gradients come back in each input's dtype.

NF4 experts (QLoRA): ``ExpertWeights.weight`` may be an :class:`~leantune.ops.NF4Weight` of the stack's 3-D shape.
The node dequantises it (``dequantize_nf4``: the Triton kernel on the Triton backend, torch ops on the torch one)
into a transient compute-dtype buffer just before the projection's grouped GEMM, in forward and again in backward;
only the NF4 codes are kept for backward, never the dequantised stack. Transient memory: one projection's stack at
a time, e.g. Mixtral-8x7B's gate_up 8 x 28672 x 4096 x 2 B = 1.9 GB in bf16 (0.94 GB for down), freed after the
GEMMs that read it. The next lever (not built): dequantise per chunk of experts into a reused workspace and run the
grouped GEMM per chunk (``offsets`` sliced), bounding the transient to a chunk.

Activation (:mod:`leantune.ops.moe_activation`): SwiGLU over g's two halves (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)
runs as :func:`ops.glu.glu_forward` / ``glu_backward`` (one Triton pass each way on the Triton backend, dg written
straight into the halves of one [N k, 2I] buffer); gpt-oss's interleaved clamped SwiGLU (and any other layout) as
one Triton pass each way over g on the Triton backend, a chain of fp32 torch ops on the torch backend.

Grouped GEMMs: Triton backend ``ops.moe_kernels.grouped_mm`` / ``grouped_outer`` (one launch for all experts,
low-rank term in the same pass); torch backend ``torch._grouped_mm`` (its CPU and CUDA kernels need 16-byte-aligned
strides: operands whose widths are not are zero-padded first, exact).

Facts relied on (transformers 5.17, ``models/<family>/modeling_<family>.py``; PEFT 0.21 ``tuners/lora/layer.py``):
- ``{Qwen3Moe,Qwen2Moe,Mixtral,Olmoe}Experts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` (y = x W^T),
  no bias, ``gate, up = linear(x, gate_up_proj[e]).chunk(2, -1)``, ``act_fn = ACT2FN[config.hidden_act]`` (silu);
  forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) sums ``w * down(...)`` by index_add_.
- ``GptOssExperts`` (``is_transposed=True``): ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]`` (y = x W), biases
  ``[E, 2I]``, ``[E, H]``, gate/up interleaved (``[..., ::2]``, ``[..., 1::2]``), the clamped SwiGLU above.
- The routers (``*TopKRouter``) and the aux loss (``load_balancing_loss_func`` on ``router_logits``) are outside
  the experts module; the top-k weights carry the router's gradient into this op.
- PEFT ``ParamWrapper`` (``target_parameters``): ``lora_A.weight [r E, in]`` viewed as A ``[E, r, in]``,
  ``lora_B.weight [out, r E]`` viewed ``(out, r, E).permute(2, 0, 1)`` as B ``[E, out, r]`` (rank-major columns),
  delta ``scaling * B_e A_e`` (``[E, in, out]`` layouts: its transpose), scaling alpha / r (rsLoRA alpha / sqrt r);
  lora_dropout, lora_bias and DoRA are refused by PEFT for parameters. in/out are the projection's input/output.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _loss, _runtime
from .moe_activation import ACTIVATIONS, gated_backward, gated_forward
from .nf4 import NF4Weight, dequantize_nf4

CHECKS = ("eager", "deferred")


class ExpertWeights(NamedTuple):
    """One expert projection stack: frozen ``weight [E, out, in]`` (HF's default; ``[E, in, out]`` with
    ``transposed``, gpt-oss), a tensor or an :class:`~leantune.ops.NF4Weight` of that 3-D shape (QLoRA experts:
    dequantised inside the op, module docstring), adapters ``lora_A [E, r, in]`` and ``lora_B [E, out, r]`` (PEFT's
    layout, any strides) or both None, ``scaling``, ``bias [E, out]`` or None."""

    weight: torch.Tensor | NF4Weight
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    scaling: float = 0.0
    bias: torch.Tensor | None = None
    transposed: bool = False

    def dims(self) -> tuple[int, int, int]:
        """(E, in, out)."""
        e, a, b = self.weight.shape
        return (e, a, b) if self.transposed else (e, b, a)

    def as_kn(self) -> torch.Tensor:
        """The (dense) weight as ``[E, in, out]`` (a view): the b operand of x -> x W^T."""
        return self.weight if self.transposed else self.weight.transpose(-2, -1)

    def as_nk(self) -> torch.Tensor:
        """The (dense) weight as ``[E, out, in]`` (a view): the b operand of dy -> dy W."""
        return self.weight.transpose(-2, -1) if self.transposed else self.weight


def _dense(weight, dtype: torch.dtype) -> torch.Tensor:
    """A dense weight as it is, an NF4 stack dequantised to ``dtype`` (a transient buffer: the caller drops it)."""
    return dequantize_nf4(weight, dtype=dtype) if isinstance(weight, NF4Weight) else weight


# -------------------------------------------------------------------------------------------- torch grouped GEMMs
def _aligned(t: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes ``t`` as it is: row- or column-major matrices (a PEFT ``lora_B`` view, expert
    stride 1, is neither), every other stride a multiple of 16 bytes, the batch stride the outermost."""
    size = t.element_size()
    rows, cols = t.stride()[-2:]
    if 1 not in (rows, cols) or t.data_ptr() % 16:
        return False
    if t.dim() == 3 and t.stride(0) < t.shape[1] * t.shape[2]:
        return False
    return all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def _pad_to(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to a multiple of 16 bytes."""
    step = 16 // t.element_size()
    extra = -t.shape[dim] % step
    if not extra:
        return t.contiguous()
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t, pad)


def _mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a [M, K], b [E, K, N]) in a's dtype, padding K / N where strides are not 16-byte aligned."""
    n = b.shape[-1]
    b = b.to(a.dtype)
    if a.shape[0] == 0:
        return a.new_zeros(0, n)
    if not (_aligned(a) and _aligned(b)):
        a, b = _pad_to(a, 1), _pad_to(_pad_to(b, 1), 2)
    return torch._grouped_mm(a, b, offs=offsets)[:, :n]


def torch_grouped_mm(a, b, offsets, *, lowrank=None, out_dtype=None):
    """The torch path of ``moe_kernels.grouped_mm`` (same contract; every row of ``a`` lies in a group here)."""
    out = _mm(a, b, offsets)
    if lowrank is not None:
        t, c, scale = lowrank
        out = out.float() + scale * _mm(t.to(a.dtype), c, offsets).float()
    return out.to(out_dtype or a.dtype)


def torch_grouped_outer(a, b, offsets, *, out_dtype=torch.float32):
    """The torch path of ``moe_kernels.grouped_outer``: ``[E, Ka, Kb]`` = per group ``a_rows^T b_rows`` in fp32."""
    ka, kb = a.shape[1], b.shape[1]
    if a.shape[0] == 0:
        return a.new_zeros(offsets.shape[0], ka, kb, dtype=out_dtype)
    a32, b32 = _pad_to(a.float(), 1), _pad_to(b.float(), 1)
    return torch._grouped_mm(a32.t(), b32, offs=offsets)[:, :ka, :kb].to(out_dtype)


def _kernels(device: torch.device):
    """(grouped_mm, grouped_outer) of the backend the ops pick on ``device``."""
    if _runtime.backend(device) == "triton":
        from .moe_kernels import grouped_mm, grouped_outer  # imported on first use (Triton compiles lazily)

        return grouped_mm, grouped_outer
    return torch_grouped_mm, torch_grouped_outer


# ----------------------------------------------------------------------------------------------------- activations
def _act_forward(g, cfg):
    return gated_forward(g, cfg.activation, cfg.interleaved, cfg.alpha, cfg.limit)


def _act_backward(dh, g, cfg):
    """dL/dg [M, 2I] (in g's dtype, the layout of g) from dh [M, I] (formulas: module docstring)."""
    return gated_backward(dh, g, cfg.activation, cfg.interleaved, cfg.alpha, cfg.limit)


# ---------------------------------------------------------------------------------------------------- autograd node
class _Config(NamedTuple):
    activation: str
    interleaved: bool
    alpha: float
    limit: float
    scalings: tuple[float, float]
    transposed: tuple[bool, bool]


def _proj(cfg, i, weight, lora_A, lora_B, bias) -> ExpertWeights:
    return ExpertWeights(weight, lora_A, lora_B, cfg.scalings[i], bias, cfg.transposed[i])


def _project_forward(gmm, x, p: ExpertWeights, offsets, experts):
    """y = x W_e^T + b_e + s (x A_e^T) B_e^T for each row's expert; returns (y, t = x A_e^T or None)."""
    t = None
    lowrank = None
    if p.lora_A is not None:
        # the skinny t = x A^T kept in fp32 ([M, r]: cheap), for the low-rank term and dB
        t = gmm(x, p.lora_A.transpose(-2, -1).to(x.dtype), offsets, out_dtype=torch.float32)
        lowrank = (t, p.lora_B.transpose(-2, -1).to(x.dtype), p.scaling)
    y = gmm(x, p.as_kn(), offsets, lowrank=lowrank)
    if p.bias is not None:
        y = (y.float() + p.bias.float()[experts]).to(y.dtype)
    return y, t


def _project_backward(gmm, outer, dy, x, t, p: ExpertWeights, offsets):
    """(dx, dA, dB) of one projection from dy (pairs sorted by expert); dA, dB None without LoRA."""
    if p.lora_A is None:
        return gmm(dy, p.as_nk(), offsets), None, None
    u = gmm(dy, p.lora_B.to(dy.dtype), offsets, out_dtype=torch.float32)  # [M, r] in fp32, as t
    dx = gmm(dy, p.as_nk(), offsets, lowrank=(u, p.lora_A.to(dy.dtype), p.scaling))
    d_a = (outer(u, x, offsets) * p.scaling).to(p.lora_A.dtype)
    d_b = (outer(dy, t, offsets) * p.scaling).to(p.lora_B.dtype)
    return dx, d_a, d_b


class MoEExpertsFunction(torch.autograd.Function):
    """The experts block as one autograd node: inputs already checked and cast to the compute dtype."""

    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, poison, cfg, w1, a1, b1, bias1, w2, a2, b2, bias2):
        n, k = top_k_index.shape
        n_experts = w1.shape[0]
        gmm, _ = _kernels(x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            experts = flat[order]
            offsets = torch.searchsorted(experts, torch.arange(n_experts, device=x.device, dtype=flat.dtype),
                                         right=True).to(torch.int32)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=x.device)
            xs = x[order // k]
            g, t1 = _project_forward(gmm, xs, _proj(cfg, 0, _dense(w1, x.dtype), a1, b1, bias1), offsets, experts)
            h = _act_forward(g, cfg)
            o, t2 = _project_forward(gmm, h, _proj(cfg, 1, _dense(w2, x.dtype), a2, b2, bias2), offsets, experts)
            o_tokens = o[inverse].view(n, k, -1)
            # [N, 1, k] @ [N, k, H] in the compute dtype (fp32 accumulation, no fp32 copy of o)
            y = torch.bmm(top_k_weights.to(o.dtype).unsqueeze(1), o_tokens).squeeze(1)
            if poison is not None:
                y = y + poison
        keep_o = ctx.needs_input_grad[2]
        # an NF4 stack is kept as its codes (frozen buffers, ctx attributes), never its dequantised values
        ctx.nf4 = tuple(w if isinstance(w, NF4Weight) else None for w in (w1, w2))
        dense = [None if isinstance(w, NF4Weight) else w for w in (w1, w2)]
        ctx.save_for_backward(x, top_k_weights, order, inverse, experts, offsets, g, t1, t2,
                              o if keep_o else None, dense[0], a1, b1, dense[1], a2, b2)
        ctx.cfg = cfg
        return _runtime.distinct_output(y.to(x.dtype))  # .to() is y itself when the dtype is x's

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, dy):
        x, w, order, inverse, experts, offsets, g, t1, t2, o, w1, a1, b1, w2, a2, b2 = ctx.saved_tensors
        w1 = w1 if ctx.nf4[0] is None else ctx.nf4[0]
        w2 = w2 if ctx.nf4[1] is None else ctx.nf4[1]
        cfg = ctx.cfg
        n, k = w.shape
        gmm, outer = _kernels(x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            tokens = order // k
            dy_s = dy.to(x.dtype)[tokens]
            d_w = None
            if ctx.needs_input_grad[2]:
                d_pairs = torch.bmm(dy_s.unsqueeze(1), o.unsqueeze(2)).reshape(-1).float()  # <dy, o> per pair
                d_w = torch.empty_like(d_pairs)
                d_w[order] = d_pairs
                d_w = d_w.view(n, k).to(w.dtype)
            d_o = dy_s * w.reshape(-1)[order].to(x.dtype).unsqueeze(1)
            h = _act_forward(g, cfg)
            dh, d_a2, d_b2 = _project_backward(gmm, outer, d_o, h, t2,
                                               _proj(cfg, 1, _dense(w2, x.dtype), a2, b2, None), offsets)
            dg = _act_backward(dh, g, cfg)
            d_xs, d_a1, d_b1 = _project_backward(gmm, outer, dg, x[tokens], t1,
                                                 _proj(cfg, 0, _dense(w1, x.dtype), a1, b1, None), offsets)
            d_x = d_xs[inverse].view(n, k, -1).sum(1, dtype=torch.float32).to(x.dtype)
        return d_x, None, d_w, None, None, None, d_a1, d_b1, None, None, d_a2, d_b2, None


# ------------------------------------------------------------------------------------------------------ public API
def _check_projection(name: str, p, n_experts: int | None, hidden_states) -> ExpertWeights:
    if not isinstance(p, ExpertWeights):
        raise ValueError(f"{name} must be an ops.ExpertWeights, got {type(p).__name__}")
    nf4 = isinstance(p.weight, NF4Weight)
    if not nf4:
        _runtime.check_tensor(f"{name}.weight", p.weight)
    if len(p.weight.shape) != 3:
        raise ValueError(f"{name}.weight must be 3-D [E, out, in] ([E, in, out] transposed), got "
                         f"{tuple(p.weight.shape)}")
    if not isinstance(p.transposed, bool):
        raise ValueError(f"{name}.transposed must be a bool, got {p.transposed!r}")
    e, d_in, d_out = p.dims()
    if n_experts is not None and e != n_experts:
        raise ValueError(f"{name}.weight must hold {n_experts} experts (gate_up's), got {e}")
    if not nf4 and torch.is_grad_enabled() and p.weight.requires_grad:
        raise ValueError(f"{name}.weight must be frozen (requires_grad False): the op gives the experts' weights "
                         "no gradient")
    if (p.lora_A is None) != (p.lora_B is None):
        raise ValueError(f"{name}.lora_A and {name}.lora_B must be both tensors or both None")
    scaling = 0.0
    if p.lora_A is not None:
        _runtime.check_tensor(f"{name}.lora_A", p.lora_A)
        _runtime.check_tensor(f"{name}.lora_B", p.lora_B)
        if p.lora_A.dim() != 3 or p.lora_A.shape[0] != e or p.lora_A.shape[2] != d_in:
            raise ValueError(f"{name}.lora_A must have shape ({e}, r, {d_in}) [E, r, in], got "
                             f"{tuple(p.lora_A.shape)}")
        _runtime.check_shape(f"{name}.lora_B", p.lora_B, (e, d_out, p.lora_A.shape[1]), "[E, out, r]")
        scaling = _runtime.check_real(f"{name}.scaling", p.scaling)
    if p.bias is not None:
        _runtime.check_tensor(f"{name}.bias", p.bias)
        _runtime.check_shape(f"{name}.bias", p.bias, (e, d_out), "[E, out]")
        if torch.is_grad_enabled() and p.bias.requires_grad:
            raise ValueError(f"{name}.bias must be frozen (requires_grad False)")
    _runtime.check_same_device(**{f"{name}.{f}": getattr(p, f) for f in ("lora_A", "lora_B", "bias")},
                               **{f"{name}.weight": p.weight.codes if nf4 else p.weight}, hidden_states=hidden_states)
    return p._replace(scaling=scaling)


def _index_message(n_experts: int) -> str:
    return f"top_k_index must be in [0, {n_experts}) (one expert per entry); found {{found}}"


def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: ExpertWeights, down: ExpertWeights, *, activation: str = "swiglu", interleaved: bool = False,
                alpha: float = 1.702, limit: float = 7.0, checks: str = "eager") -> torch.Tensor:
    """The experts of a mixture-of-experts block with LoRA on both projections (formulas: module docstring).

    Args:
        hidden_states: ``[..., H]`` fp32/fp16/bf16 tokens.
        top_k_index: ``[..., k]`` int64 or int32, each token's experts (HF's router indices), in [0, E).
        top_k_weights: ``[..., k]`` float, each slot's weight (the router's gradient flows through it).
        gate_up: the gate/up stack (``[E, 2I, H]``, or ``[E, H, 2I]`` transposed) and its LoRA.
        down: the down stack (``[E, H, I]``, or ``[E, I, H]`` transposed) and its LoRA.
        activation: ``"swiglu"`` (silu(gate) * up) or ``"clamped_swiglu"`` (gpt-oss, with ``alpha``, ``limit``).
        interleaved: gate/up are g's even/odd columns (gpt-oss) instead of its two halves.
        checks: ``"eager"`` reads the index range on the host (one sync) and raises; ``"deferred"`` (inside a
            training step) never reads back: an index out of range is routed to expert 0, the output is NaN and
            :func:`leantune.ops.raise_deferred_errors` raises the ValueError later (as the loss ops' labels).

    Returns:
        ``[..., H]`` in the compute dtype (hidden_states', or autocast's under ``torch.autocast``).

    Raises:
        ValueError: a non-tensor or unsupported dtype, shapes that disagree (names the argument and the expected
            shape), trainable expert weights or biases, an unknown activation / checks, a non-finite alpha or a
            limit <= 0, tensors on several devices, or (eager) an index outside [0, E).
    """
    _runtime.check_tensor("hidden_states", hidden_states)
    _runtime.check_tensor("top_k_index", top_k_index, float_only=False)
    _runtime.check_tensor("top_k_weights", top_k_weights)
    if top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"top_k_index must be int64 or int32, got {top_k_index.dtype}")
    if hidden_states.dim() < 1 or top_k_index.dim() != hidden_states.dim() or \
            top_k_index.shape[:-1] != hidden_states.shape[:-1]:
        raise ValueError(f"top_k_index must have shape {tuple(hidden_states.shape[:-1])} + (k,) (one row per token "
                         f"of hidden_states), got {tuple(top_k_index.shape)}")
    _runtime.check_shape("top_k_weights", top_k_weights, tuple(top_k_index.shape), "top_k_index's shape")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved must be a bool, got {interleaved!r}")
    alpha = _runtime.check_real("alpha", alpha)
    limit = _runtime.check_real("limit", limit, low=0.0, low_open=True)
    if checks not in CHECKS:
        raise ValueError(f"checks must be one of {CHECKS}, got {checks!r}")
    device = _runtime.check_same_device(hidden_states=hidden_states, top_k_index=top_k_index,
                                        top_k_weights=top_k_weights)
    hidden = hidden_states.shape[-1]
    gate_up = _check_projection("gate_up", gate_up, None, hidden_states)
    n_experts, gu_in, gu_out = gate_up.dims()
    if gu_in != hidden or gu_out % 2:
        raise ValueError(f"gate_up.weight must map H={hidden} to 2I features (an even count): got in={gu_in}, "
                         f"out={gu_out}")
    down = _check_projection("down", down, n_experts, hidden_states)
    if down.dims()[1:] != (gu_out // 2, hidden):
        raise ValueError(f"down.weight must map I={gu_out // 2} to H={hidden}: got in={down.dims()[1]}, "
                         f"out={down.dims()[2]}")
    if n_experts == 0:
        raise ValueError("gate_up.weight must hold at least one expert")
    index = top_k_index.reshape(math.prod(hidden_states.shape[:-1]), top_k_index.shape[-1]).long()  # k may be 0
    poison = None
    ok = (index >= 0) & (index < n_experts)
    if checks == "deferred":
        bad = _loss.record_deferred("top_k_index", ok, index, _index_message(n_experts))
        index = torch.where(ok, index, 0)
        poison = torch.where(bad, float("nan"), 0.0)
    elif index.numel():
        low, high = (int(v) for v in torch.stack(torch.aminmax(index)).tolist())
        if low < 0 or high >= n_experts:
            raise ValueError(_index_message(n_experts).format(found=low if low < 0 else high))
    dtype = _runtime.autocast_dtype(device) or hidden_states.dtype
    x = _runtime.as_rows(hidden_states).to(dtype)
    cfg = _Config(activation, interleaved, alpha, limit, (gate_up.scaling, down.scaling),
                  (gate_up.transposed, down.transposed))
    args = []
    for p in (gate_up, down):
        weight = p.weight if isinstance(p.weight, NF4Weight) else p.weight.to(dtype)
        args += [weight, p.lora_A, p.lora_B, None if p.bias is None else p.bias.to(dtype)]
    weights = top_k_weights.reshape(index.shape)
    if x.shape[0] == 0 or index.shape[1] == 0:  # no pair: y = 0, still connected to every differentiable input
        zero = weights.sum() * 0  # (so the adapters get zero gradients, not None)
        for p in (gate_up, down):
            for t in (p.lora_A, p.lora_B, p.bias):
                if t is not None:
                    zero = zero + t.sum() * 0
        y = x * 0 + zero.to(dtype)
        return y.reshape(hidden_states.shape)
    y = MoEExpertsFunction.apply(x, index, weights, poison, cfg, *args)
    return y.reshape(hidden_states.shape)


__all__ = ["ExpertWeights", "moe_experts"]
