r"""DoRA (weight-decomposed LoRA) on the projections of one input, through the LoRA passes of :mod:`.passes` (the
gated MLP's DoRA node is :mod:`.dora_mlp`).

Forward (Liu et al. 2024, "DoRA", eq. 5 with section 4.3's detached norm; PEFT 0.21
``peft/tuners/lora/dora.py`` ``DoraLinearLayer.forward`` called from ``variants.py`` ``DoraLinearVariant.forward``),
x ``[N, in]``, frozen W ``[out, in]``, adapters A ``[r, in]``, B ``[out, r]``, scaling s, magnitude m ``[out]``:

    n_j = || W_j + s (B A)_j ||_2      (row j of W + s B A: one output feature; a constant for autograd)
    g   = m / n                         ``[out]``
    y   = g * (x W^T + s (x A^T) B^T) + b

PEFT writes it as ``base(x) + (g - 1) * (x W^T) + g * s * lora(x)`` with base(x) = x W^T + b (without dropout it
reuses the base output, less the bias); that is the expression above. PEFT detaches n (``weight_norm.detach()``),
so n gets no gradient: neither A, B nor W see a term through it.

Backward, with u = x W^T + s xa B^T ``[N, out]`` (the LoRA output before DoRA's scaling, saved), xa = x A^T, and
dY' = g * dY (each column j of dY scaled by g_j): y = g * u + b, so

    dm_j = sum_i dY_ij u_ij / n_j       db = sum over rows of dY
    dX, dA, dB, dW = LoRA's backward of u with dY' in place of dY (:mod:`.api`'s derivation):
    dX = dY' W + s (dY' B) A      dA = s (dY' B)^T x      dB = s dY'^T xa      dW = dY'^T x (full fine-tune only)

The norm without W + s B A. Expanding the square of row j,

    n_j^2 = ||W_j||^2 + 2 s W_j . (B A)_j + s^2 ||(B A)_j||^2
          = ||W_j||^2 + 2 s sum_r B_jr (W A^T)_jr + s^2 sum_r B_jr (B (A A^T))_jr

needs the row norms of W (one read of W, 16-bit rows upcast in bounded chunks; a frozen W's kept on the tensor
until its version or storage changes), the skinny product W A^T
``[out, r]`` (one more read of W: cuBLAS for an fp32 W; the split-K skinny kernel for a 16-bit W under fp32 adapters
on the Triton path, W read as stored) and the Gram matrix A A^T ``[r, r]``: O(out r) memory, no W + s B A (the
torch path, a CPU reference, casts a 16-bit W to the adapters' fp32 for W A^T: one transient copy). All in
fp32 and once per call (per forward, not per token): PEFT forms W + s B A in x's dtype (lora_A's: fp32 for PEFT's
fp32 adapters) and takes its norm; the expansion equals it in exact arithmetic and loses accuracy only where
W + s B A nearly cancels W (n_j << ||W_j||, which DoRA's init n = ||W|| keeps far away).

Dropout: PEFT's DoRA with dropout runs the frozen GEMM twice (on x for the base output and on the dropped x for the
(g - 1) term); :func:`dora_linear` has no dropout path and refuses ``dropout > 0`` in training (``leantune.patch``
keeps PEFT's forward there and says so).

Groups: ``lora_qkv`` with DoRA projections runs q/k/v in one node (:class:`DoraGroupFunction`): x saved once and
read once for the three xa's (the concatenated A's), one norm per projection, dX accumulated in one buffer.

Saved for backward: x, xa, u ``[N, out]`` in the compute dtype, g and n ``[out]`` in fp32. Dtypes are
:func:`leantune.ops.lora_linear`'s: u in the compute dtype c (the LoRA term added in promote(c, lora) and
rounded to c), y = g u + b evaluated in fp32 and rounded once to c. Under a 16-bit base that is one rounding (of u)
more than PEFT, which sums g z + g s lora + b in fp32 before its single cast.

What runs where (the column scalings are DoRA's only [N, out] passes besides the LoRA ones; ``torch.mul`` of a
16-bit tensor by an fp32 vector takes torch's non-vectorised mixed-dtype path, ~2.4x the bandwidth floor on the H200,
and was the largest item of the 8B profile: 736 calls, 90 ms a step). On the Triton path (``meta.impl``):

- forward (and each checkpoint recompute): y = g u + b is the epilogue of the Triton low-rank add that completes u
  (:func:`.kernels.lowrank_add_scale_triton`, u and y written in one pass from the rounded u) when the adapters'
  dtype is not the compute dtype (PEFT's fp32 adapters under a 16-bit base); with one dtype throughout, the add is
  cuBLAS's addmm and y one :func:`.column_kernels.column_scale` pass;
- backward with a trained magnitude: dY' = g dY and dm's sum in one read of dY and u
  (:func:`.column_kernels.scale_column_dot`, split-M fp32 partials summed by torch in a fixed order); a frozen magnitude
  needs dY' alone (:func:`.column_kernels.column_scale`).

Each forms the same fp32 value as torch's ``torch.mul`` / ``torch.addcmul(bias, u, g)`` (one FMA with a bias) and
rounds it once to nearest even. The torch path (the CPU reference) keeps those torch calls and dm in row chunks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _runtime
from ..fp8 import FP8Weight
from ..nf4 import NF4Weight
from .column_kernels import column_scale, scale_column_dot
from .entries import _check_dropout, _check_projection, _check_x, _meta, _no_autocast, _Proj
from .kernels import lowrank_add_scale_triton, skinny_matmul
from .passes import _lowrank_add, _skinny_ok, group_backward, group_forward

_CHUNK_ELEMENTS = 1 << 22  # fp32 temporaries of the norm and of dm are bounded to this many elements (16 MiB)
# ||W_j||^2 of a frozen weight, computed once and kept on the tensor as (version, data_ptr, [out] fp32): per call it
# cost two launches per 16 MiB chunk of W in every forward and every recompute (14336 x 4096: 28), for a constant.
# An attribute, not a weak dictionary: weakref keys compare tensors with ==, which is elementwise
_ROW_SUMSQ_ATTR = "_leantune_row_sumsq"


class DoraWeights(NamedTuple):
    """One DoRA projection: :class:`~leantune.ops.LoraWeights`'s fields plus ``magnitude [out]`` (PEFT's
    ``lora_magnitude_vector[name].weight``)."""

    weight: torch.Tensor
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float
    magnitude: torch.Tensor
    bias: torch.Tensor | None = None


def dora_weight_norm(weight, lora_A, lora_B, scaling, meta=None) -> torch.Tensor:
    """n = ||W + s B A|| per output row (fp32 ``[out]``, no gradient) by the expansion in this module's docstring:
    no ``[out, in]`` tensor W + s B A. ``meta`` (internal) picks the skinny kernel for W A^T on the Triton path."""
    with torch.no_grad():
        a = lora_A.float()
        if meta is not None and _skinny_ok(meta, weight.dtype) and weight.dtype != torch.float32:
            wa = skinny_matmul(weight, a.T, out_dtype=torch.float32)  # W read as stored, fp32 registers
        else:
            wa = weight.to(a.dtype) @ a.T
        b = lora_B.float()
        w2 = _row_sumsq(weight)
        cross = (b * wa).sum(1)
        low = (b @ (a @ a.T) * b).sum(1)  # ||(B A)_j||^2 = B_j (A A^T) B_j^T
        n2 = w2 + (2.0 * scaling) * cross + (scaling * scaling) * low
        return n2.clamp_min(0.0).sqrt()


def _chunk_rows(width: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, width))


def _row_sumsq(weight) -> torch.Tensor:
    """||W_j||^2 per row in fp32 ``[out]``; a 16-bit W is upcast in row chunks (no fp32 copy of all of W). A frozen
    W's (no requires_grad) is kept and reused while its version counter and storage stay the same (an in-place
    change or a move recomputes it); not under torch.compile's tracing."""
    frozen = not weight.requires_grad and not torch.compiler.is_compiling()
    if frozen:
        kept = getattr(weight, _ROW_SUMSQ_ATTR, None)
        if kept is not None and kept[0] == weight._version and kept[1] == weight.data_ptr():
            return kept[2]
    if weight.dtype == torch.float32:
        sumsq = torch.linalg.vector_norm(weight, dim=1).square()
    else:
        step = _chunk_rows(weight.shape[1])
        sumsq = torch.cat([torch.linalg.vector_norm(weight[i:i + step].float(), dim=1).square()
                           for i in range(0, weight.shape[0], step)])
    if frozen:
        setattr(weight, _ROW_SUMSQ_ATTR, (weight._version, weight.data_ptr(), sumsq))
    return sumsq


