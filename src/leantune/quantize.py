"""``leantune.quantize(model, "nf4" | "fp8" | "nf4-fp8")``: the frozen linear weights of a causal LM's decoder blocks
stored in NF4 (4-bit) or FP8 (e4m3 with per-output-channel scales, :mod:`leantune.ops.fp8`; experimental), or in NF4
with FP8 compute (experimental: docs/design.md "NF4 storage, FP8 compute"); ``leantune.dequantize(model)`` undoes it.

This module is longer than 500 lines because the quantised layer classes, the NF4 expert stacks, the whole-model
function and its inverse share one storage layout and one set of answers to PEFT's and transformers' probes: split,
each part would need the others' private fields.

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

Both also answer PEFT's probe for a quantised layer whose dense weight it needs (``dequantize_module_weight``: a
``W_q`` attribute, then ``dequantize()``, the protocol of HQQ's layers): DoRA's weight norm (PEFT's forward, in
either order) reads the dense weight the layer computes with. A merge into the codes is not possible:
:func:`dequantize` turns the layers back into ``nn.Linear`` layers of the dequantised weights first (then
``merge_and_unload`` and ``save_pretrained`` work). ``save_pretrained`` of the quantised transformers model is
refused (transformers would write codes it reads back as float weights), and so is loading a float ``weight``
into a quantised layer (it would be cast into the codes under the old scales).

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

MoE experts (NF4 only). An experts module (transformers 5.17's ``MixtralExperts``, ``Qwen3MoeExperts``, ...: 3-D
parameters ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) keeps each stack as ONE :class:`NF4Weight` of
3-D logical shape (bitsandbytes' flat 64-blocks over the row-major stack: each expert's rows are whole blocks, as
for a 2-D weight; one offset and one nested-scale array for the stack). One weight, not E of them: one Triton launch
dequantises the stack, and five buffers per stack instead of 5 E. Its tensors are buffers ``<stack>_nf4_<field>``
of the experts module (persistent: they follow ``.to(device)`` and are the state dict). The module's class becomes
an :class:`NF4Experts` subclass of its own, and ``gate_up_proj`` / ``down_proj`` stay registered as frozen
*placeholder* parameters of the stack's logical shape and compute dtype, backed by ONE element (a stride-0 expand):
PEFT's ``target_parameters`` finds them by ``named_parameters`` and its ``ParamWrapper`` reads only their shape,
dtype and device, so ``get_peft_model`` works in either order at no memory. ``.to`` rebuilds the placeholders from
their moved element (``_apply``), and the state dict leaves them out. The module's own (HF's) forward, the path when
it is not patched, dequantises each stack into the placeholder's data for the call (PEFT's parametrization then
adds its delta to the dequantised W, as over a bf16 stack); ``leantune.patch`` hands :meth:`NF4Experts.nf4_stack`
to ``ops.moe_experts``, which dequantises inside its node.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

from .ops import (
    FP8Weight,
    NF4Weight,
    dequantize_blocks,
    dequantize_fp8,
    dequantize_nf4,
    dequantize_nf4_fp8,
    lora_linear,
    quantize_fp8,
    quantize_nf4,
    requantize_blocks,
    with_fp8_compute,
)

QUANT_TYPES = ("nf4", "fp8", "nf4-fp8")
_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TENSOR_FIELDS = ("codes", "absmax_codes", "nested_absmax", "code", "nested_code")
EXPERT_STACKS = ("gate_up_proj", "down_proj")


def _apply_keeping_storage(module: nn.Module, fn, apply_rest, names, compute_dtype) -> torch.dtype | None:
    """``module._apply(fn)`` for a quantised layer: the buffers ``names`` (codes, their scales and tables) follow
    fn's device but keep their dtypes (``model.to(torch.bfloat16)``, ``.half()`` would otherwise cast them: e4m3
    codes and fp32 scales lost); ``apply_rest()`` applies fn to everything else. Returns the float dtype fn casts
    ``compute_dtype`` (the module's) to, for the caller to record, or None when fn gives no float dtype."""
    held = {n: module._buffers.pop(n) for n in names if module._buffers.get(n) is not None}
    try:
        apply_rest()
    finally:
        for n, t in held.items():
            target = fn(t.reshape(-1)[:0])  # what fn does to t, on no elements
            module._buffers[n] = fn(t) if target.dtype == t.dtype else t.to(target.device)
    probe = fn(torch.empty(0, dtype=compute_dtype))
    return probe.dtype if probe.dtype in (torch.float32, torch.float16, torch.bfloat16) else None


class _Dequantizable:
    """What :class:`NF4Linear` and :class:`FP8Linear` share: PEFT's probe for a quantised layer's dense weight, and
    the refusal of a float ``weight`` on load."""

    @property
    def W_q(self) -> torch.Tensor:  # noqa: N802 (the name PEFT's dequantize_module_weight looks for)
        """The codes, under the name PEFT's ``dequantize_module_weight`` probes: it then calls :meth:`dequantize`
        instead of reading ``weight`` (codes) as a float matrix (DoRA's weight norm)."""
        return self.weight

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight ``[out_features, in_features]`` the layer computes with, formed in fp32 and rounded once
        to ``dtype`` (default: its compute dtype; what PEFT's probe gets); a new tensor, no gradient."""
        raise NotImplementedError

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        weight = state_dict.get(prefix + "weight")
        if weight is not None and not _holds_codes(self, weight):
            # a float weight would be cast into the codes under the old scales (or ignored): refuse this layer
            error_msgs.append(_float_weight_refused(prefix, self, weight))
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _refuse_float_weights(module, state_dict, prefix, *args) -> None:
    """``load_state_dict``'s pre-hook on a model :func:`quantize` changed: the quantised layers' refusal of a float
    ``weight`` (:meth:`_Dequantizable._load_from_state_dict`), raised before anything is copied (each layer's own
    check runs in module order, after the layers before it have loaded)."""
    for name, layer in module.named_modules():
        weight = state_dict.get(f"{prefix}{name}.weight") if isinstance(layer, _Dequantizable) else None
        if weight is not None and not _holds_codes(layer, weight):
            raise RuntimeError(_float_weight_refused(f"{prefix}{name}.", layer, weight) + " (nothing was loaded)")


def _float_weight_refused(prefix: str, layer, weight: torch.Tensor) -> str:
    return (f"{prefix}weight: a {weight.dtype} weight of shape {tuple(weight.shape)} cannot be loaded into "
            f"leantune's {type(layer).__name__} (quantised codes): load the float weights into the model before "
            "leantune.quantize, or leantune.dequantize it first")


def _check_input(layer, x: torch.Tensor, name: str) -> None:
    """A quantised layer's input: float32/float16/bfloat16 with ``in_features`` last (ValueError naming the layer)."""
    if x.dtype not in _COMPUTE_DTYPES:
        hint = f" (a {x.dtype} model cannot run them: leantune.dequantize it first)" if x.is_floating_point() else ""
        raise ValueError(f"{name}: a {type(layer).__name__} takes float32, float16 or bfloat16 inputs, got "
                         f"{x.dtype}{hint}")
    if x.dim() == 0 or x.shape[-1] != layer.in_features:
        raise ValueError(f"{name}: the input's last dimension must be in_features = {layer.in_features}, got shape "
                         f"{tuple(x.shape)}")


# what writing into the codes or merging a float matrix into them calls first (PEFT's merge: ``weight.data += delta``;
# its safe merge: ``orig = weight.data.clone(); orig += delta``; DoRA's: ``weight + s * delta`` for the norm)
_MERGE_STEPS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__setitem__", "clone", "add", "sub",
                          "mul", "div", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                          "__truediv__"})


