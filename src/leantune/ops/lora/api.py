r"""LoRA projections with hand-derived backward: one linear, the q/k/v triple of one input, and the gated MLP.

Forward (Hu et al. 2021, "LoRA"; PEFT ``peft/tuners/lora/layer.py`` ``Linear.forward``), x ``[N, in]``, frozen
W ``[out, in]``, adapters A ``[r, in]``, B ``[out, r]``, scaling s, dropout mask m = keep / (1 - p):

    y = x W^T + b + s ((m*x) A^T) B^T                      (m = 1 when p = 0 or not training)

Backward, with xa = (m*x) A^T ``[N, r]`` and g = s (dY B) ``[N, r]``:

    dX = dY W + m * (g A)          dA = g^T (m*x)          dB = s dY^T xa
    db = sum over rows of dY       dW = dY^T x             (only when W requires grad: full fine-tune)

Saved for backward: x and xa (``[N, r]``, small). m*x is not saved: the mask is regenerated from a per-projection
seed (drawn from torch's generator for x's device, so checkpoint recomputation, which restores the RNG state, draws
the same one) and applied again in backward. All backward needs goes through ``ctx.save_for_backward``.

Dtypes (PEFT's behaviour): the frozen matmul runs in the compute dtype c = W's dtype (x cast to it), or autocast's
dtype under ``torch.autocast``; the LoRA branch runs in l = lora_A's dtype (autocast's under autocast); the sum is
formed in promote(c, l) and cast once to c, the base output's dtype (PEFT's ``result.to(torch_result_dtype)``).
Gradients come back in their inputs' dtypes.

Groups. ``lora_qkv`` runs q, k, v off one x in one autograd node: x is saved once; without dropout the three A's are
concatenated (a copy of ``3 r in`` elements, free next to x) so x is read once for xa, and once for dA; dX is one
buffer that every frozen and LoRA term is accumulated into (``addmm_`` with beta = 1).

``lora_mlp``: y = down(act(gate(x)) * up(x)) with each projection a LoRA linear (HF LlamaMLP/GemmaMLP with PEFT on
all three). It saves x and the gate and up outputs (plus the ``[N, r]`` xa's) but not h = act(gate) * up: backward
recomputes h (needed for down's dA and dW), forms dh = dY W_down + m*(g_down A_down), and the GLU backward writes
d_gate, d_up into the saved gate/up buffers (this node owns them). Saved bytes N (H + 2I) elt + O(N r) against
PEFT's N (H + 4I) elt (it also keeps act(gate) and h).

Passes. Frozen and LoRA matmuls go through torch (cuBLAS). When the LoRA branch has the base's dtype and there is no
dropout, the B term is added into the base output inside the GEMM (``addmm_``, beta = 1, alpha = s): one pass.
Otherwise one Triton kernel (``kernels._lowrank_add_kernel``) forms base + s * m * (P @ Q) for the small rank-R
product in fp32 registers, casts once and stores in place (in backward it also writes m*x for dA, so the mask is
generated once per pass); ``kernels._dropout_kernel`` applies the mask in forward. Masks are
``tl.rand(seed, row * width + col)`` on the Triton path and ``torch.rand`` with a seeded ``torch.Generator`` on the
torch path (the two differ, as docs/design.md, "Backends" allows).

Skinny products (Triton path). With PEFT's fp32 adapters under a bf16/fp16 base, xa = x A^T, g = s dY B,
dA = g^T (m*x) and dB = s dY^T xa would need fp32 copies of x (or h) and of every dY ([N, in], [N, out]: the bulk of
the LoRA branch's traffic). ``kernels._skinny_matmul_kernel`` (C[M, r] = A[M, K] @ B[K, r], split-K) and
``kernels._skinny_tn_kernel`` (C[r, K] = P[M, r]^T @ X[M, K], split-M) read the activation tile as stored and form the
product in fp32 registers: bf16 x fp32 as three bf16 tensor-core dots against an exact three-way bf16 split of the
fp32 factor (every bf16 product is exact in fp32, accumulation is fp32), fp16/fp32 x fp32 as an IEEE fp32 dot;
``precision="ieee"`` forces the latter. Partials of the splits are summed by torch in a fixed order (deterministic).
They also take dropout: the mask is regenerated in registers from the seed and applied as a 0/1 product (as
PEFT's dropout multiplies: a NaN/inf input element stays non-finite where dropped), so m*x is never stored. Used
where the upcast to the LoRA dtype is exact (one dtype, or fp32 adapters); otherwise (autocast to bf16 from fp32
inputs) the LoRA branch rounds its inputs first, as autocast does, through torch.

GLU fusion (Triton path, gate and up both with adapters): the B terms of gate and up are added inside the GLU
forward pass (:func:`leantune.ops.lora.glu_lowrank.glu_forward_lowrank`), which writes the summed gate/up in place
(saved for backward) and h from them, instead of a low-rank add over each [N, I] output followed by a GLU pass.
"""

