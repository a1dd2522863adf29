r"""DoRA on the gated MLP: y = down(act(gate(x)) * up(x)) with DoRA on any of the three projections, one node.

Each DoRA projection j is :mod:`.dora`'s y_j = g_j * u_j + b_j with u_j = (its input) W_j^T + s_j xa_j B_j^T and
g_j = m_j / ||W_j + s_j B_j A_j||_row (detached); a projection without a magnitude is LoRA's y_j = u_j + b_j.
Backward, with h = act(gate) * up, for incoming dY:

    down:     dm_d = rowsum(dY * u_d) / n_d,  dY'_d = g_d * dY,  then LoRA's backward of u_d (input h) with dY'_d
              gives dh, dA_d, dB_d
    GLU:      (d_gate, d_up) = GLU backward of dh at (gate, up)
    gate, up: dm_j = rowsum(d_j * u_j) / n_j,  d'_j = g_j * d_j,  then LoRA's backward of u_gate, u_up (input x)
              gives dX (one buffer), dA_j, dB_j

Saved: x, u_gate and u_up ``[N, I]``, u_down ``[N, H_out]``, the ``[N, r]`` xa's and per DoRA projection g and n
``[out]``. gate and up are not saved: backward forms them again from u (g u + b, elementwise), then h, and the GLU
backward writes d_gate, d_up into those buffers. Against the projection-at-a-time path (u_gate, u_up, the GLU's
gate and up, down's input h) that is three fewer ``[N, I]`` buffers: N (2H + 2I) saved elements against
N (2H + 5I). No dropout (as :func:`~leantune.ops.dora_linear`); NF4 weights are refused.

The scalings run as :mod:`.dora`'s ("What runs where"): on the Triton path g u + b in the low-rank add's epilogue
in forward (one Triton column-scale pass for the gate/up rebuilt in backward), dY'_j and dm_j in one kernel.
"""

from __future__ import annotations

import torch

from .. import _runtime
from ..glu import glu_backward, glu_forward
from .dora import _check_entry, _dora_output, _scale_columns, _scale_grad, dora_weight_norm
from .entries import _check_dropout, _check_x, _meta, _no_autocast, _Proj
from .passes import group_backward, group_forward


def _scaled(u, magnitude, scale, bias, dtype, meta):
    """g * u + b (DoRA: :func:`.dora._scale_columns`, one Triton kernel on the Triton path) or u + b, evaluated in
    fp32 where g is, rounded once to ``dtype``; a new buffer."""
    if magnitude is not None:
        return _scale_columns(u, scale, bias, dtype, meta)
    out = torch.empty(u.shape, dtype=dtype, device=u.device)
    return out.copy_(u) if bias is None else torch.add(u, bias, out=out)