def _rowdot(dy, u) -> torch.Tensor:
    """sum_i dy_ij u_ij in fp32 ``[out]`` on the torch path, in row chunks (bounded fp32 temporary). The Triton path
    forms it inside :func:`.column_kernels.scale_column_dot` with dY' (a DoRA backward always needs both)."""
    if dy.dtype == u.dtype == torch.float32:
        return (dy * u).sum(0)
    total = torch.zeros(dy.shape[1], dtype=torch.float32, device=dy.device)
    step = _chunk_rows(dy.shape[1])
    for start in range(0, dy.shape[0], step):
        total += (dy[start:start + step].float() * u[start:start + step].float()).sum(0)
    return total


def _scale_columns(u, scale, bias, dtype, meta, out=None) -> torch.Tensor:
    """y = g * u + b (``scale`` g fp32 ``[out]``, bias ``[out]`` or None) evaluated in fp32 and rounded once to
    ``dtype``, into ``out`` (u itself allowed) or a new buffer: DoRA's output and dY' = g * dY. On the Triton path
    one kernel (:func:`.column_kernels.column_scale`: the same values as the torch chain, vectorised where torch's
    mixed-dtype mul takes its scalar cast path), else ``torch.mul`` / ``torch.addcmul``."""
    if meta.impl == "triton":
        return column_scale(u, scale, bias, out=out, out_dtype=dtype)
    y = torch.empty(u.shape, dtype=dtype, device=u.device) if out is None else out
    return torch.mul(u, scale, out=y) if bias is None else torch.addcmul(bias, u, scale, out=y)