from __future__ import annotations

import os

import torch

from .. import _runtime, fp8_group
from ..fp8 import E4M3, FP8Weight, fp8_gemms
from ..glu import ACTIVATIONS, glu_backward, glu_forward
from ..glu_fp8 import glu_backward_fp8
from ..nf4 import NF4Weight, dequantize_nf4
from ..nf4_fp8 import dequantize_nf4_fp8
from .entries import (
    LoraWeights,
    _check_dropout,
    _check_projection,
    _check_x,
    _check_x_quantized,
    _meta,
    _no_autocast,
    _Proj,
)
from .glu_lowrank import glu_forward_lowrank
from .passes import (
    dropout_seeds,
    group_backward,
    group_forward,
    group_input_grad,
    group_param_grads,
    input_grad_separable,
)

# ---------------------------------------------------------------------------------------------- NF4 frozen weights
# A frozen weight may come as an NF4Weight (QLoRA): the node dequantises it into a reusable workspace right before
# the frozen GEMM in forward, and again before dX in backward; the 4-bit codes, never the dequantised weight, are
# what the node keeps (docs/design.md, "NF4 frozen weights").
_NF4_TENSORS = ("codes", "absmax_codes", "nested_absmax", "code", "nested_code")
_workspaces: dict[tuple, torch.Tensor] = {}


