"""``leantune.quantize(model, "nf4" | "fp8")``: the frozen linear weights of a causal LM's decoder blocks stored in
NF4 (4-bit) or FP8 (e4m3 with per-output-channel scales, :mod:`leantune.ops.fp8`; experimental).

QLoRA (Dettmers et al. 2023) keeps the frozen base weights in 4-bit NF4 with double-quantised absmax and the
embeddings, norms and ``lm_head`` in the compute dtype. Each targeted ``nn.Linear`` becomes an :class:`NF4Linear`
holding an :class:`~leantune.ops.NF4Weight` (bitsandbytes' layout); its forward dequantises the weight to the input's
dtype and runs ``F.linear``. The weight is frozen: it gets no gradient (the input and the bias do).

Either order with PEFT works. After ``get_peft_model`` (QLoRA as leantune documents it) the LoRA layers' base
layers are quantised. Before it (the order bitsandbytes users know), PEFT finds the layers itself: an NF4Linear is an
``nn.Linear`` to it, as bitsandbytes' ``Linear4bit`` is, so ``target_modules="all-linear"`` and named targets select
it and PEFT wraps it in its ordinary ``lora.Linear``, the structure the other order builds. PEFT 0.21's
custom-module registration (``LoraConfig._register_custom_module``) cannot do this: it lives on the user's config,
which does not exist yet when the model is quantised. Like ``Linear4bit`` the layer answers PEFT's probes:
``weight`` is the packed 4-bit codes (uint8: the device to put adapters on, never cast to) and ``compute_dtype`` the
dtype the weight had (adapters are rounded through it as PEFT does over a 16-bit ``nn.Linear``), so both orders
give the same adapters, loss and gradients. Merging into the codes is not possible in either order (PEFT's merge
fails on the packed shape); ``leantune export`` merges into the dequantised weights.

FP8 (:class:`FP8Linear`) follows the same pattern: ``weight`` is the e4m3 tensor and ``compute_dtype`` the dtype it
was quantised from (PEFT would otherwise cast the adapters to float8, a floating dtype to it). Its forward is
``ops.lora_linear`` without adapters, so y and dX run as e4m3 GEMMs (``torch._scaled_mm`` on the card, the exact
emulation on CPU) and nothing dequantised is kept for backward.

Checkpoints that ship block-scaled FP8 (``quantization_config`` ``{"quant_method": "fp8", "weight_block_size":
[128, 128]}``, e4m3 ``weight`` and fp32 ``weight_scale_inv`` per 128 x 128 block: DeepSeek-V3, Qwen3-FP8) load in
transformers 5.17 as its ``integrations.finegrained_fp8.FP8Linear`` where a CUDA device is present, and dequantised
into plain ``nn.Linear`` weights (of the load dtype) where none is (its quantizer says so in a warning).
:func:`quantize` takes both: an FP8 linear of transformers' (e4m3 ``weight`` beside ``weight_scale_inv`` and
``block_size``) is dequantised in fp32 and requantised per output channel (``ops.requantize_blocks``: one more
e4m3 rounding, docs/design.md "FP8 checkpoints"); loaded in fp32, the dequantised ``nn.Linear`` holds the same fp32
values, so both give the same codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops import (
    FP8Weight,
    NF4Weight,
    dequantize_blocks,
    dequantize_nf4,
    lora_linear,
    quantize_fp8,
    quantize_nf4,
    requantize_blocks,
)

QUANT_TYPES = ("nf4", "fp8")
_TENSOR_FIELDS = ("codes", "absmax_codes", "nested_absmax", "code", "nested_code")


class NF4Linear(nn.Linear):
    """``y = x W^T + b`` with W [out_features, in_features] stored as NF4 and dequantised at each call.

    The NF4 tensors are buffers (they follow ``.to(device)``); ``bias`` stays a parameter in its dtype. An
    ``nn.Linear`` subclass without a float weight (see the module docstring: what PEFT reads of it).
    """

    def __init__(self, weight: NF4Weight, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the float weight this layer replaces
        if len(weight.shape) != 2:
            raise ValueError(f"{weight.name}: an NF4Linear weight must be 2-D, got shape {weight.shape}")
        self.out_features, self.in_features = weight.shape
        for field in _TENSOR_FIELDS:
            self.register_buffer(field, getattr(weight, field), persistent=False)
        self._meta = (weight.offset, weight.shape, weight.dtype, weight.name)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    @property
    def weight(self) -> torch.Tensor:
        """The packed NF4 codes (uint8, two weights a byte), as bitsandbytes' ``Linear4bit.weight`` holds them: what
        PEFT and other code probing a linear layer's ``weight`` for its device find. Not a float matrix."""
        return self.codes

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the weight was quantised from (bitsandbytes' attribute name, read by PEFT)."""
        return self._meta[2]

    @property
    def weight_nf4(self) -> NF4Weight:
        offset, shape, dtype, name = self._meta
        return NF4Weight(**{f: getattr(self, f) for f in _TENSOR_FIELDS}, offset=offset, shape=shape, dtype=dtype,
                         name=name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else self._meta[2]
        weight = dequantize_nf4(self.weight_nf4, dtype=dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nf4"


class FP8Linear(nn.Linear):
    """``y = x W^T + b`` with W ``[out_features, in_features]`` ~= diag(weight_scale) weight (e4m3), the GEMMs in FP8.

    ``weight`` (float8_e4m3fn) and ``weight_scale`` (fp32 [out]) are buffers saved in the state dict; ``bias``
    stays a parameter in its dtype. The module docstring says what PEFT reads of it.
    """

    def __init__(self, weight: FP8Weight, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the float weight this layer replaces
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.qweight)
        self.register_buffer("weight_scale", weight.scale)
        self._meta = (weight.dtype, weight.name)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the weight was quantised from (the attribute PEFT reads for the adapters' dtype)."""
        return self._meta[0]

    @property
    def weight_fp8(self) -> FP8Weight:
        return FP8Weight(self.weight, self.weight_scale, self._meta[0], self._meta[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_linear(x, self.weight_fp8, None, None, 0.0, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


def is_block_fp8(module: nn.Module) -> bool:
    """A linear layer holding a checkpoint's block-scaled FP8 weight as transformers 5.17 loads it on a CUDA host
    (``integrations.finegrained_fp8.FP8Linear``: float8 ``weight``, ``weight_scale_inv``, ``block_size``), told by
    those attributes (transformers is not imported here)."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and not isinstance(module, (NF4Linear, FP8Linear))
            and isinstance(weight, torch.Tensor) and weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            and isinstance(getattr(module, "weight_scale_inv", None), torch.Tensor) and hasattr(module, "block_size"))


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The weight ``[out, in]`` of a decoder linear :func:`quantize` takes: an ``nn.Linear``'s as it is, a block-FP8
    layer's dequantised in fp32 (``ops.dequantize_blocks``)."""
    if is_block_fp8(linear):
        return dequantize_blocks(linear.weight.detach(), linear.weight_scale_inv.detach(), linear.block_size)
    return linear.weight.detach()


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (embeddings, blocks, final norm; not lm_head) of a Hugging Face causal LM."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if not isinstance(decoder, nn.Module) or decoder is model:
        raise ValueError(f"quantize needs a Hugging Face causal LM with get_decoder(), got {type(model).__name__}")
    return decoder


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """``(qualified name, module)`` of the linear layers :func:`quantize` replaces: the decoder blocks' ``nn.Linear``
    layers and block-FP8 layers of a checkpoint (:func:`is_block_fp8`), not PEFT's adapters (``lora_A`` /
    ``lora_B``) or ``modules_to_save`` copies."""
    decoder = _decoder(model)
    prefix = next((n + "." for n, m in model.named_modules() if m is decoder and n), "")
    return [(prefix + name, module) for name, module in decoder.named_modules()
            if (type(module) is nn.Linear or is_block_fp8(module))
            and not any(part.startswith("lora_") or part == "modules_to_save" for part in name.split("."))]


def quantize(model: nn.Module, quant_type: str = "nf4", *, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Replace, in place, every ``nn.Linear`` of the decoder blocks by an :class:`NF4Linear` (``"nf4"``: quantise
    with :func:`~leantune.ops.quantize_nf4`) or an :class:`FP8Linear` (``"fp8"``, experimental: e4m3 with
    per-output-channel scales, :func:`~leantune.ops.quantize_fp8`; 1 byte per weight plus 4 per output channel).
    Embeddings, norms and ``lm_head`` are left as they are. On a PEFT model
    (QLoRA: call it after ``get_peft_model``) the LoRA layers' base layers are quantised and the adapters
    (``lora_A`` / ``lora_B``, ``modules_to_save``) stay as they are; PEFT's forward and ``leantune.patch``'s fused
    LoRA ops both run on the NF4 base. A checkpoint's block-scaled FP8 layers (the module docstring) are
    dequantised in fp32 and requantised: per output channel for ``"fp8"``, to NF4 for ``"nf4"``.

    ``dtype``: the compute dtype the quantised layers record (their outputs' dtype, PEFT's adapters' rounding);
    default: each weight's own, a block-FP8 layer's the input embeddings' (transformers keeps those unquantised).

    Returns:
        ``{"layers": number of linear layers quantised, "bytes_before": their weight bytes, "bytes_after": the
        quantised bytes (NF4: codes + absmax codes + nested absmax; FP8: e4m3 weight + fp32 scales)}``.

    Raises:
        ValueError: an unsupported quant type, a model without ``get_decoder()``, or a layer whose weight cannot be
            NF4 (e.g. its size is not a multiple of 64) or FP8 (inf/NaN, a block-scale grid that does not fit the
            weight); the message names the layer, and the model is unchanged.
    """
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {QUANT_TYPES}, got {quant_type!r} (fp4 is not supported yet)")
    decoder = _decoder(model)
    prefix = next((n + "." for n, m in model.named_modules() if m is decoder and n), "")
    targets = [(name[len(prefix):], module) for name, module in quantized_linears(model)]
    replacements = []
    embeddings = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    fp8_dtype = dtype or getattr(getattr(embeddings, "weight", None), "dtype", torch.float32)
    for name, linear in targets:  # quantise all first, so a failing layer leaves the model unchanged
        block = is_block_fp8(linear)
        layer_dtype = dtype or (fp8_dtype if block else linear.weight.dtype)
        if quant_type == "fp8" and block:
            weight = requantize_blocks(linear.weight.detach(), linear.weight_scale_inv.detach(), linear.block_size,
                                       dtype=layer_dtype, name=prefix + name)
            replacements.append((name, FP8Linear(weight, linear.bias)))
        elif quant_type == "fp8":
            replacements.append((name, FP8Linear(quantize_fp8(linear.weight.detach(), name=prefix + name,
                                                              dtype=layer_dtype), linear.bias)))
        else:
            weight = dense_weight(linear).to(layer_dtype)
            replacements.append((name, NF4Linear(quantize_nf4(weight, name=prefix + name), linear.bias)))
    before = after = 0
    for (name, linear), (_, replacement) in zip(targets, replacements):
        parent_name, _, child = name.rpartition(".")
        setattr(decoder.get_submodule(parent_name) if parent_name else decoder, child, replacement)
        before += linear.weight.numel() * linear.weight.element_size() + (
            linear.weight_scale_inv.numel() * linear.weight_scale_inv.element_size() if is_block_fp8(linear) else 0)
        fields = ("weight", "weight_scale") if quant_type == "fp8" else ("codes", "absmax_codes", "nested_absmax")
        after += sum(getattr(replacement, f).numel() * getattr(replacement, f).element_size() for f in fields)
    return {"layers": len(replacements), "bytes_before": before, "bytes_after": after}