def _dora_output(u, xa, lora_B, scaling, scale, bias, meta):
    """(u, y) for a DoRA projection whose frozen output ``u`` group_forward left without the low-rank term
    (``add_lowrank`` False for it): u += s xa B^T in place (the compute dtype, as group_forward would) and
    y = g * u + b (:func:`_scale_columns`' values). Where the low-rank add is a Triton kernel (adapters in another
    dtype than the compute dtype: PEFT's fp32 adapters under a 16-bit base) its epilogue writes y as well
    (:func:`.kernels.lowrank_add_scale_triton`: u and y in one pass, no second read of u); otherwise
    :func:`.passes._lowrank_add` (one cuBLAS addmm when all dtypes agree) and then :func:`_scale_columns`."""
    cdt, rhs = meta.compute_dtype, lora_B.to(meta.lora_dtype).T
    if meta.impl == "triton" and not u.dtype == xa.dtype == cdt:  # _lowrank_add's Triton case
        return lowrank_add_scale_triton(u, xa, rhs, scaling, cdt, scale, bias)
    u, _ = _lowrank_add(u, xa, rhs, scaling, cdt, meta.impl)
    return u, _scale_columns(u, scale, bias, cdt, meta)


def _scale_grad(dy, u, scale, norm, need_m, dtype, meta, out=None):
    """(dY' = g * dY rounded once to ``dtype``, into ``out`` (dY itself allowed) or a new buffer; dm's fp32
    sum_i dY_ij u_ij / n_j, or None without ``need_m``). On the Triton path with dm one kernel reads dY and u once
    for both (:func:`.column_kernels.scale_column_dot`); the sum is formed before dY is overwritten either way."""
    if need_m and meta.impl == "triton":
        scaled, dot = scale_column_dot(dy, u, scale, out=out, out_dtype=dtype)
        return scaled, dot / norm
    dm = _rowdot(dy, u) / norm if need_m else None
    return _scale_columns(dy, scale, None, dtype, meta, out), dm