def _workspace(slot: int, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The buffer that weight ``slot`` of a node is dequantised into: allocated once per (slot, shape, dtype,
    device) and reused by every later call (the nodes run one after another, in stream order)."""
    key = (slot, tuple(shape), dtype, device)
    if key not in _workspaces:
        _workspaces[key] = _runtime.empty(shape, dtype=dtype, device=device)
    return _workspaces[key]


# An FP8Weight (:mod:`leantune.ops.fp8`) is kept the same way: its e4m3 tensor and scales, nothing dequantised. An
# NF4Weight with FP8 compute (``fp8_scale``) is dequantised straight to e4m3 codes in an e4m3 workspace (1 B a weight)
# and then runs as that FP8Weight.
_QUANTIZED = (NF4Weight, FP8Weight)
_FP8_TENSORS = ("qweight", "scale")


def _split_nf4(projs):
    """(the quantised weights' tensors, in order, for save_for_backward; per quantised projection (index, the
    tensors' field names, the other fields))."""
    tensors, fields = [], []
    for j, proj in enumerate(projs):
        w = proj.weight
        if isinstance(w, NF4Weight):
            names = _NF4_TENSORS + (("fp8_scale",) if w.fp8_scale is not None else ())
            fields.append((j, names, w.offset, w.shape, w.dtype, w.name))
        elif isinstance(w, FP8Weight):
            names = _FP8_TENSORS
            fields.append((j, names, None, w.shape, w.dtype, w.name))
        else:
            continue
        tensors += [getattr(w, f) for f in names]
    return tensors, fields


def _n_saved(fields):
    """How many saved tensors :func:`_split_nf4`'s ``fields`` stand for."""
    return sum(len(names) for _, names, _, _, _, _ in fields)


def _join_nf4(projs, tensors, fields):
    """``projs`` with the quantised weights rebuilt from what :func:`_split_nf4` gave."""
    projs, start = list(projs), 0
    for j, names, offset, shape, dtype, name in fields:
        parts = dict(zip(names, tensors[start:start + len(names)]))
        start += len(names)
        weight = FP8Weight(dtype=dtype, name=name, **parts) if names is _FP8_TENSORS else \
            NF4Weight(offset=offset, shape=shape, dtype=dtype, name=name, **parts)
        projs[j] = projs[j]._replace(weight=weight)
    return projs


def _dequantized(projs, dtype: torch.dtype, first_slot: int = 0):
    """``projs`` with every NF4 weight replaced by its dequantised copy in its workspace: in ``dtype``, or (FP8
    compute) an FP8Weight whose e4m3 codes fill an e4m3 workspace."""
    out = list(projs)
    for j, proj in enumerate(projs):
        w = proj.weight
        if isinstance(w, NF4Weight) and w.fp8_scale is not None:
            out[j] = proj._replace(weight=dequantize_nf4_fp8(w, out=_workspace(first_slot + j, w.shape, E4M3,
                                                                               w.device)))
        elif isinstance(w, NF4Weight):
            out[j] = proj._replace(weight=dequantize_nf4(w, out=_workspace(first_slot + j, w.shape, dtype, w.device)))
    return out


# LEANTUNE_FP8_FUSED_DY=0 (benchmarks): the gate/up dY's codes from a separate quantisation pass, for A/B timing
FUSED_GLU_GRAD_OUTPUT = os.environ.get("LEANTUNE_FP8_FUSED_DY", "1") != "0"


def _glu_dy_multipliers(gate_w, up_w, d_dtype, compute_dtype):
    """(m_gate, m_up), the gate and up weights' e4m3 scales, when the LoRA MLP's GLU backward writes the codes of
    [d_gate diag(m_gate), d_up diag(m_up)] for their grouped FP8 dX GEMM (:mod:`leantune.ops.glu_fp8`): both
    weights run their GEMMs in FP8 (FP8Weight, or NF4 with FP8 compute) and the dY's are stored in the compute
    dtype, as that GEMM reads them. Else None (then :func:`~leantune.ops.fp8_group.quantize_grad_outputs` runs
    inside the grouped dX, or the per-projection path)."""
    if not (FUSED_GLU_GRAD_OUTPUT and fp8_group.GROUPED_GRAD_INPUT) or d_dtype != compute_dtype:
        return None
    scales = [w.scale if isinstance(w, FP8Weight) else getattr(w, "fp8_scale", None) for w in (gate_w, up_w)]
    if any(s is None for s in scales) or gate_w.shape[1] != up_w.shape[1]:
        return None
    return scales


# ------------------------------------------------------------------------------------------------ autograd nodes
class LoraGroupFunction(torch.autograd.Function):
    """Autograd node of :func:`lora_linear` and :func:`lora_qkv`: projections of one x (4 tensors each).

    Saves x (as rows), every xa ``[N, r]`` and the dropout seeds; dtypes are resolved by the caller (autocast is
    applied through ``meta``, so the body runs with autocast off)."""

    @staticmethod
    def forward(ctx, meta, x, x_codes, x_scales, *tensors):
        x2d = _runtime.as_rows(x)
        x_quantized = None if x_codes is None else (x_codes, x_scales)
        count = len(tensors) // len(_Proj._fields)
        projs, _ = _Proj.unflatten(tensors, count)
        n_lora = sum(proj.lora_A is not None for proj in projs)
        seeds = dropout_seeds(n_lora, x.device) if meta.p > 0 and n_lora else None
        nf4_tensors, ctx.nf4 = _split_nf4(projs)
        with _no_autocast(x.device):
            ys, xas = group_forward(x2d, _dequantized(projs, meta.compute_dtype), meta, seeds, 0,
                                    x_quantized=x_quantized)
        plain = [None if isinstance(t, _QUANTIZED) else t for t in tensors]
        ctx.save_for_backward(x2d, seeds, *plain, *xas, *nf4_tensors)
        ctx.meta, ctx.count, ctx.x_shape = meta, count, x.shape
        return tuple(_runtime.distinct_output(y.view(*x.shape[:-1], y.shape[-1])) for y in ys)

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, *dys):
        x2d, seeds, *rest = ctx.saved_tensors
        n_nf4 = _n_saved(ctx.nf4)
        projs, xas = _Proj.unflatten(rest[:len(rest) - n_nf4], ctx.count)
        projs = _join_nf4(projs, rest[len(rest) - n_nf4:], ctx.nf4)
        need_x, flags = ctx.needs_input_grad[1], ctx.needs_input_grad[4:]  # meta, x, x's codes/scales, projections
        needs, _ = _Proj.unflatten(flags, ctx.count)
        with _no_autocast(x2d.device):
            projs = _dequantized(projs, ctx.meta.compute_dtype)
            dx, grads = group_backward(dys, x2d, xas, projs, ctx.meta, seeds, 0, need_x, needs)
        return (None, None if dx is None else dx.view(ctx.x_shape), None, None, *_Proj.flatten(grads))


class LoraMLPFunction(torch.autograd.Function):
    """Autograd node of :func:`lora_mlp`. Saves x (as rows), the gate and up outputs, the xa's and the seeds; h is
    recomputed in backward, dropped once the down projection's parameter gradients have read it (dh then takes its
    block: three [N, intermediate] buffers alive, not four), and the GLU backward overwrites the saved gate/up
    buffers with d_gate/d_up."""

    @staticmethod
    def forward(ctx, meta_gu, meta_down, activation, output, x, x_codes, x_scales, *tensors):
        x2d = _runtime.as_rows(x)
        x_quantized = None if x_codes is None else (x_codes, x_scales)
        (gate_p, up_p, down_p), _ = _Proj.unflatten(tensors, 3)
        n_gu_lora = sum(proj.lora_A is not None for proj in (gate_p, up_p))
        n_lora = n_gu_lora + (down_p.lora_A is not None)
        seeds = dropout_seeds(n_lora, x.device) if meta_gu.p > 0 and n_lora else None
        # Triton path with adapters on gate and up: their B terms are added inside the GLU pass (one pass over
        # gate/up instead of a low-rank add per projection and then the GLU)
        fuse = meta_gu.impl == "triton" and gate_p.lora_A is not None and up_p.lora_A is not None
        nf4_tensors, ctx.nf4 = _split_nf4([gate_p, up_p, down_p])
        with _no_autocast(x.device):
            gate_w, up_w = _dequantized([gate_p, up_p], meta_gu.compute_dtype)
            (gate, up), (xa_g, xa_u) = group_forward(x2d, [gate_w, up_w], meta_gu, seeds, 0, add_lowrank=not fuse,
                                                     x_quantized=x_quantized)
            # an FP8 down reading h as it is (h in its compute dtype): the GLU pass also writes h's e4m3 codes
            fp8_out = output and fp8_gemms(down_p.weight) and gate.dtype == meta_down.compute_dtype
            side = {"fp8_out": True} if fp8_out else {}
            if fuse:
                ldt = meta_gu.lora_dtype
                h = glu_forward_lowrank(gate, up, xa_g, gate_p.lora_B.to(ldt), meta_gu.scalings[0],
                                        xa_u, up_p.lora_B.to(ldt), meta_gu.scalings[1], activation, **side)
            else:
                h = glu_forward(gate, up, activation, **side)
            h, h_quantized = h if fp8_out else (h, None)
            down_w = _dequantized([down_p], meta_down.compute_dtype, first_slot=2) if output else [down_p]
            (y,), (xa_d,) = group_forward(h, down_w, meta_down, seeds, n_gu_lora, x_quantized=h_quantized,
                                          outputs=output)
        del h, h_quantized  # h recomputed in backward
        if y is None:  # output=False: the down projection's [N, H] is not formed (a recomputation discards it)
            y = torch.empty((x2d.shape[0], down_p.weight.shape[0]), dtype=meta_down.compute_dtype, device=x.device)
        plain = [None if isinstance(t, _QUANTIZED) else t for t in tensors]
        ctx.save_for_backward(x2d, gate, up, seeds, *plain, xa_g, xa_u, xa_d, *nf4_tensors)
        ctx.metas, ctx.activation, ctx.x_shape, ctx.n_gu_lora = (meta_gu, meta_down), activation, x.shape, n_gu_lora
        ctx.used = False
        return _runtime.distinct_output(y.view(*x.shape[:-1], y.shape[-1]))

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, dy):
        if not torch.compiler.is_compiling():  # traced, the overwrites are functionalised: no saved buffer changes
            if ctx.used:
                raise RuntimeError("lora_mlp's backward overwrites its saved activations and cannot run twice "
                                   "(retain_graph=True is not supported)")
            ctx.used = True
        x2d, gate, up, seeds, *rest = ctx.saved_tensors
        n_nf4 = _n_saved(ctx.nf4)
        projs, (xa_g, xa_u, xa_d) = _Proj.unflatten(rest[:len(rest) - n_nf4], 3)
        gate_p, up_p, down_p = _join_nf4(projs, rest[len(rest) - n_nf4:], ctx.nf4)
        meta_gu, meta_down = ctx.metas
        # after the metas, activation and output: x, its codes and scales, then the projections' tensors
        need_x, flags = ctx.needs_input_grad[4], ctx.needs_input_grad[7:]
        (gate_needs, up_needs, down_needs), _ = _Proj.unflatten(flags, 3)
        with _no_autocast(x2d.device):
            h = glu_forward(gate, up, ctx.activation)
            # dh is always needed: it feeds gate/up
            (down_p,) = _dequantized([down_p], meta_down.compute_dtype, first_slot=2)
            if input_grad_separable(meta_down, h, seeds):  # h dies before dh is allocated, which takes its block
                dys = [_runtime.as_rows(dy).to(meta_down.compute_dtype)]
                (down_grads,), g_terms = group_param_grads(dys, h, [xa_d], [down_p], meta_down, seeds, ctx.n_gu_lora,
                                                           [down_needs])
                del h
                dh = group_input_grad(dys, g_terms, [down_p], meta_down, seeds, ctx.n_gu_lora)
            else:
                dh, (down_grads,) = group_backward([dy], h, [xa_d], [down_p], meta_down, seeds, ctx.n_gu_lora, True,
                                                   [down_needs])
                del h
            multipliers = (_glu_dy_multipliers(gate_p.weight, up_p.weight, gate.dtype, meta_gu.compute_dtype)
                           if need_x else None)
            dy_quantized = None
            if multipliers is None:
                d_gate, d_up = glu_backward(dh.to(gate.dtype), gate, up, ctx.activation, inplace=True)
            else:  # the grouped FP8 dX's quantisation of [d_gate, d_up] done in the GLU pass
                d_gate, d_up, dy_quantized = glu_backward_fp8(dh.to(gate.dtype), gate, up, ctx.activation,
                                                              *multipliers, inplace=True)
            del dh
            gate_p, up_p = _dequantized([gate_p, up_p], meta_gu.compute_dtype)
            dx, gu_grads = group_backward([d_gate, d_up], x2d, [xa_g, xa_u], [gate_p, up_p], meta_gu, seeds, 0,
                                          need_x, [gate_needs, up_needs], dy_quantized)
        return (None, None, None, None, None if dx is None else dx.view(ctx.x_shape), None, None,
                *_Proj.flatten([*gu_grads, down_grads]))


