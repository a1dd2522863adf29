r"""The GLU backward that also writes the e4m3 codes of its outputs for a grouped FP8 dX GEMM (issue #26).

With FP8 gate and up weights (scales s_g, s_u per output channel), the LoRA MLP's frozen dX is one e4m3 GEMM over
g = [d_gate diag(s_g), d_up diag(s_u)] quantised per row (:func:`leantune.ops.fp8_group.fp8_grad_input_group`).
d_gate and d_up come out of the GLU backward (:mod:`leantune.ops.glu`), so that kernel can write g's codes in the same
pass instead of a separate quantisation kernel reading both back (:func:`~leantune.ops.fp8_group.quantize_grad_outputs`:
0.330 ms a layer at 4096 x 14336 on an H100, 2026-12-05; ~10.6 ms of the 8B FP8 step with checkpointing on).

Per-token scales need the whole row's absmax over both halves (2I values), so a program owns one row: rows whose
I fits ``ONE_BLOCK_COLS`` keep d_gate and d_up in registers; wider rows go block by block (d_gate, d_up stored, the
running absmax of the scaled values kept), then read the stored halves back (just written by the program: mostly L2
on the card) for the codes. Every value is the stored d_gate/d_up (as fp32) times its multiplier, the arithmetic of
``quantize_grad_outputs`` on the stored tensors, with the rounding of :mod:`leantune.ops._fp8_rows`: the codes equal
it bit for bit, and d_gate/d_up equal :func:`~leantune.ops.glu.glu_backward`'s bit for bit. The torch path is that
chain: ``glu_backward`` then the concatenated product quantised by ``quantize_rows``.

DRAM bytes per element pair (bf16, I columns, both halves): read dh, gate, up 6, write d_gate, d_up 4, write codes 2;
the separate pass read d_gate, d_up again (4) and wrote the codes (2). Predicted 235 MB less per layer at 4096 x
14336 and one launch fewer. Measured on an H100 (2026-12-07, benchmarks/RESULTS.md): 0.376-0.461 ms against
0.465-0.540 for GLU backward + separate pass (``LOOP_WARPS``), with no measurable change in the 8B FP8 step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _launch, _runtime
from ._fp8_rows import _row_scales, _store_codes, row_absmax, stored_fp32
from .fp8 import E4M3, _quantize_rows_torch
from .glu import _backward, check_inplace, check_inputs, glu_activation

ONE_BLOCK_COLS = 8192  # widest I whose two halves (2 x 8192 fp32) one program keeps in registers
LOOP_BLOCK = 2048  # columns per block of wider rows
LOOP_WARPS = 16  # H100, 4096 x 2 x 14336: 0.376 ms against 0.463 with 8 warps (benchmarks/RESULTS.md, 2026-12-07)


# ------------------------------------------------------------------------------------------------------ kernel
@triton.jit
def _backward_block(DH, G, U, DG, DU, MG, MU, rows, cols, mask, n_cols, stride_dh, stride_g, stride_u, stride_dg,
                    stride_du, ACTIVATION: tl.constexpr):
    """d_up = dh act(g), d_gate = dh u act'(g) for one [1, BLOCK] block, stored (every input loaded first: DG/DU
    may be G/U); returns (d_gate as stored * m_g, d_up as stored * m_u) in fp32."""
    dh = tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, d_act = glu_activation(g, ACTIVATION)
    d_up = (dh * act).to(DU.dtype.element_ty)
    d_gate = (dh * u * d_act).to(DG.dtype.element_ty)
    tl.store(DU + rows[:, None] * stride_du + cols[None, :], d_up, mask=mask)
    tl.store(DG + rows[:, None] * stride_dg + cols[None, :], d_gate, mask=mask)
    col_mask = cols < n_cols
    m_g = tl.load(MG + cols, mask=col_mask, other=0.0)[None, :]
    m_u = tl.load(MU + cols, mask=col_mask, other=0.0)[None, :]
    return stored_fp32(d_gate) * m_g, stored_fp32(d_up) * m_u


@_launch.bound
@triton.jit
def _glu_backward_fp8_kernel(
    DH, G, U, DG, DU, MG, MU, Q, S,
    stride_dh, stride_g, stride_u, stride_dg, stride_du, n_cols,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    # one program per row: Q [n_rows, 2 n_cols] holds the d_gate codes, then the d_up codes
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    row_mask = rows >= 0  # one row, always in range
    cols = tl.arange(0, BLOCK)
    q_cols = 2 * n_cols
    absmax = tl.zeros([1], dtype=tl.float32)
    if ONE_BLOCK:
        mask = (cols < n_cols)[None, :]
        xg, xu = _backward_block(DH, G, U, DG, DU, MG, MU, rows, cols, mask, n_cols, stride_dh, stride_g,
                                 stride_u, stride_dg, stride_du, ACTIVATION)
        absmax = row_absmax(row_absmax(absmax, xg, mask), xu, mask)
        scale = _row_scales(absmax)
        tl.store(S + rows, scale, mask=row_mask)
        _store_codes(Q, xg, scale, rows, cols, mask, q_cols)
        _store_codes(Q + n_cols, xu, scale, rows, cols, mask, q_cols)
    else:
        for start in range(0, n_cols, BLOCK):
            block_cols = start + cols
            block_mask = (block_cols < n_cols)[None, :]
            xg, xu = _backward_block(DH, G, U, DG, DU, MG, MU, rows, block_cols, block_mask, n_cols, stride_dh,
                                     stride_g, stride_u, stride_dg, stride_du, ACTIVATION)
            absmax = row_absmax(row_absmax(absmax, xg, block_mask), xu, block_mask)
        scale = _row_scales(absmax)
        tl.store(S + rows, scale, mask=row_mask)
        tl.debug_barrier()  # the reads below see every thread's stores of DG/DU
        for start in range(0, n_cols, BLOCK):
            block_cols = start + cols
            col_mask = block_cols < n_cols
            block_mask = col_mask[None, :]
            dg = tl.load(DG + rows[:, None] * stride_dg + block_cols[None, :], mask=block_mask, other=0.0)
            du = tl.load(DU + rows[:, None] * stride_du + block_cols[None, :], mask=block_mask, other=0.0)
            xg = stored_fp32(dg) * tl.load(MG + block_cols, mask=col_mask, other=0.0)[None, :]
            xu = stored_fp32(du) * tl.load(MU + block_cols, mask=col_mask, other=0.0)[None, :]
            _store_codes(Q, xg, scale, rows, block_cols, block_mask, q_cols)
            _store_codes(Q + n_cols, xu, scale, rows, block_cols, block_mask, q_cols)


# ----------------------------------------------------------------------------------------------------- launcher
def _backward_fp8_triton(dh, gate, up, activation, m_gate, m_up, inplace, *, block=None, num_warps=None):
    """(d_gate, d_up, codes, scales); ``block``/``num_warps`` override the defaults (for tuning on the GPU)."""
    dh2d, g2d, u2d = (_runtime.as_rows(t) for t in (dh, gate, up))
    n_rows, n_cols = g2d.shape
    if inplace:  # contiguous (checked by the caller), so the row views are the caller's buffers
        d_gate, d_up = g2d, u2d
    else:
        d_gate = _runtime.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
        d_up = _runtime.empty((n_rows, n_cols), dtype=up.dtype, device=up.device)
    codes = _runtime.empty((n_rows, 2 * n_cols), dtype=E4M3, device=gate.device)
    scales = _runtime.empty((n_rows,), dtype=torch.float32, device=gate.device)
    one_block = block is None and n_cols <= ONE_BLOCK_COLS
    block = block or (_runtime.next_power_of_2(n_cols) if one_block else LOOP_BLOCK)
    one_block = one_block or block >= n_cols
    _glu_backward_fp8_kernel[(n_rows,)](
        dh2d, g2d, u2d, d_gate, d_up, m_gate, m_up, codes.view(torch.uint8), scales,
        dh2d.stride(0), g2d.stride(0), u2d.stride(0), d_gate.stride(0), d_up.stride(0), n_cols,
        ACTIVATION=activation, BLOCK=block, ONE_BLOCK=one_block,
        num_warps=num_warps or (_runtime.num_warps_for(2 * block) if one_block else LOOP_WARPS),
    )
    if inplace and not torch.compiler.is_compiling():  # written behind autograd's back (as glu_backward)
        torch.autograd.graph.increment_version(gate)
        torch.autograd.graph.increment_version(up)
    return d_gate.view(gate.shape), d_up.view(up.shape), codes, scales


# ------------------------------------------------------------------------------------------------------ API
def glu_backward_fp8(dh, gate, up, activation, m_gate, m_up, *, inplace=False):
    """:func:`~leantune.ops.glu.glu_backward` that also returns g = [d_gate diag(m_gate), d_up diag(m_up)] quantised
    per row: the codes and scales a grouped FP8 dX GEMM over gate and up reads (module docstring).

    Args:
        dh, gate, up, activation, inplace: as :func:`~leantune.ops.glu.glu_backward` (``inplace``: gate and up
            contiguous, not overlapping; d_gate/d_up written over them).
        m_gate: fp32 ``[I]`` (I = gate's last dim), the gate weight's per-output-channel e4m3 scales.
        m_up: fp32 ``[I]``, the up weight's.

    Returns:
        ``(d_gate, d_up, (codes, scales))``: d_gate/d_up as ``glu_backward`` returns them, bit for bit; codes
        ``float8_e4m3fn [rows, 2I]`` (rows = the leading dims flattened) and scales fp32 ``[rows]``, bit for bit
        ``quantize_rows(cat([d_gate.float() * m_gate, d_up.float() * m_up], -1))`` of the stored d_gate/d_up
        (:func:`~leantune.ops.fp8_group.quantize_grad_outputs` of them).

    Raises:
        ValueError: as ``glu_backward``; a 0-dim gate; m_gate or m_up not fp32 ``[I]`` on gate's device.
    """
    impl = check_inputs(gate, up, activation, dh)
    if gate.dim() == 0:
        raise ValueError("gate must have at least one dimension [..., I], got a 0-dim tensor")
    width = gate.shape[-1]
    for name, m in (("m_gate", m_gate), ("m_up", m_up)):
        if not isinstance(m, torch.Tensor) or m.dtype != torch.float32 or m.shape != (width,) or \
                m.device != gate.device:
            got = (f"{tuple(m.shape)} {m.dtype} on {m.device}" if isinstance(m, torch.Tensor)
                   else type(m).__name__)
            raise ValueError(f"{name} must be a float32 tensor of shape ({width},) on {gate.device}, got {got}")
    if inplace:
        check_inplace(gate, up)
    with torch.no_grad():
        if impl == "triton" and gate.numel():
            d_gate, d_up, codes, scales = _backward_fp8_triton(dh, gate, up, activation, m_gate.contiguous(),
                                                               m_up.contiguous(), inplace)
            return d_gate, d_up, (codes, scales)
        d_gate, d_up = _backward(dh, gate, up, activation, impl, inplace)
        rows = math.prod(gate.shape[:-1])  # not -1: ambiguous when I is 0
        g = torch.cat([d_gate.reshape(rows, width).float() * m_gate, d_up.reshape(rows, width).float() * m_up], dim=1)
        return d_gate, d_up, _quantize_rows_torch(g)