class _Codes(torch.Tensor):
    """A quantised layer's codes as its ``weight`` shows them (NF4Linear's packed uint8, FP8Linear's e4m3): reading
    them (device, dtype, shape, ``.to``) works; arithmetic on them, ``clone`` or writing into them (the steps of
    PEFT's merges of an adapter into the base weight) raise a ValueError saying what to do instead, before anything
    changes."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _MERGE_STEPS or (name.endswith("_") and not name.startswith("_") and name != "requires_grad_"):
            raise ValueError(_MERGE_REFUSED)
        with torch._C.DisableTorchFunctionSubclass():  # what derives from the codes is a plain tensor (e.g.
            return func(*args, **(kwargs or {}))       # ``weight.to(torch.float32) * scale`` to inspect them)

    @property
    def data(self):  # stays a _Codes: the merge's next step (``+=``, ``clone``) is refused
        return torch.Tensor.data.__get__(self).as_subclass(_Codes)

    @data.setter
    def data(self, value):
        raise ValueError(_MERGE_REFUSED)


_MERGE_REFUSED = ("merging an adapter into leantune's quantised weight codes (or any arithmetic, clone or write on "
                  "them) is not possible: "
                  "leantune.dequantize(model) first (then merge_and_unload), or leantune export for a leantune train "
                  "run")


def _holds_codes(layer, weight: torch.Tensor) -> bool:
    """Whether a state dict's ``weight`` entry is this quantised layer's own kind (FP8Linear: e4m3 codes; an
    NF4Linear saves its codes under ``codes``, no weight entry at all)."""
    return isinstance(layer, FP8Linear) and weight.dtype == layer.weight.dtype


class NF4Linear(_Dequantizable, nn.Linear):
    """``y = x W^T + b`` with W [out_features, in_features] stored as NF4 and dequantised at each call.

    The NF4 tensors are buffers saved in the state dict, with the nested offset and, for FP8 compute, the scales
    (they follow ``.to(device)``; a float cast of the model, ``.to(torch.bfloat16)``, keeps their dtypes and makes it
    the layer's compute dtype); ``bias`` stays a parameter in its dtype. An
    ``nn.Linear`` subclass without a float weight (see the module docstring: what PEFT reads of it).
    """

    def __init__(self, weight: NF4Weight, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the float weight this layer replaces
        if len(weight.shape) != 2:
            raise ValueError(f"{weight.name}: an NF4Linear weight must be 2-D, got shape {weight.shape}")
        self.out_features, self.in_features = weight.shape
        for field in _TENSOR_FIELDS:
            self.register_buffer(field, getattr(weight, field))
        # the double quantisation's offset: a Python float in use (a kernel argument), a buffer for the state dict
        self.register_buffer("offset", torch.tensor(weight.offset, dtype=torch.float32, device=weight.device))
        # FP8 compute ("nf4-fp8"): the per-output-channel e4m3 scales
        self.register_buffer("fp8_scale", weight.fp8_scale)
        self._meta = (weight.offset, weight.shape, weight.dtype, weight.name)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def _apply(self, fn, recurse=True):
        dtype = _apply_keeping_storage(self, fn, lambda: super(NF4Linear, self)._apply(fn, recurse),
                                       (*_TENSOR_FIELDS, "offset", "fp8_scale"), self._meta[2])
        if dtype is not None:  # the model cast to another float dtype computes in it
            self._meta = (self._meta[0], self._meta[1], dtype, self._meta[3])
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "offset" in state_dict:  # read once at load, as NF4Experts does
            self._meta = (float(self.offset), *self._meta[1:])

    @property
    def weight(self) -> torch.Tensor:
        """The packed NF4 codes (uint8, two weights a byte), as bitsandbytes' ``Linear4bit.weight`` holds them: what
        PEFT and other code probing a linear layer's ``weight`` for its device find. Not a float matrix; a view
        that refuses arithmetic and writes (PEFT's merges would write a float matrix there: :class:`_Codes`)."""
        return self.codes.as_subclass(_Codes)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the weight was quantised from (bitsandbytes' attribute name, read by PEFT)."""
        return self._meta[2]

    @property
    def weight_nf4(self) -> NF4Weight:
        offset, shape, dtype, name = self._meta
        return NF4Weight(**{f: getattr(self, f) for f in _TENSOR_FIELDS}, offset=offset, shape=shape, dtype=dtype,
                         fp8_scale=self.fp8_scale, name=name)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The NF4 values, or with FP8 compute the e4m3 values its GEMMs read (:meth:`_Dequantizable.dequantize`)."""
        with torch.no_grad():
            if self.fp8_scale is not None:
                return dequantize_fp8(dequantize_nf4_fp8(self.weight_nf4), dtype or self.compute_dtype)
            return dequantize_nf4(self.weight_nf4, dtype=dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, x, self._meta[3])  # dequantize_nf4 writes the three float dtypes
        if self.fp8_scale is not None:  # FP8 compute: e4m3 GEMMs on codes dequantised to e4m3, as the fused ops run
            return lora_linear(x, self.weight_nf4, None, None, 0.0, self.bias)
        weight = dequantize_nf4(self.weight_nf4, dtype=x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        compute = ", fp8 compute" if self.fp8_scale is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"nf4{compute}")


class FP8Linear(_Dequantizable, nn.Linear):
    """``y = x W^T + b`` with W ``[out_features, in_features]`` ~= diag(weight_scale) weight (e4m3), the GEMMs in FP8.

    ``weight`` (float8_e4m3fn) and ``weight_scale`` (fp32 [out]) are buffers saved in the state dict (a float cast
    of the model keeps their dtypes and makes it the layer's compute dtype); ``bias`` stays a parameter in its
    dtype. The module docstring says what PEFT reads of it.
    """

    def __init__(self, weight: FP8Weight, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the float weight this layer replaces
        self.out_features, self.in_features = weight.shape
        self._buffers["weight"] = weight.qweight  # a buffer behind the ``weight`` property (register_buffer refuses)
        self.register_buffer("weight_scale", weight.scale)
        self._meta = (weight.dtype, weight.name)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def _apply(self, fn, recurse=True):
        dtype = _apply_keeping_storage(self, fn, lambda: super(FP8Linear, self)._apply(fn, recurse),
                                       ("weight", "weight_scale"), self._meta[0])
        if dtype is not None:  # the model cast to another float dtype computes in it
            self._meta = (dtype, self._meta[1])
        return self

    @property
    def weight(self) -> torch.Tensor:
        """The e4m3 codes ``[out_features, in_features]`` (the state dict's ``weight``), as a view that refuses
        arithmetic and writes (PEFT's merges: :class:`_Codes`)."""
        return self._buffers["weight"].as_subclass(_Codes)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the weight was quantised from, or the model was cast to since (the attribute PEFT reads for the
        adapters' dtype)."""
        return self._meta[0]

    @property
    def weight_fp8(self) -> FP8Weight:
        return FP8Weight(self._buffers["weight"], self.weight_scale, self._meta[0], self._meta[1])

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """diag(weight_scale) weight (:meth:`_Dequantizable.dequantize`)."""
        with torch.no_grad():
            return dequantize_fp8(self.weight_fp8, dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, x, self._meta[1])  # the e4m3 GEMMs take the three float dtypes
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

def _placeholder(shape, like: torch.Tensor) -> nn.Parameter:
    """A frozen parameter of ``shape`` with ``like``'s dtype and device holding one element (a stride-0 expand)."""
    one = torch.zeros((1,) * len(shape), dtype=like.dtype, device=like.device)
    return nn.Parameter(one.expand(*shape), requires_grad=False)


class NF4Experts(nn.Module):
    """Mixin of a MoE experts module whose ``gate_up_proj`` / ``down_proj`` stacks are NF4 (module docstring).

    Built by :func:`quantize_experts` as ``type(f"NF4{cls.__name__}", (NF4Experts, cls), {})`` over the experts
    class ``cls``; ``_leantune_float_class`` is ``cls``. Buffers ``<stack>_nf4_{codes, absmax_codes, nested_absmax,
    code, nested_code, offset}``; parameters ``<stack>``: frozen one-element placeholders of the stack's shape.
    """

    _leantune_float_class: type = nn.Module

    def nf4_stack(self, name: str) -> NF4Weight:
        """The NF4 weight of stack ``name`` (``"gate_up_proj"`` or ``"down_proj"``), its logical 3-D shape."""
        shape, dtype, qname, offset = self._leantune_nf4[name]
        return NF4Weight(**{f: getattr(self, f"{name}_nf4_{f}") for f in _TENSOR_FIELDS}, offset=offset,
                         shape=shape, dtype=dtype, name=qname)

    def _apply(self, fn, recurse=True):
        # the placeholders' one element goes through fn (device, dtype) and is expanded again: never fn on the
        # expand itself, which would allocate the whole stack; the NF4 buffers keep their dtypes
        held = {n: self._parameters.pop(n) for n in self._leantune_nf4 if n in self._parameters}
        names = [f"{n}_nf4_{f}" for n in self._leantune_nf4 for f in (*_TENSOR_FIELDS, "offset")]
        compute = next(iter(self._leantune_nf4.values()))[1]
        try:
            dtype = _apply_keeping_storage(self, fn, lambda: super(NF4Experts, self)._apply(fn, recurse), names,
                                           compute)
        finally:
            for n, p in held.items():
                self._parameters[n] = _placeholder(p.shape, fn(p.detach()[(slice(0, 1),) * p.dim()].clone()))
        if dtype is not None:  # the stacks dequantise to the model's new float dtype
            self._leantune_nf4 = {n: (shape, dtype, *rest) for n, (shape, _, *rest) in self._leantune_nf4.items()}
        return self

    def __deepcopy__(self, memo):
        # Parameter.__deepcopy__ clones a placeholder into a dense stack: copy without them, then new placeholders
        held = {n: self._parameters.pop(n) for n in self._leantune_nf4 if n in self._parameters}
        try:
            clone = type(self).__new__(type(self))
            memo[id(self)] = clone
            clone.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        finally:
            self._parameters.update(held)
        for n, p in held.items():
            clone._parameters[n] = _placeholder(p.shape, p)
        return clone

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for n in self._leantune_nf4:
            destination.pop(prefix + n, None)  # a placeholder: the stack is its NF4 buffers

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        held = {n: self._parameters.pop(n) for n in self._leantune_nf4 if n in self._parameters}
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self._parameters.update(held)
        for n, (shape, dtype, qname, _) in list(self._leantune_nf4.items()):
            if prefix + f"{n}_nf4_offset" in state_dict:  # the offset is a Python float in use: read once at load
                offset = float(getattr(self, f"{n}_nf4_offset"))
                self._leantune_nf4[n] = (shape, dtype, qname, offset)

    def forward(self, *args, **kwargs):
        """The experts class's own forward with each stack dequantised (to the placeholder's dtype) into the
        placeholder's data for this call: PEFT's parametrization, when active, adds its delta to it."""
        holders = []
        for n in self._leantune_nf4:
            parametrized = nn.utils.parametrize.is_parametrized(self, n)
            holder = self.parametrizations[n].original if parametrized else self._parameters[n]
            holders.append((holder, holder.data))
        try:
            for (holder, _), n in zip(holders, self._leantune_nf4):
                holder.data = dequantize_nf4(self.nf4_stack(n), dtype=holder.dtype)
            return super().forward(*args, **kwargs)
        finally:
            for holder, data in holders:
                holder.data = data


_NF4_CLASSES: dict[type, type] = {}


def _nf4_class(cls: type) -> type:
    if issubclass(cls, NF4Experts):
        return cls
    if cls not in _NF4_CLASSES:
        name = f"NF4{cls.__name__}"
        _NF4_CLASSES[cls] = type(name, (NF4Experts, cls), {"_leantune_float_class": cls, "__module__": __name__,
                                                           "__qualname__": name})
        globals().setdefault(name, _NF4_CLASSES[cls])  # where pickle looks the class up by name
    return _NF4_CLASSES[cls]


def expert_stacks(module: nn.Module) -> bool:
    """Whether ``module`` is a MoE experts module :func:`quantize` puts in NF4: 3-D frozen-able ``gate_up_proj``
    and ``down_proj`` parameters of its own (not yet NF4)."""
    return not isinstance(module, NF4Experts) and all(
        isinstance(module._parameters.get(n), nn.Parameter) and module._parameters[n].dim() == 3
        for n in EXPERT_STACKS)


def quantize_experts(module: nn.Module, name: str = "experts") -> tuple[int, int]:
    """Put ``module``'s expert stacks in NF4, in place (module docstring); returns (bytes before, bytes after).

    Raises:
        ValueError: not an experts module (:func:`expert_stacks`), or a stack NF4 cannot hold (names it); the
            module is unchanged then.
    """
    if not expert_stacks(module):
        raise ValueError(f"{name}: not a MoE experts module with 3-D gate_up_proj and down_proj parameters")
    stacks = {n: quantize_nf4(module._parameters[n].detach(), name=f"{name}.{n}") for n in EXPERT_STACKS}
    before = after = 0
    meta = {}
    for n, w in stacks.items():
        old = module._parameters.pop(n)
        before += old.numel() * old.element_size()
        for f in _TENSOR_FIELDS:
            module.register_buffer(f"{n}_nf4_{f}", getattr(w, f))
        after += sum(getattr(w, f).numel() * getattr(w, f).element_size() for f in _TENSOR_FIELDS[:3])
        module.register_buffer(f"{n}_nf4_offset", torch.tensor(w.offset, dtype=torch.float32, device=w.device))
        module._parameters[n] = _placeholder(w.shape, old)
        meta[n] = (w.shape, w.dtype, w.name, w.offset)
    module.__class__ = _nf4_class(type(module))
    module._leantune_nf4 = meta
    return before, after


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


def _quantized_kinds(model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """``(name, the quant types it is)`` of each layer already quantised by leantune (expert stacks are NF4 under
    both NF4 types)."""
    kinds = []
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear):
            kinds.append((name, ("fp8",)))
        elif isinstance(m, NF4Linear):
            kinds.append((name, ("nf4-fp8",) if m.fp8_scale is not None else ("nf4",)))
        elif isinstance(m, NF4Experts):
            kinds.append((name, ("nf4", "nf4-fp8")))
    return kinds


def quantize(model: nn.Module, quant_type: str = "nf4", *, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Replace, in place, every ``nn.Linear`` of the decoder blocks by an :class:`NF4Linear` (``"nf4"``: quantise
    with :func:`~leantune.ops.quantize_nf4`) or an :class:`FP8Linear` (``"fp8"``, experimental: e4m3 with
    per-output-channel scales, :func:`~leantune.ops.quantize_fp8`; 1 byte per weight plus 4 per output channel).
    ``"nf4-fp8"`` (experimental): NF4 storage with FP8 compute, an :class:`NF4Linear` whose weight also carries
    per-output-channel e4m3 scales (:func:`~leantune.ops.with_fp8_compute`, 4 bytes per output channel more); the
    fused ops dequantise its codes straight to e4m3 and run the frozen GEMMs in FP8 (docs/design.md, "NF4
    storage, FP8 compute"); its input in a dimension that is not a multiple of 64 is refused.
    Embeddings, norms and ``lm_head`` are left as they are. On a PEFT model
    (QLoRA: call it after ``get_peft_model``) the LoRA layers' base layers are quantised and the adapters
    (``lora_A`` / ``lora_B``, ``modules_to_save``) stay as they are; PEFT's forward and ``leantune.patch``'s fused
    LoRA ops both run on the NF4 base. A checkpoint's block-scaled FP8 layers (the module docstring) are
    dequantised in fp32 and requantised: per output channel for ``"fp8"``, to NF4 for ``"nf4"``.

    ``dtype``: the compute dtype the quantised layers record (their outputs' dtype, PEFT's adapters' rounding);
    default: each weight's own, a block-FP8 layer's the input embeddings' (transformers keeps those unquantised).

    With ``"nf4"`` and ``"nf4-fp8"`` the MoE experts modules' 3-D ``gate_up_proj`` / ``down_proj`` stacks are
    quantised too (:func:`quantize_experts`, module docstring; NF4 dequantised to the compute dtype in both: the
    grouped expert GEMMs have no FP8 path); with ``"fp8"`` they stay as they are.

    Returns:
        ``{"layers": number of linear layers quantised, "experts": number of experts modules quantised,
        "bytes_before": their weight bytes, "bytes_after": the quantised bytes (NF4: codes + absmax codes + nested
        absmax, + the fp32 FP8 scales for nf4-fp8; FP8: e4m3 weight + fp32 scales)}``.

    Raises:
        ValueError: an unsupported quant type, a model without ``get_decoder()``, a model with layers leantune
            quantised to another type (layers already of this type are kept: a second call quantises only what is
            left), a weight on the meta device, or a layer whose weight cannot be NF4 (e.g. its size is not a
            multiple of 64) or FP8 (inf/NaN, a block-scale grid that does not fit the weight); the message names the
            layer, and the model is unchanged.
    """
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {QUANT_TYPES} (lower case), got {quant_type!r}")
    if dtype is not None and dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"dtype must be None or one of torch.float32, torch.float16, torch.bfloat16 (the compute "
                         f"dtype), got {dtype!r}")
    decoder = _decoder(model)
    other = [(name, kind) for name, kind in _quantized_kinds(model) if quant_type not in kind]
    if other:
        raise ValueError(f"the model is already quantised otherwise ({len(other)} layers, e.g. {other[0][0]} in "
                         f"{other[0][1][0]}), not {quant_type!r}: quantize its float weights once, to one type")
    prefix = next((n + "." for n, m in model.named_modules() if m is decoder and n), "")
    targets = [(name[len(prefix):], module) for name, module in quantized_linears(model)]
    done = [(name, m) for name, m in model.named_modules() if isinstance(m, (FP8Linear, NF4Linear))]
    if dtype is not None and any(m.compute_dtype != dtype for _, m in done):
        name, m = next((n, m) for n, m in done if m.compute_dtype != dtype)
        raise ValueError(f"{name} is already quantised with compute dtype {m.compute_dtype}; dtype={dtype} would "
                         f"apply only to layers quantised now: cast the model (model.to({dtype})) instead")
    for name, linear in targets:
        if linear.weight.is_meta:
            raise ValueError(f"{prefix + name}: its weight is on the meta device (not loaded): load or materialise "
                             "the model before quantize")
    experts = [(prefix + name, m) for name, m in decoder.named_modules() if expert_stacks(m)] \
        if quant_type != "fp8" else []
    if not targets and not experts and not _quantized_kinds(model):
        raise ValueError(f"{type(model).__name__}: no nn.Linear layer in its decoder blocks to quantise (e.g. "
                         "GPT-2's Conv1D layers are not nn.Linear): leantune.quantize takes nn.Linear projections")
    if quant_type == "nf4-fp8":  # the check with_fp8_compute would fail on, before anything changes
        for name, linear in targets:
            if linear.in_features % 64:
                raise ValueError(f"{prefix + name}: NF4 with FP8 compute needs in_features a multiple of 64 (each "
                                 f"row whole 64-blocks), got {linear.in_features}")
    for name, module in experts:  # the check quantize_nf4 would fail on, before anything changes
        for n in EXPERT_STACKS:
            if module._parameters[n].numel() % 64:
                raise ValueError(f"{name}.{n}: NF4 needs a number of weights that is a multiple of 64, got shape "
                                 f"{tuple(module._parameters[n].shape)}")
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
            weight = quantize_nf4(dense_weight(linear).to(layer_dtype), name=prefix + name)
            weight = with_fp8_compute(weight) if quant_type == "nf4-fp8" else weight
            replacements.append((name, NF4Linear(weight, linear.bias)))
    before = after = 0
    for (name, linear), (_, replacement) in zip(targets, replacements):
        parent_name, _, child = name.rpartition(".")
        setattr(decoder.get_submodule(parent_name) if parent_name else decoder, child, replacement)
        before += linear.weight.numel() * linear.weight.element_size() + (
            linear.weight_scale_inv.numel() * linear.weight_scale_inv.element_size() if is_block_fp8(linear) else 0)
        fields = {"fp8": ("weight", "weight_scale"), "nf4": ("codes", "absmax_codes", "nested_absmax"),
                  "nf4-fp8": ("codes", "absmax_codes", "nested_absmax", "fp8_scale")}[quant_type]
        after += sum(getattr(replacement, f).numel() * getattr(replacement, f).element_size() for f in fields)
    for name, module in experts:  # after the linears: one stack at a time, its bf16 tensor freed as it goes
        b, a = quantize_experts(module, name)
        before, after = before + b, after + a
    _refuse_save_pretrained(model, quant_type)
    if not getattr(model, "_leantune_load_checked", False):
        model.register_load_state_dict_pre_hook(_refuse_float_weights)
        model._leantune_load_checked = True
    return {"layers": len(replacements), "experts": len(experts), "bytes_before": before, "bytes_after": after}


class _QuantizedSave:
    """A quantised transformers model's ``save_pretrained``: refused (an instance attribute :func:`quantize` sets and
    :func:`dequantize` removes; a class, so the model still pickles). transformers would write the codes under the
    float weights' names, and read them back as float weights without an error."""

    def __init__(self, quant_type: str):
        self.quant_type = quant_type

    def __call__(self, *args, **kwargs):
        raise ValueError(f"save_pretrained of a model leantune.quantize put in {self.quant_type} would write codes "
                         "that transformers loads back as float weights: save the adapter (PEFT's save_pretrained), or "
                         "leantune.dequantize(model) first to save dense weights (leantune export merges a run's "
                         "adapter into its dequantised base)")


def _transformers_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # a PeftModel: the transformers model under it
    return get_base() if callable(get_base) else model


def _refuse_save_pretrained(model: nn.Module, quant_type: str) -> None:
    hf = _transformers_model(model)
    if callable(getattr(type(hf), "save_pretrained", None)):
        hf.__dict__["save_pretrained"] = _QuantizedSave(quant_type)


def dequantize(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Undo :func:`quantize`, in place: every :class:`NF4Linear` / :class:`FP8Linear` (leantune's or an FP8
    checkpoint's as :func:`quantize` loaded it) becomes a frozen ``nn.Linear`` of its dequantised weight
    (:meth:`NF4Linear.dequantize`: the values the layer computed with, in ``dtype``, default its compute dtype; the
    bias kept, cast to ``dtype`` when given) and every NF4 experts module its float class again, its stacks
    dequantised. Afterwards
    PEFT's ``merge_and_unload`` and transformers' ``save_pretrained`` work as on a float model (the weights carry
    the quantisation error: they are not the weights before :func:`quantize`). The adapters are untouched.

    Returns:
        ``{"layers": linear layers dequantised, "experts": experts modules dequantised}``.

    Raises:
        ValueError: ``dtype`` not None, float32, float16 or bfloat16 (the model is unchanged then).
    """
    if dtype is not None and dtype not in _COMPUTE_DTYPES:  # checked before any layer changes
        raise ValueError(f"dtype must be None or one of torch.float32, torch.float16, torch.bfloat16, got {dtype!r}")
    layers = experts = 0
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, (NF4Linear, FP8Linear)):
                    continue
                linear = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                linear.weight = nn.Parameter(child.dequantize(dtype), requires_grad=False)
                linear.bias = child.bias if child.bias is None or dtype is None else nn.Parameter(
                    child.bias.detach().to(dtype), requires_grad=False)
                setattr(parent, name, linear)
                layers += 1
        for module in list(model.modules()):
            if isinstance(module, NF4Experts):
                _dequantize_experts(module)
                experts += 1
    allow_save_pretrained(model)
    return {"layers": layers, "experts": experts}


@contextlib.contextmanager
def quantized_storage_hidden(model: nn.Module):
    """The quantised layers' frozen storage out of ``model``'s state dict while the block runs: the NF4 expert
    stacks' placeholder parameters taken out of their modules (torch.distributed.checkpoint's
    ``ignore_frozen_params`` pops each frozen parameter's key, and they have none) and the codes, scales and tables
    of every quantised layer made non-persistent (``ignore_frozen_params`` keeps buffers: a run's checkpoint would
    copy the whole frozen base to the host at every save)."""
    held = [(module, n, module._parameters.pop(n)) for module in model.modules() if isinstance(module, NF4Experts)
            for n in module._leantune_nf4 if n in module._parameters]
    hidden = [(module, n) for module in model.modules() if isinstance(module, (NF4Linear, FP8Linear, NF4Experts))
              for n in module._buffers if n not in module._non_persistent_buffers_set]
    for module, n in hidden:
        module._non_persistent_buffers_set.add(n)
    try:
        yield
    finally:
        for module, n in hidden:
            module._non_persistent_buffers_set.discard(n)
        for module, n, placeholder in held:
            module._parameters[n] = placeholder


def allow_save_pretrained(model: nn.Module) -> None:
    """Lift :func:`quantize`'s refusal of ``save_pretrained`` (for code that has replaced every quantised layer
    itself, as ``leantune export`` does; :func:`dequantize` calls it)."""
    _transformers_model(model).__dict__.pop("save_pretrained", None)


def _dequantize_experts(module: NF4Experts) -> None:
    """An NF4 experts module back to its float class, each stack a frozen parameter of its dequantised values (under
    a PEFT parametrization: its ``original``)."""
    stacks = {n: dequantize_nf4(module.nf4_stack(n)) for n in module._leantune_nf4}
    for n, dense in stacks.items():
        if nn.utils.parametrize.is_parametrized(module, n):
            module.parametrizations[n].original.data = dense
        else:
            module._parameters[n] = nn.Parameter(dense, requires_grad=False)
        for f in (*_TENSOR_FIELDS, "offset"):
            del module._buffers[f"{n}_nf4_{f}"]
    module.__class__ = module._leantune_float_class
    del module._leantune_nf4