# ------------------------------------------------------------------------------------------------------- API
def lora_linear(x, weight, lora_A, lora_B, scaling, bias=None, *, dropout=0.0, training=True, x_quantized=None):
    """y = x W^T + b + s ((m*x) A^T) B^T with gradients for x, lora_A, lora_B, bias (and W if it requires grad).

    Args:
        x: ``[..., in]`` float32/float16/bfloat16.
        weight: ``[out, in]`` frozen weight (a gradient is returned only when it requires grad).
        lora_A: ``[r, in]``, lora_B: ``[out, r]`` (PEFT layout, one dtype; both None: plain linear).
        scaling: s, a finite real number (alpha/r, rsLoRA alpha/sqrt(r), ...).
        bias: ``[out]`` or None.
        dropout: p in [0, 1) applied to the LoRA branch's input (PEFT's ``lora_dropout``); only when ``training``
            (a bool).
        x_quantized: ``(codes, scales)``: x already quantised per row, bit for bit ``fp8.quantize_rows`` of x as
            rows (codes ``float8_e4m3fn [rows, in]`` contiguous, scales fp32 ``[rows]``), as ``ops.rms_norm(...,
            fp8_out=True)`` writes it: the FP8 weights' GEMMs then read it instead of quantising x in a separate
            pass. Used only where x is in the compute dtype (else the GEMM input is x cast, quantised here) and
            ignored without an FP8 weight; not checked against x's values.

    Returns:
        ``y [..., out]`` in the compute dtype: weight's dtype, or autocast's under ``torch.autocast`` (PEFT/HF's).
        The frozen matmul runs in that dtype, the LoRA branch in lora_A's (autocast's), summed in the promoted dtype.

    Raises:
        ValueError: shapes that do not match or are empty (the message names the argument), non-float dtypes,
            lora_A/lora_B of different dtypes, tensors on different devices, dropout outside [0, 1), a scaling that
            is not a finite number, a training flag that is not a bool, an ``x_quantized`` that is not a pair of
            tensors of those shapes, dtypes and device.

    Source: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; PEFT
    ``peft/tuners/lora/layer.py`` ``Linear.forward``; the derivation is in this module's docstring.
    """
    return _lora_group(x, [("", LoraWeights(weight, lora_A, lora_B, scaling, bias))], dropout, training,
                       x_quantized)[0]


