"""The experts module of a mixture-of-experts block through ``ops.moe_experts``, LoRA read from PEFT's
``target_parameters`` wrappers without their parametrization.

transformers 5.17's MoE block (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``GptOssMLP``, ...) keeps HF's
forward: its router, top-k, shared expert and the causal LM's aux loss stay exactly HF's, and it calls
``self.experts(hidden_states, top_k_index, top_k_weights)``. With LoRA on ``gate_up_proj`` / ``down_proj``, PEFT
0.21 puts nested ``ParamWrapper``s at ``mlp.experts``; their forward registers an ``nn.utils.parametrize``
parametrization that forms ``W + s B A`` for the whole stack (at registration and at the first read). leantune
binds its forward on the outermost module at ``experts`` (wrapper or experts module) and hands the raw frozen W and
the adapters' A/B (views of ``lora_A.weight [r E, in]`` and ``lora_B.weight [out, r E]``, PEFT's
``get_delta_factors`` layout) to the op, so the product is never formed. Whatever the op cannot reproduce exactly
(adapters disabled or merged, several active adapters, hooks, trainable expert weights, another activation) runs
PEFT's / HF's forward.

NF4 experts (``leantune.quantize(model, "nf4")``, an ``NF4Experts`` module): ``gate_up_proj`` / ``down_proj`` are
one-element placeholders and the stacks live in NF4 buffers; :func:`experts_status` hands the module's
``nf4_stack(name)`` (an ``ops.NF4Weight`` [E, out, in]) to the op, which dequantises inside its node.
"""

from __future__ import annotations

import functools

from torch import nn

from .. import ops
from ._common import call_original, served
from .families import ACTIVATIONS

PARAMETERS = ("gate_up_proj", "down_proj")


@functools.lru_cache(maxsize=1)
def _param_wrapper():
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # pragma: no cover - PEFT is a dependency
        return None
    return ParamWrapper


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def float_class(module: nn.Module) -> type:
    """The experts class of ``module``: its own, or the one an NF4 experts class was built over."""
    return getattr(type(module), "_leantune_float_class", type(module))


def experts_base(module: nn.Module) -> nn.Module:
    """The experts module under any PEFT ``ParamWrapper`` chain."""
    wrapper = _param_wrapper()
    while wrapper is not None and isinstance(module, wrapper):
        module = module.base_layer
    return module


def experts_status(module: nn.Module, family) -> tuple[tuple[ops.ExpertWeights, ops.ExpertWeights] | None, str]:
    """``((gate_up, down), description)`` as ``ops.moe_experts`` takes them, or ``(None, reason)``."""
    adapters = {}
    wrapper = _param_wrapper()
    while wrapper is not None and isinstance(module, wrapper):
        if _hooked(module):
            return None, "PEFT ParamWrapper with hooks"
        if module.disable_adapters:
            return None, "adapters disabled"
        if module.merged:
            return None, "merged adapter"
        active = [name for name in module.active_adapters if name in module.lora_A]
        if len(active) > 1:
            return None, f"{len(active)} active adapters"
        if active and module.parameter_name in PARAMETERS:
            name = active[0]
            lora_A, lora_B = module.lora_A[name], module.lora_B[name]
            if type(lora_A) is not nn.Linear or type(lora_B) is not nn.Linear or lora_B.bias is not None:
                return None, "non-linear adapter or lora_bias"
            if not isinstance(module.lora_dropout[name], nn.Identity):
                return None, "LoRA dropout on experts"
            adapters[module.parameter_name] = (lora_A.weight, lora_B.weight, module.scaling[name])
        elif active:
            return None, f"LoRA on {module.parameter_name!r}"
        module = module.base_layer
    if _hooked(module) or nn.utils.parametrize.is_parametrized(module):
        return None, "hooks or a parametrization on the experts module"
    transposed = bool(getattr(module, "is_transposed", False))
    weights = []
    for name in PARAMETERS:
        weight = getattr(module, name, None)
        bias = getattr(module, f"{name}_bias", None)
        if weight is None or weight.dim() != 3 or weight.requires_grad or (bias is not None and bias.requires_grad):
            return None, f"{name} missing, not 3-D or trainable"
        nf4_stack = getattr(module, "nf4_stack", None)
        if nf4_stack is not None:  # NF4 experts: the parameter is a placeholder (module docstring)
            weight = nf4_stack(name)
        lora = adapters.get(name)
        if lora is None:
            weights.append(ops.ExpertWeights(weight, None, None, 0.0, bias, transposed))
            continue
        lora_A, lora_B, scaling = lora
        n_experts = weight.shape[0]
        a = lora_A.view(n_experts, -1, lora_A.shape[-1])  # [E, r, in]
        b = lora_B.view(lora_B.shape[0], -1, n_experts).permute(2, 0, 1)  # [E, out, r]
        weights.append(ops.ExpertWeights(weight, a, b, scaling, bias, transposed))
    return tuple(weights), "LoRA on " + (", ".join(adapters) or "no expert parameter")


def experts_activation(module: nn.Module, config, family) -> str | None:
    """The op's activation for this experts module, or None when it has no fused op (HF's forward then)."""
    if family.experts == "clamped_swiglu":
        return "clamped_swiglu"
    act = ACTIVATIONS.get(getattr(config, family.activation_attr, None))
    return "swiglu" if act == "swiglu" else None


def experts_forward(self, hidden_states, top_k_index=None, top_k_weights=None):
    """``ops.moe_experts`` where :func:`experts_status` allows it, else the module's own (PEFT's / HF's) forward."""
    base = experts_base(self)
    if not served(hidden_states, top_k_weights) or (base is self and nn.utils.parametrize.is_parametrized(base)):
        # patched before get_peft_model: a wrapper around this module is running PEFT's parametrized forward
        return call_original(self, hidden_states, top_k_index, top_k_weights)
    state = self._leantune
    activation = experts_activation(base, base.config, state.family)
    weights, _ = experts_status(self, state.family)
    if activation is None or weights is None:
        return call_original(self, hidden_states, top_k_index, top_k_weights)
    options = {}
    if activation == "clamped_swiglu":
        options = {"alpha": base.alpha, "limit": base.limit}
    out = ops.moe_experts(hidden_states, top_k_index, top_k_weights, *weights, activation=activation,
                          interleaved=state.family.experts_interleaved, checks="deferred", **options)
    return out.to(hidden_states.dtype)
