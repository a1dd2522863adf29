"""FLOPs per token of a LoRA training step, MFU / HFU, and the default workload shape of ``leantune bench e2e``.

P = matmul weight parameters including lm_head (counted even when tied: it is still a matmul), P_layers = P without
lm_head, A = 2*S*Hq*D*L (the causal half of QK^T and PV, S = sequence length):
model FLOPs = 4*P + 3*A (forward 2P + A; backward of frozen weights needs only dX: 2P; attention backward 2A);
hardware FLOPs = model FLOPs + (2*P_layers + A) under gradient checkpointing (the recomputed layer forwards).
LoRA adapter FLOPs are left out (< 1% at r=16). MFU and HFU divide tokens/s times these by the bf16 matmul ceiling
(``harness.measure_ceilings``).
"""

from __future__ import annotations

import math


def _dims(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"H": config.hidden_size, "Hq": heads, "Hk": getattr(config, "num_key_value_heads", None) or heads,
            "D": head_dim, "I": config.intermediate_size, "L": config.num_hidden_layers, "V": config.vocab_size}


def matmul_params(config, *, lm_head: bool = True) -> int:
    """Weight parameters that take part in a matmul per token: q, k, v, o, gate, up, down of every layer, plus the
    lm_head ([V, H]) when ``lm_head`` (counted even when tied to the embedding). Embeddings and norms excluded."""
    d = _dims(config)
    per_layer = d["H"] * d["Hq"] * d["D"] * 2 + d["H"] * d["Hk"] * d["D"] * 2 + 3 * d["H"] * d["I"]
    return d["L"] * per_layer + (d["V"] * d["H"] if lm_head else 0)


def attention_flops_per_token(config, seq: int) -> int:
    """A = 2*S*Hq*D*L: forward FLOPs per token of QK^T and PV over the causal half (S/2 keys on average)."""
    d = _dims(config)
    return 2 * seq * d["Hq"] * d["D"] * d["L"]


def model_flops_per_token(config, seq: int) -> int:
    """4*P + 3*A: forward 2P + A, backward 2P (dX only, weights frozen) + 2A. LoRA FLOPs excluded."""
    return 4 * matmul_params(config) + 3 * attention_flops_per_token(config, seq)


def hardware_flops_per_token(config, seq: int, gradient_checkpointing: bool) -> int:
    """Model FLOPs plus, under gradient checkpointing, the recomputed layer forwards: 2*P_layers + A."""
    extra = 2 * matmul_params(config, lm_head=False) + attention_flops_per_token(config, seq)
    return model_flops_per_token(config, seq) + (extra if gradient_checkpointing else 0)


def utilization(tokens_per_s: float, flops_per_token: float, matmul_flop_per_s: float) -> float:
    """Fraction (0..1) of the matmul ceiling: tokens/s * FLOPs/token / (FLOP/s). NaN when an input is missing."""
    if not tokens_per_s or not matmul_flop_per_s or flops_per_token is None:
        return math.nan
    return tokens_per_s * flops_per_token / matmul_flop_per_s


def frozen_weight_bytes(model) -> int:
    """Bytes of the frozen base weights, tied storages counted once: the parameters that do not require grad (under
    FSDP2 this rank's shards), plus 4-bit weights' other parts: leantune's NF4Linear buffers (codes, absmax codes,
    nested absmax; with FP8 compute its fp32 scales), bitsandbytes' quant state (absmax and its nested absmax), and
    leantune's FP8Linear buffers (e4m3 codes and fp32 per-output-channel scales)."""
    seen: dict[int, int] = {}

    def count(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in model.parameters():
        if not p.requires_grad:
            count(p.to_local() if hasattr(p, "to_local") else p)  # an FSDP2 shard: this rank's bytes
            state = getattr(p, "quant_state", None)  # bitsandbytes' Params4bit
            for part in (state, getattr(state, "state2", None)):
                if getattr(part, "absmax", None) is not None:
                    count(part.absmax)
    for module in model.modules():
        if hasattr(module, "weight_nf4"):  # leantune's NF4Linear keeps its codes in buffers
            for name in ("codes", "absmax_codes", "nested_absmax", "fp8_scale"):
                if getattr(module, name, None) is not None:  # fp8_scale: only with FP8 compute
                    count(getattr(module, name))
        if hasattr(module, "weight_fp8"):  # and FP8Linear its codes and scales
            for name in ("weight", "weight_scale"):
                count(getattr(module, name))
        for stack in getattr(module, "_leantune_nf4", ()):  # leantune's NF4 experts module
            for name in ("codes", "absmax_codes", "nested_absmax"):
                count(getattr(module, f"{stack}_nf4_{name}"))
    return sum(seen.values())


def default_shape(config) -> tuple[int, int]:
    """(seq, batch) of the e2e workloads: 4096x1 for 8B-class models (P >= 3e9 matmul params), 8192x2 for smaller
    ones."""
    return (4096, 1) if matmul_params(config) >= 3e9 else (8192, 2)