def _lora_group(x, named, dropout, training, x_quantized=None):
    _check_x(x)
    dropout = _check_dropout(dropout)
    x_codes, x_scales = _check_x_quantized(x_quantized, x)
    checked = [_check_projection(name, proj, x.shape[-1], x.device) for name, proj in named]
    meta = _meta([name.rstrip(".") or "the" for name, _ in named], checked, x, dropout, training)
    flat = _Proj.flatten(tensors for tensors, _ in checked)
    return LoraGroupFunction.apply(meta, x, x_codes, x_scales, *flat)


def lora_qkv(x, q, k, v, *, dropout=0.0, training=True, x_quantized=None):
    """The q, k, v projections of one x in one autograd node: ``(q_out, k_out, v_out)``.

    Args:
        x: ``[..., H]`` float32/float16/bfloat16.
        q, k, v: :class:`LoraWeights` with weights ``[out_j, H]`` of one dtype; adapters of one dtype (or None for a
            plain frozen projection); Qwen2-style biases allowed. Any of them may be a
            :class:`~leantune.ops.DoraWeights` (DoRA, :mod:`.dora`; then dropout must be inactive): each output is
            then :func:`~leantune.ops.dora_linear`'s (or lora_linear's for the others), still in one node.
        dropout, training: as :func:`lora_linear`; one independent mask per projection (seeds in order q, k, v).
        x_quantized: as :func:`lora_linear`, for the three GEMMs (ignored by the DoRA node, which quantises x
            itself).

    Returns:
        ``q_out [..., out_q]``, ``k_out [..., out_k]``, ``v_out [..., out_v]``, each exactly :func:`lora_linear`'s
        value for that projection. x is saved once and dX accumulates in one buffer.

    Raises:
        ValueError: as :func:`lora_linear` (naming ``q.weight``, ``k.lora_A``, ...), and q/k/v weights or adapters
            of different dtypes.

    Source: three PEFT ``lora.Linear.forward`` calls on one input (HF attention's q/k/v projections).
    """
    named = [("q.", q), ("k.", k), ("v.", v)]
    from .dora import DoraWeights, dora_group  # .dora builds on this module: imported at call time

    if any(isinstance(proj, DoraWeights) for _, proj in named):
        _check_x_quantized(x_quantized, x)
        return tuple(dora_group(x, named, dropout, training))
    return tuple(_lora_group(x, named, dropout, training, x_quantized))


