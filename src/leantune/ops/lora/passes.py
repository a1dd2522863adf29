r"""The LoRA forward and backward passes shared by the autograd nodes (derivation: :mod:`leantune.ops.lora.api`).

A group is the projections that read one input x (one for ``lora_linear``, q/k/v for ``lora_qkv``, gate/up or down
in ``lora_mlp``). :func:`group_forward` forms every output and xa = (m*x) A^T; :func:`group_backward` forms dX and
every weight, adapter and bias gradient a group's flags ask for. Frozen and LoRA matmuls go through torch (cuBLAS);
the Triton kernels of :mod:`.kernels` take the low-rank adds and, on the Triton path, the skinny products.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import _runtime
from ..fp8 import FP8Weight, fp8_grad_input, fp8_linear, quantize_rows
from ..fp8_group import fp8_grad_input_group, grouped_grad_input_ok
from .kernels import dropout_triton, lowrank_add_triton, skinny_matmul, skinny_tn


def _torch_mask(seed, shape, p, device):
    """The torch path's scaled mask for ``seed`` (a Python int or an int64 tensor on ``device``). On the CPU: a
    torch.Generator seeded with the seed (read through numpy, which refuses device tensors: never a sync; under
    torch.compile one opaque custom op, as dynamo cannot create a Generator). On any other device: the counter-based
    :func:`_hash_mask`, a pure function of the seed tensor, since seeding a Generator would read it back."""
    device = torch.device(device)
    if device.type != "cpu":
        return _hash_mask(seed, shape, p, device)
    if torch.compiler.is_compiling():
        return _torch_mask_op(torch.as_tensor(seed, dtype=torch.int64), list(shape), p)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if isinstance(seed, int) else int(seed.detach().numpy()))
    keep = torch.rand(shape, generator=generator, device=device) >= p
    return keep.to(torch.float32) * (1.0 / (1.0 - p))


@torch.library.custom_op("leantune::lora_dropout_mask", mutates_args=())
def _torch_mask_op(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    return _torch_mask(seed, shape, p, seed.device)


_torch_mask_op.register_fake(lambda seed, shape, p: seed.new_empty(shape, dtype=torch.float32))

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (splitmix64's increment)
_MIX = (-4658895280553007687, -7723592293110705685)  # 0xBF58476D1CE4E5B9, 0x94D049BB133111EB as int64


def _shr(x, bits: int):
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _hash_mask(seed, shape, p, device):
    """A scaled mask from splitmix64 (Steele et al. 2014) of seed * golden + element index, in wrapping int64 torch
    ops on the device, 24-bit uniforms: nothing is read back to the host, and torch.compile traces it."""
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device).reshape(())
    count = 1
    for n in shape:
        count *= n
    z = torch.arange(count, dtype=torch.int64, device=device) * _GOLDEN + (seed + 1) * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX[0]
    z = (z ^ _shr(z, 27)) * _MIX[1]
    z = z ^ _shr(z, 31)
    uniform = _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))
    keep = (uniform >= p).reshape(shape)
    return keep.to(torch.float32) * (1.0 / (1.0 - p))


def _dropout(x, seeds, index, p, impl, dtype):
    """m * x in ``dtype`` for the seed ``seeds[index]`` (the cast to the LoRA dtype rides along: one pass)."""
    if impl == "triton":
        return dropout_triton(x, seeds, index, p, dtype)
    return (x.float() * _torch_mask(seeds[index], x.shape, p, x.device)).to(dtype)


def _lowrank_add(base, lhs, rhs, scale, out_dtype, impl, seeds=None, index=0, p=0.0, x=None):
    """(cast(base + scale * m * (lhs @ rhs), out_dtype), m * x in lhs's dtype or None); in place into base when
    dtypes allow. lhs [N, R] and rhs [R, K] share one dtype (the LoRA dtype); the sum is formed in promote(base, lhs).
    """
    if seeds is None and x is None and base.dtype == lhs.dtype == out_dtype:
        return base.addmm_(lhs, rhs, alpha=scale), None  # one pass: the GEMM reads and writes base (beta = 1)
    if impl == "triton":
        return lowrank_add_triton(base, lhs, rhs, scale, out_dtype, seeds, index, p, x)
    wide = torch.promote_types(base.dtype, lhs.dtype)
    term = lhs @ rhs
    xd = None
    if seeds is not None:
        mask = _torch_mask(seeds[index], base.shape, p, base.device)
        term = (term.float() * mask).to(term.dtype)
        if x is not None:
            xd = (x.float() * mask).to(lhs.dtype)
    elif x is not None:
        xd = x.to(lhs.dtype)
    out = torch.add(base.to(wide), term.to(wide), alpha=scale).to(out_dtype)
    if out_dtype == base.dtype:
        return base.copy_(out), xd
    return out, xd


# ---------------------------------------------------------------------------------------------------- dropout API
def dropout_seeds(count: int, device) -> torch.Tensor:
    """The ``count`` dropout seeds an op draws in forward (int64 ``[count]`` on ``device``), one per LoRA projection
    in argument order (linear: 1; qkv: q, k, v; mlp: gate, up, down; projections without LoRA draw none). Drawn from
    torch's generator for ``device``, so resetting that generator's state replays an op's masks."""
    return torch.randint(0, 2**31 - 1, (count,), device=device, dtype=torch.int64)


def dropout_mask(seed, shape, p: float, device) -> torch.Tensor:
    """The scaled dropout mask m = keep / (1 - p) (float32 ``shape`` = ``[rows, in]`` of the projection's input as
    rows) that the current backend draws for ``seed`` (an int or a 1-element tensor)."""
    device = torch.device(device)
    rows, cols = shape
    if _runtime.backend(device) == "triton":
        seeds = torch.as_tensor(seed, dtype=torch.int64, device=device).reshape(1)
        ones = torch.ones((rows, cols), dtype=torch.float32, device=device)
        return dropout_triton(ones, seeds, 0, float(p), torch.float32)
    return _torch_mask(seed, (rows, cols), float(p), device)


# ------------------------------------------------------------------------------------------- shared group passes
class Meta(NamedTuple):
    """What the autograd nodes need besides tensors."""

    scalings: tuple  # per projection
    p: float  # 0.0 when no dropout is applied (p = 0 or not training)
    compute_dtype: torch.dtype  # frozen matmuls and outputs
    lora_dtype: torch.dtype | None  # LoRA branch
    impl: str


@dataclasses.dataclass
class ProjGrads:
    """One projection's gradients, filled in as :func:`group_backward` forms them (None: not wanted); iterates in
    the autograd nodes' argument order."""

    weight: torch.Tensor | None = None
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def __iter__(self):
        return iter((self.weight, self.lora_A, self.lora_B, self.bias))


def _skinny_ok(meta, act_dtype):
    """Whether the Triton skinny kernels form the LoRA products of an activation stored in ``act_dtype``: on the
    Triton path when the upcast to the LoRA dtype is exact (one dtype, or PEFT's fp32 adapters under a 16-bit base),
    so reading the stored tile and upcasting in registers is the same product as ``act.to(lora_dtype)``."""
    return meta.impl == "triton" and (act_dtype == meta.lora_dtype or meta.lora_dtype == torch.float32)


def _cat_lora_A(projs, lora, ldt):
    """The lora_A of the projections ``lora`` stacked on the rank dim, in ``ldt``: x is read once for all of them."""
    if len(lora) == 1:
        return projs[lora[0]].lora_A.to(ldt)
    return torch.cat([projs[j].lora_A.to(ldt) for j in lora])


def group_forward(x2d, projs, meta, seeds, first_seed, add_lowrank=True, x_quantized=None, outputs=True):
    """Outputs ``[N, out_j]`` (compute dtype) and xa_j of the projections sharing ``x2d``; seeds[first_seed:] are
    theirs. ``add_lowrank=False`` leaves the s xa B^T terms out of the outputs (the caller fuses them); a sequence
    of bools, one per projection, leaves out those of the projections marked False. ``x_quantized``: ``(codes,
    scales)`` = ``quantize_rows(x2d)`` made by the kernel that wrote x2d, for the FP8 projections' GEMMs; used only
    when x2d is in the compute dtype (else the GEMM input is x2d cast, which is quantised here). ``outputs=False``:
    the xa_j alone (outputs None; no frozen GEMM, no low-rank add)."""
    cdt, ldt = meta.compute_dtype, meta.lora_dtype
    ys = (_frozen_forward(x2d.to(cdt), projs, cdt, x_quantized if x2d.dtype == cdt else None) if outputs
          else [None] * len(projs))
    lora = [j for j, (_, a, _, _) in enumerate(projs) if a is not None]
    xas = [None] * len(projs)
    if not lora:
        return ys, xas
    skinny = _skinny_ok(meta, x2d.dtype)
    if seeds is None:
        a_cat = _cat_lora_A(projs, lora, ldt)
        if skinny and x2d.dtype != ldt:  # x read as stored, upcast in registers: no [N, in] copy in ldt
            xa_cat = skinny_matmul(x2d, a_cat.T, out_dtype=ldt)
        else:
            xa_cat = x2d.to(ldt) @ a_cat.T  # x read once for every adapter of the group
        start = 0
        for j in lora:
            rank = projs[j].lora_A.shape[0]
            xas[j] = xa_cat[:, start:start + rank]
            start += rank
    else:
        for k, j in enumerate(lora):
            if skinny:  # mask applied in registers: no m*x buffer
                xas[j] = skinny_matmul(x2d, projs[j].lora_A.to(ldt).T, out_dtype=ldt, seeds=seeds,
                                        index=first_seed + k, p=meta.p)
            else:
                xas[j] = _dropout(x2d, seeds, first_seed + k, meta.p, meta.impl, ldt) @ projs[j].lora_A.to(ldt).T
    adds = [add_lowrank] * len(projs) if isinstance(add_lowrank, bool) else list(add_lowrank)
    for j in lora:
        if adds[j] and outputs:
            _lowrank_add(ys[j], xas[j], projs[j].lora_B.to(ldt).T, meta.scalings[j], cdt, meta.impl)
    return ys, xas


def group_backward(dys, x2d, xas, projs, meta, seeds, first_seed, need_x, proj_needs, dy_quantized=None):
    """(dx in x2d's dtype or None, a :class:`ProjGrads` per projection); ``need_x``: whether dx is wanted;
    ``proj_needs``: per projection its flags with fields ``weight``, ``lora_A``, ``lora_B``, ``bias``. The frozen
    terms first, then per adapter g = s dY B and dB, then dA and the low-rank part of dx: x read once for all
    adapters without dropout, per adapter mask with it. ``dy_quantized``: the dY's codes and scales for a grouped
    FP8 dX GEMM, made by the kernel that wrote them (:func:`_frozen_backward`)."""
    dys = [_runtime.as_rows(dy).to(meta.compute_dtype) for dy in dys]
    if not input_grad_separable(meta, x2d, seeds):  # dx's masked low-rank pass also writes m * x for dA
        dx, grads = _frozen_backward(dys, x2d, projs, meta.compute_dtype, need_x, proj_needs, dy_quantized)
        lora = [j for j, proj in enumerate(projs) if proj.lora_A is not None]
        gs, _ = _lora_g_and_dB(dys, x2d, xas, projs, meta, lora, False, proj_needs, grads)
        dx = _lora_dA_dx_dropout(dx, gs, x2d, projs, meta, lora, seeds, first_seed, need_x, proj_needs, grads)
        return (None if dx is None else dx.to(x2d.dtype)), grads
    grads, gs = group_param_grads(dys, x2d, xas, projs, meta, seeds, first_seed, proj_needs)
    dx = group_input_grad(dys, gs, projs, meta, seeds, first_seed, dy_quantized) if need_x else None
    return (None if dx is None else dx.to(x2d.dtype)), grads


def input_grad_separable(meta, x2d, seeds) -> bool:
    """Whether a group's parameter gradients can be formed before, and apart from, its dx (:func:`group_param_grads`
    then :func:`group_input_grad`), so that a caller can drop x in between and dx reuse its memory: always without
    dropout, and with it where the skinny kernels regenerate the mask (no m * x buffer shared by the two)."""
    return seeds is None or _skinny_ok(meta, x2d.dtype)


def group_param_grads(dys, x2d, xas, projs, meta, seeds, first_seed, proj_needs):
    """(a :class:`ProjGrads` per projection, the LoRA terms g for :func:`group_input_grad`): every gradient but dx,
    the last reads of x. ``dys`` in the compute dtype as rows; only where :func:`input_grad_separable`."""
    _, grads = _frozen_backward(dys, x2d, projs, meta.compute_dtype, False, proj_needs)
    lora = [j for j, proj in enumerate(projs) if proj.lora_A is not None]
    if not lora:
        return grads, None
    gs, g_cat = _lora_g_and_dB(dys, x2d, xas, projs, meta, lora, seeds is None, proj_needs, grads)
    if seeds is None:
        _lora_dA(g_cat, x2d, projs, meta, lora, proj_needs, grads)
    else:
        for k, j in enumerate(lora):
            if proj_needs[j].lora_A:
                grads[j].lora_A = skinny_tn(gs[j], x2d, out_dtype=projs[j].lora_A.dtype, seeds=seeds,
                                            index=first_seed + k, p=meta.p)
    return grads, (gs, g_cat)


def group_input_grad(dys, g_terms, projs, meta, seeds, first_seed, dy_quantized=None):
    """dx = sum_j dY_j W_j + the low-rank terms (m * (g_j A_j) with dropout) in the compute dtype; ``g_terms`` from
    :func:`group_param_grads`. Reads no x: a caller may have freed it, and the allocator hands its block to dx."""
    dx, _ = _frozen_backward(dys, None, projs, meta.compute_dtype, True, None, dy_quantized)
    if g_terms is None:
        return dx
    (gs, g_cat), ldt, cdt = g_terms, meta.lora_dtype, meta.compute_dtype
    lora = list(gs)
    if seeds is None:
        return _lowrank_add(dx, g_cat, _cat_lora_A(projs, lora, ldt), 1.0, cdt, meta.impl)[0]
    for k, j in enumerate(lora):
        dx, _ = _lowrank_add(dx, gs[j], projs[j].lora_A.to(ldt), 1.0, cdt, meta.impl, seeds, first_seed + k, meta.p)
    return dx


def _frozen_forward(xc, projs, cdt, x_quantized=None):
    """x W_j^T + b_j per projection in ``cdt``; an FP8Weight's GEMM runs in e4m3 (:func:`~leantune.ops.fp8.fp8_linear`)
    on x quantised once per row for every FP8 projection of the group: ``x_quantized`` when the producer of x wrote
    it (RMSNorm, the GLU), else a separate :func:`~leantune.ops.fp8.quantize_rows` pass here."""
    x_fp8 = None
    if any(isinstance(w, FP8Weight) for w, _, _, _ in projs):
        x_fp8 = quantize_rows(xc) if x_quantized is None else x_quantized
    return [fp8_linear(xc, w, b, out_dtype=cdt, x_quantized=x_fp8) if isinstance(w, FP8Weight)
            else F.linear(xc, w.to(cdt), None if b is None else b.to(cdt)) for w, _, _, b in projs]


def _frozen_backward(dys, x2d, projs, cdt, need_x, proj_needs, dy_quantized=None):
    """(dx = sum_j dY_j W_j or None, per projection ProjGrads(dW, None, None, db) as wanted (full fine-tune,
    biases)); ``proj_needs`` None: dx only (no x read). ``dy_quantized``: ``quantize_grad_outputs(dys, weights)``
    written by the dY's producer, used by the grouped FP8 dX GEMM (ignored where that GEMM does not run)."""
    dx = None
    weights = [proj.weight for proj in projs]
    if need_x and grouped_grad_input_ok(dys, weights):  # q/k/v, gate/up in FP8: one e4m3 GEMM over their dY's
        dx = fp8_grad_input_group(dys, weights, out_dtype=cdt, quantized=dy_quantized)
    elif need_x:
        for dy, proj in zip(dys, projs):
            if isinstance(proj.weight, FP8Weight):  # e4m3 dX GEMM: W's scales folded into dY
                term = fp8_grad_input(dy, proj.weight, out_dtype=cdt)
                dx = term if dx is None else dx.add_(term)
            else:
                dx = dy @ proj.weight.to(cdt) if dx is None else dx.addmm_(dy, proj.weight.to(cdt))
    grads = [ProjGrads() for _ in projs]
    if proj_needs is None:
        return dx, grads
    xc = x2d.to(cdt) if any(need.weight for need in proj_needs) else None
    for j, (proj, dy, need) in enumerate(zip(projs, dys, proj_needs)):
        if need.weight:
            grads[j].weight = (dy.T @ xc).to(proj.weight.dtype)
        if need.bias:
            grads[j].bias = dy.sum(0).to(proj.bias.dtype)
    return dx, grads


def _lora_g_and_dB(dys, x2d, xas, projs, meta, lora, stack, proj_needs, grads):
    """g_j = s_j dY_j B_j [N, r_j] per adapter ({j: g_j}) and dB_j = s_j dY_j^T xa_j into ``grads``; with ``stack``
    (no dropout) also g_cat [N, sum r], the g's side by side for the one dA product (None otherwise), each g written
    into its g_cat columns directly. The skinny path reads dY as stored (no [N, out] copy in the LoRA dtype); the
    cuBLAS path scales inside the matmul (:func:`_scaled_product`)."""
    ldt = meta.lora_dtype
    skinny_dy = _skinny_ok(meta, meta.compute_dtype) and meta.compute_dtype != ldt
    g_cat = None
    if stack and len(lora) > 1:
        g_cat = _runtime.empty((x2d.shape[0], sum(projs[j].lora_A.shape[0] for j in lora)), dtype=ldt,
                               device=x2d.device)
    gs, g_col = {}, 0
    for j in lora:
        lora_B, rank, scaling = projs[j].lora_B, projs[j].lora_A.shape[0], meta.scalings[j]
        g_cols = None if g_cat is None else g_cat[:, g_col:g_col + rank]
        g_col += rank
        if skinny_dy:
            gs[j] = skinny_matmul(dys[j], lora_B.to(ldt), scaling, out=g_cols, out_dtype=ldt)
            if proj_needs[j].lora_B:  # dB written as [out, r] through a transposed view
                d_b = _runtime.empty(lora_B.shape, dtype=lora_B.dtype, device=lora_B.device)
                grads[j].lora_B = d_b
                skinny_tn(xas[j], dys[j], scaling, out=d_b.T)
            continue
        dyl = dys[j].to(ldt)
        gs[j] = _scaled_product(dyl, lora_B.to(ldt), scaling, out=g_cols)
        if proj_needs[j].lora_B:
            grads[j].lora_B = _scaled_product(dyl.T, xas[j], scaling).to(lora_B.dtype)
    if stack and g_cat is None:
        g_cat = gs[lora[0]]
    return gs, g_cat


def _scaled_product(a, b, scale, *, out=None):
    """scale * (a @ b) in one matmul (alpha = scale and beta = 0: out's contents are ignored, NaN included); one
    rounding, and on the GPU one launch instead of a matmul and a scaling pass. ``out`` may be a column slice."""
    if out is None:
        out = _runtime.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    if not out.is_contiguous() and torch.compiler.is_compiling():  # dynamo refuses a strided out=
        return out.copy_(torch.addmm(out, a, b, beta=0, alpha=scale))
    return torch.addmm(out, a, b, beta=0, alpha=scale, out=out)


def _lora_dA(g_cat, x2d, projs, meta, lora, proj_needs, grads):
    """No dropout: dA_cat = g_cat^T x (x read once for every adapter, as stored on the skinny path) split into
    ``grads``."""
    ldt = meta.lora_dtype
    if not any(proj_needs[j].lora_A for j in lora):
        return
    if _skinny_ok(meta, x2d.dtype) and x2d.dtype != ldt:
        da_cat = skinny_tn(g_cat, x2d, out_dtype=ldt)
    else:
        da_cat = g_cat.T @ x2d.to(ldt)
    start = 0
    for j in lora:
        rank = projs[j].lora_A.shape[0]
        if proj_needs[j].lora_A:
            grads[j].lora_A = da_cat[start:start + rank].to(projs[j].lora_A.dtype)
        start += rank


def _lora_dA_dx_dropout(dx, gs, x2d, projs, meta, lora, seeds, first_seed, need_x, proj_needs, grads):
    """With dropout, per adapter j (mask of seeds[first_seed + k]): dA_j = g_j^T (m * x) into ``grads``; returns
    dx + sum_j m * (g_j A_j). The skinny kernels regenerate the mask in registers (no m * x buffer); otherwise one
    low-rank pass adds to dx and writes m * x for dA, the mask drawn once."""
    ldt, cdt = meta.lora_dtype, meta.compute_dtype
    skinny_x = _skinny_ok(meta, x2d.dtype)
    for k, j in enumerate(lora):
        lora_A, index = projs[j].lora_A, first_seed + k
        if skinny_x:
            if need_x:
                dx, _ = _lowrank_add(dx, gs[j], lora_A.to(ldt), 1.0, cdt, meta.impl, seeds, index, meta.p)
            if proj_needs[j].lora_A:
                grads[j].lora_A = skinny_tn(gs[j], x2d, out_dtype=lora_A.dtype, seeds=seeds, index=index, p=meta.p)
            continue
        if need_x:
            dx, xd = _lowrank_add(dx, gs[j], lora_A.to(ldt), 1.0, cdt, meta.impl, seeds, index, meta.p, x2d)
        else:
            xd = _dropout(x2d, seeds, index, meta.p, meta.impl, ldt)
        if proj_needs[j].lora_A:
            grads[j].lora_A = (gs[j].T @ xd).to(lora_A.dtype)
    return dx