class DoraGroupFunction(torch.autograd.Function):
    """Autograd node of :func:`dora_linear` and of :func:`~leantune.ops.lora_qkv` with DoRA projections: the
    projections of one x, 5 tensors each (weight, lora_A, lora_B, magnitude, bias; magnitude None: a plain LoRA or
    frozen projection, y = u + b). Saves x once, every xa, and per DoRA projection u, g and n (module docstring)."""

    @staticmethod
    def forward(ctx, meta, x, *tensors):
        x2d = _runtime.as_rows(x)
        entries = [tensors[j:j + 5] for j in range(0, len(tensors), 5)]
        projs = [_Proj(weight, lora_A, lora_B, None) for weight, lora_A, lora_B, _, _ in entries]
        ys, saved = [], []
        with _no_autocast(x.device):
            # the DoRA projections' low-rank terms are left out here: _dora_output adds them with the scaling fused
            us, xas = group_forward(x2d, projs, meta, None, 0, add_lowrank=[e[3] is None for e in entries])
            for j, ((weight, lora_A, lora_B, magnitude, bias), u) in enumerate(zip(entries, us)):
                if magnitude is None:
                    ys.append(u if bias is None else u.add_(bias.to(u.dtype)))
                    saved += [None, None, None]
                    continue
                norm = dora_weight_norm(weight, lora_A, lora_B, meta.scalings[j], meta)
                scale = magnitude.detach().float() / norm
                # g * u + b evaluated in fp32 (g is fp32) and rounded once on the store: no temporary
                u, y = _dora_output(u, xas[j], lora_B, meta.scalings[j], scale, bias, meta)
                ys.append(y)
                saved += [u, scale, norm]
        ctx.save_for_backward(x2d, *tensors, *xas, *saved)
        ctx.meta, ctx.x_shape, ctx.count = meta, x.shape, len(entries)
        return tuple(_runtime.distinct_output(y.view(*x.shape[:-1], y.shape[-1])) for y in ys)

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, *dys):
        x2d, *rest = ctx.saved_tensors
        count, meta = ctx.count, ctx.meta
        entries = [rest[j:j + 5] for j in range(0, 5 * count, 5)]
        xas = rest[5 * count:6 * count]
        saved = [rest[6 * count + 3 * j:6 * count + 3 * j + 3] for j in range(count)]
        need_x, *flags = ctx.needs_input_grad[1:]
        grads_out, scaled, needs = [], [], []
        with _no_autocast(x2d.device):
            for j, (dy, (_, _, _, magnitude, bias), (u, scale, norm)) in enumerate(zip(dys, entries, saved)):
                need_w, need_a, need_b, need_m, need_bias = flags[5 * j:5 * j + 5]
                dy2 = _runtime.as_rows(dy)
                dbias = dy2.float().sum(0).to(bias.dtype) if need_bias else None
                dm = None
                if magnitude is None:
                    scaled.append(dy2)
                else:  # dY' = g * dY, formed in fp32 and rounded once to the compute dtype (a new buffer: dY is
                    # autograd's), and dm
                    dy_scaled, dm = _scale_grad(dy2, u, scale, norm, need_m, meta.compute_dtype, meta)
                    scaled.append(dy_scaled)
                    dm = None if dm is None else dm.to(magnitude.dtype)
                grads_out.append((dm, dbias))
                needs.append(_Proj(need_w, need_a, need_b, False))
            projs = [_Proj(weight, lora_A, lora_B, None) for weight, lora_A, lora_B, _, _ in entries]
            dx, grads = group_backward(scaled, x2d, xas, projs, meta, None, 0, need_x, needs)
        flat = [t for g, (dm, dbias) in zip(grads, grads_out) for t in (g.weight, g.lora_A, g.lora_B, dm, dbias)]
        return (None, None if dx is None else dx.view(ctx.x_shape), *flat)