def lora_mlp(x, gate, up, down, *, activation="swiglu", dropout=0.0, training=True, x_quantized=None,
             output=True):
    """y = down(act(gate(x)) * up(x)), each projection a LoRA linear (HF LlamaMLP / GemmaMLP under PEFT).

    Args:
        x: ``[..., H]`` float32/float16/bfloat16.
        gate, up: :class:`LoraWeights` with weights ``[I, H]``; down: weights ``[H_out, I]``. Any of them may be a
            :class:`~leantune.ops.DoraWeights` (DoRA: :mod:`.dora_mlp`'s node; dropout must then be inactive).
        activation: ``"swiglu"`` (silu, Llama/Qwen/Mistral), ``"geglu_tanh"`` (gelu tanh, Gemma),
            ``"geglu_erf"`` (exact gelu).
        dropout, training: as :func:`lora_linear`; one mask per projection (seeds in order gate, up, down).
        x_quantized: as :func:`lora_linear`, for gate/up (ignored by the DoRA node). An FP8 down weight reads
            h's codes from the GLU pass that writes h (:mod:`leantune.ops.glu`, "FP8 side output"): no separate
            quantisation pass over h either.
        output: False for a recomputation whose result is thrown away (activation checkpointing): everything the
            backward reads is formed and saved as with True, but not the down projection's output (its frozen
            GEMM and low-rank add are skipped); y is then an uninitialised tensor of its shape and dtype.
            Ignored by the DoRA node.

    Returns:
        ``y [..., H_out]`` in down's compute dtype. Saves x, gate and up outputs and ``[N, r]`` terms only.

    Raises:
        ValueError: shape mismatches (naming e.g. ``down.weight``), dtypes, devices, unknown activation, dropout
            outside [0, 1), a scaling that is not a finite number, a training flag that is not a bool.
        RuntimeError: a second backward through one forward (``retain_graph=True``): the backward overwrites the
            saved gate/up outputs with their gradients, which is how the block saves no extra [N, I] buffer.

    Source: HF ``LlamaMLP.forward`` / ``GemmaMLP.forward`` with PEFT ``lora.Linear`` projections; the GLU backward
    is :mod:`leantune.ops.glu`'s.
    """
    _check_x(x)
    dropout = _check_dropout(dropout)
    x_codes, x_scales = _check_x_quantized(x_quantized, x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    from .dora import DoraWeights  # .dora builds on this module: imported at call time
    from .dora_mlp import dora_mlp

    if any(isinstance(proj, DoraWeights) for proj in (gate, up, down)):
        return dora_mlp(x, gate, up, down, activation, dropout, training)
    gu = [_check_projection(name, proj, x.shape[-1], x.device) for name, proj in (("gate.", gate), ("up.", up))]
    if gu[0][0][0].shape[0] != gu[1][0][0].shape[0]:
        raise ValueError(f"gate.weight and up.weight must have the same rows (intermediate size), got "
                         f"{gu[0][0][0].shape[0]} and {gu[1][0][0].shape[0]}")
    dn = [_check_projection("down.", down, gu[0][0][0].shape[0], x.device)]
    meta_gu = _meta(["gate", "up"], gu, x, dropout, training)
    meta_down = _meta(["down"], dn, x, dropout, training)
    if meta_gu.p != meta_down.p:  # one of the groups has no adapters: one dropout flag for the whole node
        p = max(meta_gu.p, meta_down.p)
        meta_gu, meta_down = meta_gu._replace(p=p), meta_down._replace(p=p)
    flat = _Proj.flatten(tensors for tensors, _ in (*gu, *dn))
    if not isinstance(output, bool):
        raise ValueError(f"output must be True or False, got {output!r}")
    return LoraMLPFunction.apply(meta_gu, meta_down, activation, output, x, x_codes, x_scales, *flat)
