r"""The LoRA MLP's forward pass: the gate/up low-rank terms fused into the GLU (:func:`glu_forward_lowrank`).

``glu_forward_lowrank`` is the LoRA MLP's forward pass (PEFT: gate = x W_g^T + s_g xa_g B_g^T, likewise up): per
``[BLOCK_N, BLOCK_I]`` tile it loads the base gate/up, adds s * xa @ B^T (a ``tl.dot`` over r in fp32; fp32 adapters:
``tf32x3`` into a 16-bit gate/up, exact FMA into fp32 ones, :func:`leantune.ops._dot.fp32_product_mode`), rounds
once to the stored dtype, writes gate/up back in place (the caller saves them for backward) and writes h from the
rounded values, so h recomputed from the saved buffers in backward equals the forward's h.
Traffic: reads 2, writes 3 [N, I] tensors, against 2 + 2 (two low-rank adds) + 2 + 1 (GLU) unfused.

Launch (device times on the H200, 2026-12-04, benchmarks/lora_probe.py, [4096, 14336] bf16 with fp32 factors r 16):
64 x 128 tiles, 4 warps, gate and up loaded before the low-rank dots, the dots in ``tf32x3``: 0.231 ms, against
0.518 ms for 8 warps, loads after the dots and exact FMA dots (0.344 ms with FMA dots and the rest as now); the
kernel's memory floor is 0.147 ms.

FP8 side output (``fp8_out=True``, the down projection on an FP8 base): each program also writes its tile's row
absmaxes of h as stored ([N, column tiles] fp32, 1/64 of h's bytes at 128-column tiles); a second kernel
(:mod:`leantune.ops.fp8`'s ``_quantize_rows_absmax_kernel``) reduces them to the row scales and reads h once to
write the codes, where the plain row quantiser reads a 14336-wide row twice (absmax, then codes). The codes cannot
come from this kernel: a row's scale needs every column, and a first version that gave each program 16 whole rows
(256 programs for 132 SMs at 4,096 tokens) took 66.5 ms a step on the H200 against 39.4 ms for the tiled kernel
(Llama-3-8B shape, 64 calls; benchmarks/RESULTS.md, 2026-12-03 ninth session). The torch path: h, then
``quantize_rows(h)``.

The activation and its formulas are :mod:`leantune.ops.glu`'s (this module imports them; glu knows nothing of LoRA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _dot, _launch, _runtime
from .._dot import mixed_dot
from .._fp8_rows import row_absmax, stored_fp32
from ..fp8 import _quantize_rows_absmax_triton
from ..glu import check_inputs, glu_activation, glu_forward


@triton.jit
def _lowrank_tile(XA, B, rows64, cols, row_ok, col_ok, stride_xa, stride_b, rank,
                  DOT_MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_I: tl.constexpr):
    """xa[rows, :rank] @ B[cols, :rank]^T in fp32, BLOCK_R rank columns at a time (DOT_MODE 0: fp32 factors; 2:
    16-bit factors; see _dot.py)."""
    acc = tl.zeros((BLOCK_N, BLOCK_I), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < rank
        xa = tl.load(XA + rows64[:, None] * stride_xa + rr[None, :], mask=row_ok[:, None] & r_ok[None, :],
                     other=0.0)
        bt = tl.load(B + cols.to(tl.int64)[None, :] * stride_b + rr[:, None], mask=r_ok[:, None] & col_ok[None, :],
                     other=0.0)
        acc = mixed_dot(acc, xa, bt, True, DOT_MODE, UPCAST)
    return acc


@_launch.bound
@triton.jit
def _glu_forward_lowrank_kernel(
    G, U, H, XA_G, B_G, XA_U, B_U, AMAX,
    stride_g, stride_u, stride_h, stride_xag, stride_bg, stride_xau, stride_bu,
    n_rows, n_cols, rank_g, rank_u, scale_g, scale_u,
    ACTIVATION: tl.constexpr, DOT_MODE: tl.constexpr, UPCAST: tl.constexpr, BASE_FIRST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_RG: tl.constexpr, BLOCK_RU: tl.constexpr,
    TILE_ABSMAX: tl.constexpr,
):
    """G = cast(G + s_g xa_g B_g^T), U likewise (in place), H = act(G) * U from the rounded G, U for one
    [BLOCK_N, BLOCK_I] tile; with TILE_ABSMAX also the tile's row absmaxes of H as stored into AMAX[rows, tile]."""
    rows64 = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    row_ok = rows64 < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    if BASE_FIRST:  # both loads in flight before the low-rank dots
        g = tl.load(G + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
        u = tl.load(U + rows64[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    acc_g = _lowrank_tile(XA_G, B_G, rows64, cols, row_ok, col_ok, stride_xag, stride_bg, rank_g,
                          DOT_MODE, UPCAST, BLOCK_RG, BLOCK_N, BLOCK_I)
    if not BASE_FIRST:
        g = tl.load(G + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    g = (g.to(tl.float32) + scale_g * acc_g).to(G.dtype.element_ty)
    tl.store(G + rows64[:, None] * stride_g + cols[None, :], g, mask=mask)
    acc_u = _lowrank_tile(XA_U, B_U, rows64, cols, row_ok, col_ok, stride_xau, stride_bu, rank_u,
                          DOT_MODE, UPCAST, BLOCK_RU, BLOCK_N, BLOCK_I)
    if not BASE_FIRST:
        u = tl.load(U + rows64[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    u = (u.to(tl.float32) + scale_u * acc_u).to(U.dtype.element_ty)
    tl.store(U + rows64[:, None] * stride_u + cols[None, :], u, mask=mask)
    # h from the stored (rounded) gate/up: the backward's recompute from the saved buffers sees the same values
    act, _ = glu_activation(g.to(tl.float32), ACTIVATION)
    h = (act * u.to(tl.float32)).to(H.dtype.element_ty)
    tl.store(H + rows64[:, None] * stride_h + cols[None, :], h, mask=mask)
    if TILE_ABSMAX:  # the row quantiser reduces these instead of reading h twice
        absmax = row_absmax(tl.zeros([BLOCK_N], dtype=tl.float32), stored_fp32(h), mask)
        tl.store(AMAX + rows64 * tl.num_programs(1) + tl.program_id(1), absmax, mask=row_ok)


def _forward_lowrank_triton(gate, up, xa_g, b_g, s_g, xa_u, b_u, s_u, activation, out_dtype, fp8_out=False, *,
                            block_n=64, block_i=128, num_warps=4, base_first=True):
    """h (with ``fp8_out``: and its (codes, scales), from a second kernel that reads h once); ``block_n``/
    ``block_i``/``num_warps``/``base_first`` override the defaults (for tuning on the GPU)."""
    n_rows, n_cols = gate.shape
    h = _runtime.empty((n_rows, n_cols), dtype=out_dtype, device=gate.device)
    xa_g, xa_u = (t if t.shape[1] == 1 or t.stride(1) == 1 else t.contiguous() for t in (xa_g, xa_u))
    b_g, b_u = (t if t.shape[1] == 1 or t.stride(1) == 1 else t.contiguous() for t in (b_g, b_u))
    lora_dtype = xa_g.dtype
    dot_mode = (_dot.DOT_NATIVE if lora_dtype in (torch.float16, torch.bfloat16)
                else _dot.fp32_product_mode(gate.dtype))
    grid = (_runtime.cdiv(n_rows, block_n), _runtime.cdiv(n_cols, block_i))
    absmax = _runtime.empty((n_rows, grid[1]), dtype=torch.float32, device=gate.device) if fp8_out else h
    _glu_forward_lowrank_kernel[grid](
        gate, up, h, xa_g, b_g, xa_u, b_u, absmax,
        gate.stride(0), up.stride(0), h.stride(0), xa_g.stride(0), b_g.stride(0), xa_u.stride(0), b_u.stride(0),
        n_rows, n_cols, xa_g.shape[1], xa_u.shape[1], float(s_g), float(s_u),
        ACTIVATION=activation, DOT_MODE=dot_mode, UPCAST=_runtime.KERNELS_INTERPRETED, BASE_FIRST=base_first,
        BLOCK_N=block_n, BLOCK_I=block_i, BLOCK_RG=_runtime.rank_block(xa_g.shape[1]),
        BLOCK_RU=_runtime.rank_block(xa_u.shape[1]), TILE_ABSMAX=fp8_out, num_warps=num_warps,
    )
    if not torch.compiler.is_compiling():  # traced, the kernel's writes are functionalised: no version to bump
        torch.autograd.graph.increment_version(gate)  # written behind autograd's back
        torch.autograd.graph.increment_version(up)
    return (h, _quantize_rows_absmax_triton(h, absmax)) if fp8_out else h


def _forward_lowrank_torch(gate, up, xa_g, b_g, s_g, xa_u, b_u, s_u, activation, fp8_out):
    for base, xa, b, s in ((gate, xa_g, b_g, s_g), (up, xa_u, b_u, s_u)):
        base.copy_(base.float() + s * (xa.float() @ b.float().T))  # summed in fp32, cast once by copy_
    return glu_forward(gate, up, activation, fp8_out=fp8_out)  # h in gate's dtype (gate and up share it)


def glu_forward_lowrank(gate, up, xa_g, b_g, s_g, xa_u, b_u, s_u, activation, *, fp8_out=False, **launch):
    """The LoRA MLP's gate/up low-rank terms fused into h = act(gate) * up, without autograd.

    gate <- cast(gate + s_g xa_g b_g^T), up <- cast(up + s_u xa_u b_u^T), written in place (the sum formed in fp32
    from the stored values, cast once to the buffer's dtype), then h = act(gate) * up computed from the values as
    stored, so a recompute of h from the saved gate/up (the LoRA MLP backward) matches this forward exactly. One
    pass over gate/up instead of a low-rank add per projection followed by :func:`glu_forward`.

    Args:
        gate, up: ``[N, I]`` base projection outputs, one float dtype, unit last stride, not overlapping (overwritten).
        xa_g, xa_u: ``[N, r_g]``, ``[N, r_u]`` (= (m x) A^T); b_g, b_u: ``[I, r]`` (lora_B); all four of one dtype
            (the LoRA dtype); r >= 1.
        s_g, s_u: scalings (finite real numbers).
        activation: one of :data:`leantune.ops.glu.ACTIVATIONS`.
        fp8_out: also return h quantised per row (module docstring, "FP8 side output").
        **launch: Triton path only: ``block_n``, ``block_i``, ``num_warps``, ``base_first`` (GPU tuning).

    Returns:
        ``h [N, I]`` in gate's dtype (gate and up share it); with ``fp8_out`` ``(h, (codes float8_e4m3fn [N, I],
        scales fp32 [N]))``, bit for bit :func:`~leantune.ops.fp8.quantize_rows` of h as stored.

    Raises:
        ValueError: shapes, dtypes, devices, strides or overlap as above; unknown activation; a scaling that is not
            a finite real number.
    """
    impl = check_inputs(gate, up, activation)
    s_g, s_u = _runtime.check_real("s_g", s_g), _runtime.check_real("s_u", s_u)
    if gate.dim() != 2:
        raise ValueError(f"gate must be 2-D [N, I], got shape {tuple(gate.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must share a dtype, got {gate.dtype} and {up.dtype}")
    for name, t in (("gate", gate), ("up", up)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit last stride (written in place), got strides {tuple(t.stride())}")
    # exact for the halves of one [N, 2I] buffer (accepted: the kernel writes through row strides), conservative
    # otherwise; unchecked under torch.compile, where the in-place writes are functionalised (no saved buffer is hit)
    if _runtime.rows_overlap(gate, up):
        raise ValueError("gate and up must not overlap in memory (both are written in place)")
    n_rows, n_cols = gate.shape
    for suffix, xa, b in (("g", xa_g, b_g), ("u", xa_u, b_u)):
        _runtime.check_tensor(f"xa_{suffix}", xa)
        _runtime.check_tensor(f"b_{suffix}", b)
        if xa.dim() != 2 or xa.shape[1] < 1:
            raise ValueError(f"xa_{suffix} must be 2-D [N, r] with r >= 1, got shape {tuple(xa.shape)}")
        _runtime.check_shape(f"xa_{suffix}", xa, (n_rows, xa.shape[1]), "[N, r] with N = gate's rows")
        _runtime.check_shape(f"b_{suffix}", b, (n_cols, xa.shape[1]), "[I, r] with I = gate's columns")
    dtypes = {t.dtype for t in (xa_g, b_g, xa_u, b_u)}
    if len(dtypes) > 1:
        raise ValueError(f"xa_g, b_g, xa_u, b_u must share a dtype (the LoRA dtype), got {sorted(map(str, dtypes))}")
    _runtime.check_same_device(gate=gate, up=up, xa_g=xa_g, b_g=b_g, xa_u=xa_u, b_u=b_u)
    with torch.no_grad():
        if gate.numel() == 0:  # an empty h (and its quantisation) in gate's dtype
            return glu_forward(gate, up, activation, fp8_out=fp8_out)
        if impl == "triton":
            return _forward_lowrank_triton(gate, up, xa_g, b_g, s_g, xa_u, b_u, s_u, activation, gate.dtype, fp8_out,
                                           **launch)
        return _forward_lowrank_torch(gate, up, xa_g, b_g, s_g, xa_u, b_u, s_u, activation, fp8_out)
