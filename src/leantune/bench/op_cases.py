"""The cases of ``leantune bench ops``: each op at a Llama-3-8B shape, its peers, and its floor's work.

A case holds its inputs as leaves with ``requires_grad``, the gradient outputs made once, the minimal bytes moved
or FLOPs (the floor's count: docs/design.md, "Timing harness and floors"), and the implementations to time: the
leantune op, eager PyTorch, torch.compile of eager, Liger-Kernel and Cut Cross-Entropy where installed (a peer that
is not importable is None and skipped), PEFT's functional LoRA for the LoRA blocks. CUDA only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Case:
    """One op at one shape: leaves, gradient outputs, the floor, and the implementations to time."""

    op: str
    shape: str
    leaves: list[torch.Tensor]
    grad_outputs: list[torch.Tensor] | None  # None: the output is a scalar loss
    bytes: float = 0.0  # minimal bytes moved (the floor count)
    flops: float = 0.0
    impls: dict[str, Callable] = dataclasses.field(default_factory=dict)
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)  # weights and adapters: not activations
    backward: bool = True  # False: a forward-only op (NF4 dequantisation), timed without a backward


def _liger(name: str):
    try:
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, "llama", True)
        if name == "rope":
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            return liger_rotary_pos_emb
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        if name == "cross_entropy":
            from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

            return lambda z, y: LigerCrossEntropyFunction.apply(z, y, None)[0]
        if name == "linear_cross_entropy":
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

            return lambda h, w, y: LigerFusedLinearCrossEntropyFunction.apply(h, w, y)[0]
    except ImportError:
        return None
    return None


def _cce(filter_eps):
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return None
    return lambda h, w, y: linear_cross_entropy(h, w, y, filter_eps=filter_eps)


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype).requires_grad_()


def case_rms_norm(n=16384, h=4096) -> Case:
    from leantune import ops

    x, w = _rand(n, h), _rand(h, scale=0.1)
    with torch.no_grad():
        w.add_(1.0)

    def eager(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    case = Case("rms_norm", f"{n}x{h} bf16", [x, w], [torch.randn_like(x)], bytes=5 * n * h * 2)
    case.impls = {"leantune": lambda x, w: ops.rms_norm(x, w, 1e-5), "eager": eager,
                  "torch.compile": torch.compile(eager), "liger": _liger("rms_norm")}
    return case


def case_rope(b=4, s=4096, hq=32, hk=8, d=128) -> Case:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from leantune import ops

    q, k = _rand(b, hq, s, d), _rand(b, hk, s, d)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    freqs = torch.arange(s, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, S, D], HF's layout
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    liger = _liger("rope")

    def eager(q, k):
        return apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin)

    case = Case("rope", f"B{b} S{s} {hq}/{hk}h D{d} bf16", [q, k],
                [torch.randn_like(q), torch.randn_like(k)], bytes=6 * (q.numel() + k.numel()) * 2)
    case.impls = {
        "leantune": lambda q, k: ops.rope(q.clone(), k.clone(), cos, sin),
        "eager": eager,
        "torch.compile": torch.compile(eager),
        "liger": None if liger is None else (lambda q, k: liger(q.clone(), k.clone(), cos, sin)),
    }
    return case


def case_swiglu(n=16384, i=14336) -> Case:
    from leantune import ops

    g, u = _rand(n, i), _rand(n, i)

    def eager(g, u):
        return F.silu(g) * u

    case = Case("swiglu", f"{n}x{i} bf16", [g, u], [torch.randn_like(g)], bytes=8 * n * i * 2)
    case.impls = {"leantune": ops.swiglu, "eager": eager, "torch.compile": torch.compile(eager),
                  "liger": _liger("swiglu")}
    return case


def case_cross_entropy(n=16384, v=128256) -> Case:
    from leantune import ops

    z = _rand(n, v, scale=2.0)
    y = torch.randint(0, v, (n,), device="cuda")

    def eager(z):
        return F.cross_entropy(z.float(), y)

    liger = _liger("cross_entropy")
    case = Case("cross_entropy", f"{n}x{v} bf16 logits", [z], None, bytes=3 * n * v * 2)
    case.impls = {"leantune": lambda z: ops.cross_entropy(z, y), "eager": eager,
                  "torch.compile": torch.compile(eager),
                  "liger": None if liger is None else (lambda z: liger(z, y))}
    return case


def case_linear_cross_entropy(n=16384, h=4096, v=128256, memory="fast", chunk_bytes=None) -> Case:
    from leantune import ops

    hidden, weight = _rand(n, h), _rand(v, h, scale=h**-0.5)
    y = torch.randint(0, v, (n,), device="cuda")

    def eager(hidden, weight):
        return F.cross_entropy((hidden @ weight.T).float(), y)

    liger, cce_exact, cce_filtered = _liger("linear_cross_entropy"), _cce(None), _cce("high")
    flops = (8 if memory == "low" else 6) * n * h * v  # 3 (4 with the recompute) GEMMs of 2 N H V FLOP
    case = Case(f"linear_cross_entropy[{memory}]", f"N{n} H{h} V{v} bf16", [hidden, weight], None, flops=flops)
    extra = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    label = "leantune" if chunk_bytes is None else f"leantune (chunk_bytes={chunk_bytes >> 20} MiB)"
    case.impls = {label: lambda h, w: ops.linear_cross_entropy(h, w, y, memory=memory, **extra)}
    if memory == "fast" and chunk_bytes is None:
        case.impls.update({"eager": eager, "torch.compile": torch.compile(eager),
                           "liger": None if liger is None else (lambda h, w: liger(h, w, y))})
    else:
        case.impls.update({"cce (filter_eps=None)": None if cce_exact is None else (lambda h, w: cce_exact(h, w, y)),
                           "cce (default filter)": None if cce_filtered is None else
                           (lambda h, w: cce_filtered(h, w, y))})
    return case


def _peft_linear(x, w, a, b, scaling):
    """PEFT LoraLayer.forward at p = 0: base in the weight's dtype, branch in lora_A's dtype, cast back once."""
    result = F.linear(x, w)
    return (result + F.linear(F.linear(x.to(a.dtype), a), b) * scaling).to(result.dtype)


def _lora_params(n_in, n_out, r, dtype, adapter_dtype):
    w = (torch.randn(n_out, n_in, device="cuda") * n_in**-0.5).to(dtype)
    a = _rand(r, n_in, dtype=adapter_dtype, scale=n_in**-0.5)
    b = _rand(n_out, r, dtype=adapter_dtype, scale=r**-0.5)  # non-zero B: every gradient is non-trivial
    return w, a, b


def case_lora_mlp(n=4096, h=4096, i=14336, r=16, adapter_dtype=torch.float32) -> Case:
    from leantune import ops

    x = _rand(n, h)
    (wg, ag, bg), (wu, au, bu) = _lora_params(h, i, r, torch.bfloat16, adapter_dtype), \
        _lora_params(h, i, r, torch.bfloat16, adapter_dtype)
    wd, ad, bd = _lora_params(i, h, r, torch.bfloat16, adapter_dtype)
    s = 2.0

    def peft(x, ag, bg, au, bu, ad, bd):
        return _peft_linear(F.silu(_peft_linear(x, wg, ag, bg, s)) * _peft_linear(x, wu, au, bu, s), wd, ad, bd, s)

    def leantune(x, ag, bg, au, bu, ad, bd):
        return ops.lora_mlp(x, ops.LoraWeights(wg, ag, bg, s), ops.LoraWeights(wu, au, bu, s),
                            ops.LoraWeights(wd, ad, bd, s))

    name = "fp32" if adapter_dtype == torch.float32 else "bf16"
    case = Case(f"lora_mlp[{name} adapters]", f"N{n} H{h} I{i} r{r} bf16", [x, ag, bg, au, bu, ad, bd],
                [torch.randn_like(x)], flops=2 * n * h * i * 3 * 2,  # 3 frozen GEMMs, fwd + dX (no dW)
                params=[wg, wu, wd, ag, bg, au, bu, ad, bd])
    case.impls = {"leantune": leantune, "peft eager": peft}
    return case


def case_lora_qkv(n=4096, h=4096, hq=32, hk=8, d=128, r=16, adapter_dtype=torch.float32) -> Case:
    from leantune import ops

    x = _rand(n, h)
    (wq, aq, bq), (wk, ak, bk), (wv, av, bv) = (_lora_params(h, o, r, torch.bfloat16, adapter_dtype)
                                                for o in (hq * d, hk * d, hk * d))
    s = 2.0

    def peft(x, aq, bq, ak, bk, av, bv):
        return _peft_linear(x, wq, aq, bq, s), _peft_linear(x, wk, ak, bk, s), _peft_linear(x, wv, av, bv, s)

    def leantune(x, aq, bq, ak, bk, av, bv):
        return ops.lora_qkv(x, ops.LoraWeights(wq, aq, bq, s), ops.LoraWeights(wk, ak, bk, s),
                            ops.LoraWeights(wv, av, bv, s))

    name = "fp32" if adapter_dtype == torch.float32 else "bf16"
    outs = [torch.randn(n, o, device="cuda", dtype=torch.bfloat16) for o in (hq * d, hk * d, hk * d)]
    case = Case(f"lora_qkv[{name} adapters]", f"N{n} H{h} {hq}/{hk}h r{r} bf16", [x, aq, bq, ak, bk, av, bv], outs,
                flops=2 * n * h * (hq + 2 * hk) * d * 2,  # the frozen GEMMs, fwd + dX (no dW)
                params=[wq, wk, wv, aq, bq, ak, bk, av, bv])
    case.impls = {"leantune": leantune, "peft eager": peft}
    return case


def case_nf4_dequant(rows=14336, cols=4096) -> Case:
    """NF4 -> bf16 dequantisation of one Llama-3-8B MLP weight into a reusable workspace (forward only); the peer is
    bitsandbytes' CUDA kernel writing into its own workspace. Floor: 0.5 B of codes read and 2 B written per weight
    (the absmax codes and nested scales add 1/64 + 4/16384 B)."""
    from leantune.ops import NF4Weight, dequantize_nf4

    weight = (torch.randn(rows, cols, device="cuda") * 0.02).to(torch.bfloat16)
    n = weight.numel()
    case = Case("nf4_dequant", f"{rows}x{cols} -> bf16", [], None, bytes=n * (0.5 + 2 + 1 / 64), backward=False)
    try:
        import bitsandbytes.functional as bnb
    except ImportError:
        bnb = None
    if bnb is not None:
        packed, state = bnb.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        nf4 = NF4Weight.from_bnb(packed, state)
        theirs = torch.empty_like(weight)
        case.impls["bitsandbytes"] = lambda: bnb.dequantize_4bit(packed, state, out=theirs)
    else:
        from leantune.ops import quantize_nf4

        nf4 = quantize_nf4(weight)
    ours = torch.empty_like(weight)
    case.impls = {"leantune": lambda: dequantize_nf4(nf4, out=ours), **case.impls}
    return case


CASES = {
    "rms_norm": case_rms_norm,
    "rope": case_rope,
    "swiglu": case_swiglu,
    "cross_entropy": case_cross_entropy,
    "linear_cross_entropy": lambda: case_linear_cross_entropy(memory="fast"),
    "linear_cross_entropy_low": lambda: case_linear_cross_entropy(memory="low"),
    "linear_cross_entropy_512m": lambda: case_linear_cross_entropy(memory="fast", chunk_bytes=512 << 20),
    "lora_mlp": case_lora_mlp,
    "lora_mlp_bf16": lambda: case_lora_mlp(adapter_dtype=torch.bfloat16),
    "lora_qkv": case_lora_qkv,
    "lora_qkv_bf16": lambda: case_lora_qkv(adapter_dtype=torch.bfloat16),
    "nf4_dequant": case_nf4_dequant,
}