def _check_entry(name, proj, in_features, device):
    """(weight, lora_A, lora_B, magnitude, bias), scaling for one projection of a DoRA group: a DoraWeights, or a
    LoraWeights / 5-tuple (no magnitude: LoRA or plain frozen, as :func:`~leantune.ops.lora_linear`)."""
    magnitude = None
    if isinstance(proj, DoraWeights):
        magnitude = proj.magnitude
        proj = (proj.weight, proj.lora_A, proj.lora_B, proj.scaling, proj.bias)
    (weight, lora_A, lora_B, bias), scaling = _check_projection(name, proj, in_features, device)
    if isinstance(weight, (NF4Weight, FP8Weight)):  # the DoRA nodes read dense weights only
        raise ValueError(f"{name}weight must be a dense tensor in a DoRA call (an NF4Weight or FP8Weight is not "
                         "supported: the norm ||W + s B A|| reads W)")
    if magnitude is not None:
        if lora_A is None:
            raise ValueError(f"{name}lora_A and {name}lora_B must be tensors for DoRA (DoRA needs an adapter)")
        _runtime.check_tensor(f"{name}magnitude", magnitude)
        _runtime.check_shape(f"{name}magnitude", magnitude, (weight.shape[0],), "[out] with out = weight's rows")
        if magnitude.device != device:
            raise ValueError(f"all tensors must be on one device: x on {device}, {name}magnitude on "
                             f"{magnitude.device}")
    return (weight, lora_A, lora_B, magnitude, bias), scaling


def dora_group(x, named, dropout, training):
    """The outputs of the projections ``named`` ((name prefix, DoraWeights / LoraWeights), ...) of one x through
    :class:`DoraGroupFunction`: checks as :func:`dora_linear`'s."""
    _check_x(x)
    p = _check_dropout(dropout)
    checked = [_check_entry(name, proj, x.shape[-1], x.device) for name, proj in named]
    lora_view = [((w, a, b, bias), s) for (w, a, b, _, bias), s in checked]
    meta = _meta([name.rstrip(".") or "the" for name, _ in named], lora_view, x, p, training)
    if meta.p > 0:
        raise ValueError(f"dropout must be 0 when training for DoRA (got {p}): DoRA with dropout needs the frozen "
                         "GEMM on the dropped input as well, which is not fused")
    flat = [t for entry, _ in checked for t in entry]
    return DoraGroupFunction.apply(meta, x, *flat)


def dora_linear(x, weight, lora_A, lora_B, scaling, magnitude, bias=None, *, dropout=0.0, training=True):
    """y = (m / n) * (x W^T + s (x A^T) B^T) + b with n = ||W + s B A|| per output row, detached (PEFT's DoRA),
    with gradients for x, lora_A, lora_B, magnitude, bias (and W if it requires grad).

    Args:
        x: ``[..., in]`` float32/float16/bfloat16.
        weight: ``[out, in]`` frozen dense weight (not an NF4Weight).
        lora_A: ``[r, in]``, lora_B: ``[out, r]`` (PEFT layout, one dtype; required).
        scaling: s, a finite real number.
        magnitude: ``[out]`` float, DoRA's m (PEFT's ``lora_magnitude_vector``).
        bias: ``[out]`` or None.
        dropout, training: PEFT's ``lora_dropout``; only p = 0 or ``training=False`` (dropout inactive) is served.

    Returns:
        ``y [..., out]`` in the compute dtype (weight's, or autocast's), as :func:`~leantune.ops.lora_linear`.

    Raises:
        ValueError: :func:`~leantune.ops.lora_linear`'s cases (naming the argument), lora_A/lora_B None, an NF4
            weight, a magnitude that is not a float ``[out]`` tensor on x's device, dropout > 0 in training.

    Source: Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation" (eq. 5, section 4.3); PEFT 0.21
    ``DoraLinearLayer.forward``; the derivation is in this module's docstring.
    """
    return dora_group(x, [("", DoraWeights(weight, lora_A, lora_B, scaling, magnitude, bias))], dropout, training)[0]
