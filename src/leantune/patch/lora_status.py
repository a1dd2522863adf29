"""How :func:`leantune.patch` reads a PEFT LoRA projection: whether the fused LoRA ops reproduce its forward exactly.

A projection is fused only when ``ops.lora_linear`` computes exactly what PEFT's ``lora.Linear.forward`` would
(:func:`lora_status`); otherwise PEFT's forward runs. The state is read at every forward, never cached, so
``patch`` before ``get_peft_model``, adapter switching and ``disable_adapter()`` all do what PEFT would.
"""

from __future__ import annotations

import functools
import sys

from torch import nn

from .. import ops


@functools.lru_cache(maxsize=1)
def _peft_lora_linear():
    """PEFT's ``lora.Linear`` class, imported on first use (importing PEFT pulls in transformers: slow)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # pragma: no cover - PEFT is a dependency; plain models still patch without it
        return None
    return Linear


def _peft_lora_linear4bit():
    """PEFT's LoRA layer over a bitsandbytes ``Linear4bit`` (QLoRA), or None while its module is not imported (then
    no module is one). Read from ``sys.modules``, never imported here: without bitsandbytes the import fails, and
    dynamo cannot trace a failing import (it traces through ``lru_cache``, so a cached None would not help)."""
    return getattr(sys.modules.get("peft.tuners.lora.bnb"), "Linear4bit", None)


_NF4_CACHE = "_leantune_nf4"  # on a bitsandbytes Linear4bit: (its packed codes' storage, the NF4Weight read from it)


def _nf4_base(base) -> tuple[ops.NF4Weight | None, str | None]:
    """The NF4 weight of a bitsandbytes ``Linear4bit`` base as the fused ops take it (its dtype: the layer's compute
    dtype), or the reason it cannot be: another quant type or blocksize, no double quantisation, a compute dtype
    other than the weights' (bitsandbytes casts its output back to the input's dtype), hooks, a trainable bias."""
    state = getattr(base.weight, "quant_state", None)
    if state is None or has_hooks(base) or (base.bias is not None and base.bias.requires_grad):
        return None, f"{type(base).__name__} base without a quant state, with hooks or with a trainable bias"
    if base.compute_dtype is not None and base.compute_dtype != state.dtype:
        return None, f"4-bit compute dtype {base.compute_dtype} differs from the weights' {state.dtype}"
    key = base.weight.data.untyped_storage().data_ptr()
    cached = base.__dict__.get(_NF4_CACHE)
    if cached is not None and cached[0] == key:
        return cached[1], None
    try:
        weight = ops.NF4Weight.from_bnb(base.weight.data, state, name=type(base).__name__)
    except ValueError as exc:
        return None, f"4-bit weight not in leantune's NF4 layout ({str(exc).splitlines()[0]})"
    base.__dict__[_NF4_CACHE] = (key, weight)
    return weight, None



def has_hooks(module: nn.Module) -> bool:
    """Hooks or an instance-level forward (accelerate, PEFT's mixed-batch ``adapter_names``): bypassing is unsafe."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _frozen_linear(module) -> bool:
    """A plain ``nn.Linear`` whose weight and bias are frozen (the fused ops give no base gradients)."""
    if type(module) is not nn.Linear:
        return False
    params = module._parameters  # read at every forward: nn.Module.__getattr__ costs ~0.6 us an attribute
    bias = params.get("bias")
    return not params["weight"].requires_grad and (bias is None or not bias.requires_grad) and not has_hooks(module)


@functools.lru_cache(maxsize=None)
def _quantized_weight_attr(cls) -> str | None:
    """``"weight_nf4"`` / ``"weight_fp8"`` for leantune.quantize's layer classes (the property holding their codes),
    None for any other class; per class, once."""
    return next((attr for attr in ("weight_nf4", "weight_fp8") if isinstance(getattr(cls, attr, None), property)),
                None)


def quantized_kind(module) -> str | None:
    """``"fp8"``, ``"nf4"`` or ``"nf4-fp8"`` for a layer of leantune.quantize (read by its codes' property, as the
    fused ops take them), None for any other module."""
    attr = _quantized_weight_attr(type(module))
    if attr is None:
        return None
    return "fp8" if attr == "weight_fp8" else "nf4-fp8" if module.fp8_scale is not None else "nf4"


def lora_status(module) -> tuple[ops.LoraWeights | None, float, bool, str | None]:
    """``(weights, dropout_p, training, reason)`` for one projection as the fused LoRA ops would consume it.

    ``weights`` is None when the fused ops cannot reproduce the module's forward exactly, and ``reason`` then says
    why; otherwise ``reason`` is None. A plain frozen ``nn.Linear``
    gives ``LoraWeights(weight, None, None, 0.0, bias)``. For a PEFT ``lora.Linear`` this mirrors
    ``peft.tuners.lora.layer.Linear.forward``: one active adapter, not merged, adapters enabled, no variant other
    than DoRA, no ``lora_bias``, a frozen ``nn.Linear`` base; scaling, dropout p and the base bias come from PEFT's
    module. DoRA (PEFT's ``DoraLinearVariant``) gives an :class:`~leantune.ops.DoraWeights` with the magnitude
    vector, when its base is a dense frozen ``nn.Linear`` and its dropout is inactive (p = 0 or eval mode).
    PEFT's ``lora.bnb.Linear4bit`` (a model loaded in 4-bit by transformers / bitsandbytes, QLoRA) is read the same
    way, its base weight as an :class:`~leantune.ops.NF4Weight` (nf4, blocksize 64, double quantisation).
    """
    if _frozen_linear(module):
        return ops.LoraWeights(module.weight, None, None, 0.0, module.bias), 0.0, False, None
    quantized = _peft_lora_linear4bit() is not None and type(module) is _peft_lora_linear4bit()
    # submodules and parameters are read from ``_modules``/``_parameters``: this runs for every projection at every
    # forward, and nn.Module.__getattr__ costs ~0.6 us an attribute (10.4 -> 3.7 us a call, CPU)
    children = module._modules
    if "lora_A" not in children or (type(module) is not _peft_lora_linear() and not quantized):
        if type(module) is nn.Linear:
            return None, 0.0, False, "trainable or hooked nn.Linear"
        return None, 0.0, False, f"{type(module).__name__} is not a PEFT lora.Linear"
    if module.disable_adapters:
        return None, 0.0, False, "adapters disabled"
    if module.merged:
        return None, 0.0, False, "merged adapter"
    active = [name for name in module.active_adapters if name in children["lora_A"]]
    if len(active) != 1:
        return None, 0.0, False, f"{len(active)} active adapters"
    name = active[0]
    magnitude = None
    if name in module.lora_variant or getattr(module, "use_dora", {}).get(name, False):
        variant = module.lora_variant.get(name)
        if type(variant).__name__ != "DoraLinearVariant" or name not in module.lora_magnitude_vector:
            return None, 0.0, False, f"LoRA variant {type(variant).__name__}"
        magnitude = module.lora_magnitude_vector[name]
        if has_hooks(magnitude):
            return None, 0.0, False, "DoRA magnitude layer with hooks"
    if module.fan_in_fan_out or not getattr(module, "cast_input_dtype_enabled", True):
        return None, 0.0, False, "fan_in_fan_out or input casting disabled"
    lora_A, lora_B = children["lora_A"][name], children["lora_B"][name]
    if type(lora_A) is not nn.Linear or type(lora_B) is not nn.Linear or lora_B.bias is not None:
        return None, 0.0, False, "non-linear adapter or lora_bias"
    if has_hooks(module) or has_hooks(lora_A) or has_hooks(lora_B):
        return None, 0.0, False, "forward hooks"
    base = children["base_layer"]
    if magnitude is not None and (quantized or not _frozen_linear(base)):  # the norm ||W + s B A|| reads W
        return None, 0.0, False, f"DoRA over a {type(base).__name__} base (ops.dora_linear takes a dense frozen W)"
    if quantized:  # QLoRA: the base's NF4 codes go to the fused ops, which dequantise them
        weight, reason = _nf4_base(base)
        if weight is None:
            return None, 0.0, False, reason
    elif (quantized_attr := _quantized_weight_attr(type(base))) is not None:  # leantune.quantize's layers
        if has_hooks(base) or (base.bias is not None and base.bias.requires_grad):
            return None, 0.0, False, "NF4/FP8 base layer with hooks or a trainable bias"
        weight = getattr(base, quantized_attr)
    elif not _frozen_linear(base):
        return None, 0.0, False, f"base layer {type(base).__name__} is not a frozen, unhooked nn.Linear"
    else:
        weight = base._parameters["weight"]
    dropout = children["lora_dropout"][name]
    if isinstance(dropout, nn.Dropout):
        p, training = float(dropout.p), dropout.training
        if p >= 1.0:  # the branch is all zeros in training: PEFT's forward reproduces that, ops take p < 1
            return None, 0.0, False, f"lora_dropout p = {p} >= 1"
    elif isinstance(dropout, nn.Identity):
        p, training = 0.0, False
    else:
        return None, 0.0, False, f"dropout {type(dropout).__name__}"
    if magnitude is not None:
        if p > 0 and training:  # PEFT's DoRA then runs the frozen GEMM on the dropped input too: not fused
            return None, 0.0, False, "DoRA with lora_dropout in training (ops.dora_linear has no dropout path)"
        weights = ops.DoraWeights(weight, lora_A._parameters["weight"], lora_B._parameters["weight"],
                                  module.scaling[name], magnitude._parameters["weight"], base.bias)
        return weights, p, training, None
    weights = ops.LoraWeights(weight, lora_A._parameters["weight"], lora_B._parameters["weight"], module.scaling[name],
                              base.bias)
    return weights, p, training, None


def _has_lora(weights: ops.LoraWeights) -> bool:
    return weights.lora_A is not None


def is_dora(weights) -> bool:
    """Whether a :func:`lora_status` weights entry is a DoRA projection (``ops.dora_linear`` serves it)."""
    return isinstance(weights, ops.DoraWeights)


def fusable(status) -> bool:
    """Whether a :func:`lora_status` result is a LoRA projection that ``ops.lora_linear`` (``ops.dora_linear`` for
    DoRA) reproduces exactly."""
    return status[0] is not None and _has_lora(status[0])


def carries_fusable_lora(module) -> bool:
    """True when ``module`` is a PEFT LoRA projection that ``ops.lora_linear`` reproduces exactly."""
    return fusable(lora_status(module))


def fused_group(statuses, *, dora: bool = False) -> tuple[list[ops.LoraWeights], float, bool] | None:
    """LoraWeights for projections that read one input (their :func:`lora_status`), when one fused call can serve
    all of them exactly; ``dora``: whether that call takes DoRA projections (``lora_qkv`` and ``lora_mlp`` do; a
    fused ``gate_up_proj``, split into LoraWeights halves, does not)."""
    if any(w is None for w, _, _, _ in statuses) or not any(_has_lora(w) for w, _, _, _ in statuses):
        return None
    if not dora and any(is_dora(w) for w, _, _, _ in statuses):
        return None
    with_lora = [(p, t) for w, p, t, _ in statuses if _has_lora(w)]
    if len(set(with_lora)) != 1:  # one dropout p / mode for the whole group
        return None
    p, training = with_lora[0]
    return [w for w, _, _, _ in statuses], p, training


def project(module, x, status):
    """``module(x)``, through ``ops.lora_linear`` when its :func:`lora_status` (None: LoRA fusion off) says the
    fused op serves it exactly."""
    if status is not None and fusable(status):
        weights, p, training, _ = status
        if is_dora(weights):
            return ops.dora_linear(x, *weights, dropout=p, training=training)
        return ops.lora_linear(x, *weights, dropout=p, training=training)
    return module(x)
