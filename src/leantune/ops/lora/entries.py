"""What a LoRA node's entries are and how they are checked: ``LoraWeights`` (one projection as the user gives it),
``_Proj`` (its tensors in a node's flat argument list), the input checks every LoRA op runs before any kernel
(``x_quantized`` included), and the ``Meta`` of projections that share an input. ``api`` (LoRA) and ``dora`` (DoRA)
both build on this module."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import _runtime
from ..fp8 import E4M3, FP8Weight
from ..nf4 import NF4Weight
from .passes import Meta


class LoraWeights(NamedTuple):
    """One projection: frozen ``weight [out, in]``, adapters ``lora_A [r, in]``, ``lora_B [out, r]`` (PEFT layout),
    ``scaling`` (alpha/r, rsLoRA alpha/sqrt(r), ... whatever the caller uses) and ``bias [out]`` or None.
    ``lora_A = lora_B = None`` is a plain frozen projection. ``weight`` may be an :class:`~leantune.ops.NF4Weight`
    (QLoRA): it is dequantised to its dtype (autocast's under autocast) into a reused workspace before the frozen
    GEMM, in forward and again in backward, and only its 4-bit codes are kept for backward. It may be an
    :class:`~leantune.ops.fp8.FP8Weight`: the frozen GEMMs (y and dX) then run in e4m3 (:mod:`leantune.ops.fp8`),
    nothing dequantised."""

    weight: torch.Tensor
    lora_A: torch.Tensor | None
    lora_B: torch.Tensor | None
    scaling: float
    bias: torch.Tensor | None = None


class _Proj(NamedTuple):
    """One projection's four entries in an autograd node's flat argument list (LoraWeights without the scaling,
    which rides in ``Meta``): tensors, their ``needs_input_grad`` flags, or their gradients, always in this order."""

    weight: object
    lora_A: object
    lora_B: object
    bias: object

    @classmethod
    def unflatten(cls, flat, count):
        """(the first ``count`` projections of ``flat`` as _Proj's, the entries after them)."""
        width = len(cls._fields)
        projs = [cls(*flat[j * width:(j + 1) * width]) for j in range(count)]
        return projs, tuple(flat[count * width:])

    @staticmethod
    def flatten(projs):
        """The entries of ``projs`` (any 4-sequences: _Proj's or gradient lists) in one flat list."""
        return [entry for proj in projs for entry in proj]


def _no_autocast(device):
    return torch.autocast(device_type=device.type, enabled=False)


def _check_projection(name, proj, in_features, device):
    """Validate one LoraWeights against x's last dim; return it as a tuple of 4 tensors plus scaling."""
    if not isinstance(proj, LoraWeights):
        if isinstance(proj, tuple) and len(proj) in (4, 5):
            proj = LoraWeights(*proj)
        else:
            raise ValueError(f"{name.rstrip('.') or 'the projection'} must be a LoraWeights(weight, lora_A, lora_B, "
                             f"scaling, bias), got {type(proj).__name__}")
    weight, lora_A, lora_B, scaling, bias = proj
    if isinstance(weight, (NF4Weight, FP8Weight)):  # a quantised frozen weight (QLoRA's NF4, or e4m3)
        if len(weight.shape) != 2:
            raise ValueError(f"{name}weight ({type(weight).__name__}) must be 2-D [out, in], got shape "
                             f"{weight.shape}")
    else:
        _runtime.check_tensor(f"{name}weight", weight)
    if len(weight.shape) != 2:
        raise ValueError(f"{name}weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    out_features = weight.shape[0]
    _runtime.check_shape(f"{name}weight", weight, (out_features, in_features), "[out, in] with in = x's last dim")
    if out_features == 0 or in_features == 0:
        raise ValueError(f"{name}weight must have out >= 1 and in >= 1 (x's last dim), got shape "
                         f"{tuple(weight.shape)}")
    if (lora_A is None) != (lora_B is None):
        raise ValueError(f"{name}lora_A and {name}lora_B must both be tensors or both be None")
    if lora_A is not None:
        _runtime.check_tensor(f"{name}lora_A", lora_A)
        _runtime.check_tensor(f"{name}lora_B", lora_B)
        if lora_A.dim() != 2 or lora_A.shape[0] < 1:
            raise ValueError(f"{name}lora_A must be 2-D [r, in] with r >= 1, got shape {tuple(lora_A.shape)}")
        rank = lora_A.shape[0]
        if lora_A.shape[1] != in_features:
            raise ValueError(f"{name}lora_A must have shape (r, {in_features}) ([r, in] with in = x's last dim, PEFT's "
                             f"layout), got {tuple(lora_A.shape)}")
        _runtime.check_shape(f"{name}lora_B", lora_B, (out_features, rank), "[out, r] with out = weight's rows")
        if lora_A.dtype != lora_B.dtype:
            raise ValueError(f"{name}lora_A and {name}lora_B must share a dtype, got {lora_A.dtype} and "
                             f"{lora_B.dtype}")
        scaling = _runtime.check_real(f"{name}scaling", scaling)
    if bias is not None:
        _runtime.check_tensor(f"{name}bias", bias)
        _runtime.check_shape(f"{name}bias", bias, (out_features,), "[out] with out = weight's rows")
    for label, t in (("weight", weight), ("lora_A", lora_A), ("lora_B", lora_B), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(f"all tensors must be on one device: x on {device}, {name}{label} on {t.device}")
    return (weight, lora_A, lora_B, bias), float(scaling) if lora_A is not None else 0.0


def _check_x(x):
    _runtime.check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., in], got a 0-dim tensor")


def _check_x_quantized(x_quantized, x):
    """``(codes, scales)`` or None from a ``x_quantized`` argument: codes ``float8_e4m3fn [rows, in]`` contiguous
    (rows = x's leading dims flattened), scales fp32 ``[rows]``, on x's device."""
    if x_quantized is None:
        return None, None
    if not isinstance(x_quantized, (tuple, list)) or len(x_quantized) != 2:
        raise ValueError(f"x_quantized must be a (codes, scales) pair or None, got {type(x_quantized).__name__}")
    codes, scales = x_quantized
    rows = math.prod(x.shape[:-1])
    expected = f"codes float8_e4m3fn contiguous of shape ({rows}, {x.shape[-1]}), scales float32 of shape ({rows},)"
    if (not isinstance(codes, torch.Tensor) or not isinstance(scales, torch.Tensor) or codes.dtype != E4M3
            or scales.dtype != torch.float32 or tuple(codes.shape) != (rows, x.shape[-1])
            or tuple(scales.shape) != (rows,) or not codes.is_contiguous()):
        got = tuple(f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    for t in (codes, scales))
        raise ValueError(f"x_quantized must be x quantised per row ({expected}), got {got}")
    if codes.device != x.device or scales.device != x.device:
        raise ValueError(f"x_quantized must be on x's device {x.device}, got {codes.device} and {scales.device}")
    return codes, scales


def _check_dropout(dropout):
    return _runtime.check_real("dropout", dropout, low=0.0, high=1.0, high_open=True, expected="a float in [0, 1)")


def _meta(names, checked, x, dropout, training):
    """One Meta for projections sharing an input: they must share the weight dtype and the LoRA dtype."""
    if not isinstance(training, bool):
        raise ValueError(f"training must be True or False, got {training!r}")
    autocast = _runtime.autocast_dtype(x.device)
    weight_dtypes = {t[0][0].dtype for t in checked}
    if len(weight_dtypes) > 1:
        raise ValueError(f"{', '.join(names)} weights must share a dtype, got {sorted(map(str, weight_dtypes))}")
    lora_dtypes = {t[0][1].dtype for t in checked if t[0][1] is not None}
    if len(lora_dtypes) > 1:
        raise ValueError(f"{', '.join(names)} adapters must share a dtype, got {sorted(map(str, lora_dtypes))}")
    compute = autocast or weight_dtypes.pop()
    lora = (autocast or lora_dtypes.pop()) if lora_dtypes else None
    p = dropout if training and lora is not None else 0.0
    return Meta(tuple(t[1] for t in checked), p, compute, lora, _runtime.backend(x.device))