class DoraMLPFunction(torch.autograd.Function):
    """Autograd node of :func:`~leantune.ops.lora_mlp` with DoRA projections (module docstring): 15 tensors, 5 per
    projection (weight, lora_A, lora_B, magnitude, bias) in order gate, up, down."""

    @staticmethod
    def forward(ctx, meta_gu, meta_down, activation, x, *tensors):
        x2d = _runtime.as_rows(x)
        entries = [tensors[j:j + 5] for j in range(0, 15, 5)]
        projs = [_Proj(w, a, b, None) for w, a, b, _, _ in entries]
        metas = (meta_gu, meta_gu, meta_down)
        scales, norms = [], []

        def forward_output(j, u, xa, meta):
            """(u_j complete, projection j's output): g u + b with the low-rank add fused for DoRA, u + b else."""
            w, a, b, m, bias = entries[j]
            if m is None:
                return u, _scaled(u, None, None, bias, meta.compute_dtype, meta)
            return _dora_output(u, xa, b, meta.scalings[j % 2], scales[j], bias, meta)

        with _no_autocast(x.device):
            for j, (w, a, b, m, _) in enumerate(entries):
                norm = None if m is None else dora_weight_norm(w, a, b, metas[j].scalings[j % 2], metas[j])
                norms.append(norm)
                scales.append(None if m is None else m.detach().float() / norm)
            plain = [m is None for _, _, _, m, _ in entries]  # DoRA projections: the low-rank add fused with g u + b
            us, (xa_g, xa_u) = group_forward(x2d, projs[:2], meta_gu, None, 0, add_lowrank=plain[:2])
            (u_g, gate), (u_u, up) = (forward_output(j, us[j], (xa_g, xa_u)[j], meta_gu) for j in range(2))
            h = glu_forward(gate, up, activation)
            del gate, up
            (u_d,), (xa_d,) = group_forward(h, projs[2:], meta_down, None, 0, add_lowrank=plain[2:])
            del h
            u_d, y = forward_output(2, u_d, xa_d, meta_down)
        ctx.save_for_backward(x2d, u_g, u_u, u_d, xa_g, xa_u, xa_d, *scales, *norms, *tensors)
        ctx.metas, ctx.activation, ctx.x_shape = (meta_gu, meta_down), activation, x.shape
        return _runtime.distinct_output(y.view(*x.shape[:-1], y.shape[-1]))

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, dy):
        x2d, u_g, u_u, u_d, xa_g, xa_u, xa_d, *rest = ctx.saved_tensors
        scales, norms, tensors = rest[:3], rest[3:6], rest[6:]
        entries = [tensors[j:j + 5] for j in range(0, 15, 5)]
        projs = [_Proj(w, a, b, None) for w, a, b, _, _ in entries]
        meta_gu, meta_down = ctx.metas
        need_x, *flags = ctx.needs_input_grad[3:]
        flags = [flags[j:j + 5] for j in range(0, 15, 5)]
        extra = [None] * 3  # (dm, db) per projection

        def scale_grad(j, d, cdt, inplace):
            """dm_j, db_j from d (the gradient of projection j's output) and d' = g_j * d for LoRA's backward."""
            magnitude, bias = entries[j][3], entries[j][4]
            need_m, need_bias = flags[j][3], flags[j][4]
            meta = (meta_gu, meta_gu, meta_down)[j]
            db = d.float().sum(0).to(bias.dtype) if need_bias else None
            if magnitude is None:
                extra[j] = (None, db)
                return d
            # one kernel for d' and dm on the Triton path (in place for the GLU's buffers: d is read first)
            scaled, dm = _scale_grad(d, (u_g, u_u, u_d)[j], scales[j], norms[j], need_m, cdt, meta,
                                     d if inplace else None)
            extra[j] = (None if dm is None else dm.to(magnitude.dtype), db)
            return scaled

        def needs(j):
            return _Proj(flags[j][0], flags[j][1], flags[j][2], False)

        with _no_autocast(x2d.device):
            cdt = meta_gu.compute_dtype
            gate = _scaled(u_g, entries[0][3], scales[0], entries[0][4], cdt, meta_gu)
            up = _scaled(u_u, entries[1][3], scales[1], entries[1][4], cdt, meta_gu)
            h = glu_forward(gate, up, ctx.activation)
            dy2 = _runtime.as_rows(dy)
            d_down = scale_grad(2, dy2, meta_down.compute_dtype, False)
            dh, (down_grads,) = group_backward([d_down], h, [xa_d], projs[2:], meta_down, None, 0, True, [needs(2)])
            del h, d_down
            d_gate, d_up = glu_backward(dh.to(gate.dtype), gate, up, ctx.activation, inplace=True)
            del dh
            d_gate = scale_grad(0, d_gate, cdt, True)
            d_up = scale_grad(1, d_up, cdt, True)
            dx, gu_grads = group_backward([d_gate, d_up], x2d, [xa_g, xa_u], projs[:2], meta_gu, None, 0, need_x,
                                          [needs(0), needs(1)])
        grads = zip([*gu_grads, down_grads], extra)
        flat = [t for g, (dm, db) in grads for t in (g.weight, g.lora_A, g.lora_B, dm, db)]
        return (None, None, None, None if dx is None else dx.view(ctx.x_shape), *flat)


def dora_mlp(x, gate, up, down, activation, dropout, training):
    """:func:`~leantune.ops.lora_mlp` when any projection is a :class:`~leantune.ops.DoraWeights`; its checks."""
    _check_x(x)
    p = _check_dropout(dropout)
    gu = [_check_entry(name, proj, x.shape[-1], x.device) for name, proj in (("gate.", gate), ("up.", up))]
    if gu[0][0][0].shape[0] != gu[1][0][0].shape[0]:
        raise ValueError(f"gate.weight and up.weight must have the same rows (intermediate size), got "
                         f"{gu[0][0][0].shape[0]} and {gu[1][0][0].shape[0]}")
    dn = [_check_entry("down.", down, gu[0][0][0].shape[0], x.device)]
    lora_view = lambda checked: [((w, a, b, bias), s) for (w, a, b, _, bias), s in checked]  # noqa: E731
    meta_gu = _meta(["gate", "up"], lora_view(gu), x, p, training)
    meta_down = _meta(["down"], lora_view(dn), x, p, training)
    if max(meta_gu.p, meta_down.p) > 0:
        raise ValueError(f"dropout must be 0 when training for DoRA (got {p}): DoRA with dropout needs the frozen "
                         "GEMM on the dropped input as well, which is not fused")
    flat = [t for entry, _ in (*gu, *dn) for t in entry]
    return DoraMLPFunction.apply(meta_gu, meta_down, activation, x, *flat)
