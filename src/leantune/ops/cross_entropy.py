r"""Cross-entropy on materialised logits, streamed over the vocabulary with an online log-sum-exp.

Forward, per row x of width V with label y (all in fp32; torch's ``F.cross_entropy`` semantics, Gemma2's softcap):

    z   = c * tanh(x / c)            with softcap c (else z = x)            (Gemma 2 final-logit softcapping)
    lse = log(sum_j exp(z_j))        streamed in chunks: m' = max(m, max z), s' = s exp(m - m') + sum exp(z - m')
    l   = (1 - eps) (lse - z_y) + eps (lse - mean_j z_j) + zl * lse^2        (label smoothing eps as torch;
                                                                              z-loss zl as PaLM, Chowdhery et al. 2022)
    ignored rows (y == ignore_index): l = 0.
    reduction "mean": sum l / D with D = count(valid) or num_items (0.0, not NaN, when no label is valid, D = 0
    included); "sum"; "none": [N].

Backward. With p = softmax(z) = exp(z - lse) and a per-row scale r (dL/dl_row: grad_output / D, grad_output, or
grad_output[row]):

    dl/dz_j = p_j (1 + 2 zl lse) - (1 - eps) [j == y] - eps / V
    dl/dx_j = dl/dz_j * (1 - tanh^2(x_j / c))              (softcap chain rule; 1 without softcap)
    dx      = r * dl/dx,  0 on ignored rows.

Every term is formed in fp32 and scaled before the single cast to the gradient's dtype, so a confident prediction
(p_y = 0.999) keeps p_y - 1 = -1e-3 instead of rounding it away in bf16 first.

Softcap in fp32, u = x / c: tanh(u) = (1 - e) / (1 + e) with e = exp(-2|u|) (sign restored), and
1 - tanh^2(u) = 4 e / (1 + e)^2, both free of cancellation for |u| >= 0.4 and exact at +-inf (softcap of -inf is -c,
not -inf); below 0.4, where 1 - e would cancel (relative error ~eps / |u|), tanh is its Taylor series to u^13 and
1 - tanh^2 is formed from it (no cancellation there). The kernel uses no tanh instruction, so it runs under Triton's
interpreter, which has no libdevice; the torch path takes ``torch.tanh`` for the value and the same 1 - tanh^2.
Padding lanes of a partial chunk load -inf and are masked to -inf again after the softcap, so they never add
exp(-c - lse) of probability mass.

What is saved (public op): the caller's logits (by reference, never written) and lse [N] fp32, 4 bytes a row. The
forward reads the logits once (loss and lse); the backward reads them once more and writes a new gradient buffer, so
the caller's tensor is never overwritten and no [N, V] buffer exists between forward and backward: 3 N V element
moves in all, the roofline's minimum for a gradient that must not alias the input. Inside the fused
linear_cross_entropy, which owns its logits chunks, :func:`loss_rows` writes the gradient in place in the same launch.

Statistics (logging only, no gradient; :func:`row_statistics`, read from a logits tile and its lse in one more pass,
no matmul): with log p_j = z_j - lse, entropy -sum_j p_j log p_j (each term >= 0: no cancellation for a confident
row), ``log_sum_sq_probs`` log sum_j p_j^2 = log sum_j exp(2 (z_j - lse)), ``mean_logits`` sum_j z_j / V and
``is_top1`` argmax_j z_j == y (the first maximum on ties, as torch.argmax). A row holding NaN logits has NaN
statistics, and an unspecified ``is_top1``.

Labels outside [0, V) other than ignore_index raise ValueError before the launch (an out-of-range label would
otherwise read out of bounds in the kernel): their range and the valid count are reduced on the device and read back
in one host sync. With ``checks="deferred"`` (leantune.patch's training step) nothing is read back: bad labels are
replaced by ignore_index before the launch, the loss is NaN, and the error is raised later
(:func:`leantune.ops.raise_deferred_errors`; :mod:`leantune.ops._loss`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch, _loss_options, _runtime
from ._loss import Options, check_options, mean_divisor, reduce, row_scale

GPU_BLOCK_V = 8192  # vocab chunk per loop iteration on the GPU (16 fp32 values a thread at 16 warps)
INTERPRETER_BLOCK_V = 128  # small under the interpreter, so tests cross several chunks at V of a few hundred
# tanh(u) = u (1 + T3 u^2 + T5 u^4 + ...) below _SERIES_BELOW: Taylor coefficients 2^2n (2^2n - 1) B_2n / (2n)!;
# the first omitted term, 929569/638512875 u^15, is < 4e-9 relative at |u| = 0.4
_SERIES_BELOW = tl.constexpr(0.4)
_T3, _T5, _T7 = tl.constexpr(-1.0 / 3.0), tl.constexpr(2.0 / 15.0), tl.constexpr(-17.0 / 315.0)
_T9, _T11, _T13 = tl.constexpr(62.0 / 2835.0), tl.constexpr(-1382.0 / 155925.0), tl.constexpr(21844.0 / 6081075.0)


# ------------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _softcap(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """(z, dz/dx) for z = c tanh(x / c); (x, 1) without softcap (formulas: the module docstring's softcap paragraph)."""
    if HAS_SOFTCAP:
        u = x / softcap
        a = tl.abs(u)
        e = tl.exp(-2.0 * a)  # in (0, 1]: never overflows, 0 at |u| = inf
        a2 = a * a
        series = a * (1.0 + a2 * (_T3 + a2 * (_T5 + a2 * (_T7 + a2 * (_T9 + a2 * (_T11 + a2 * _T13))))))
        small = a < _SERIES_BELOW
        t = tl.where(small, series, (1.0 - e) / (1.0 + e))  # tanh(|u|)
        dt = tl.where(small, 1.0 - t * t, 4.0 * e / ((1.0 + e) * (1.0 + e)))  # 1 - tanh^2(u)
        return softcap * tl.where(u < 0, -t, t), dt
    else:
        return x, 1.0


@triton.jit
def _write_gradient(
    logits_row, grad_row, start, cols, n_cols, col_offset, label, valid, lse, scale, n_vocab,
    label_smoothing, softcap, z_loss,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):
    offs = start + cols
    mask = offs < n_cols
    x = tl.load(logits_row + offs, mask=mask, other=0.0).to(tl.float32)
    z, dz_dx = _softcap(x, softcap, HAS_SOFTCAP)
    p = tl.exp(z - lse)
    if HAS_Z_LOSS:
        p = p * (1.0 + 2.0 * z_loss * lse)
    target_weight = 1.0
    if HAS_SMOOTHING:
        p = p - label_smoothing / n_vocab
        target_weight = 1.0 - label_smoothing
    g = tl.where(offs + col_offset == label, p - target_weight, p)  # p - 1 stays in fp32 (confident rows)
    # an ignored row's gradient is exactly 0 whatever its logits (exp(z - lse) may be inf or NaN there)
    g = tl.where(valid, g * dz_dx * scale, 0.0)
    tl.store(grad_row + offs, g.to(grad_row.dtype.element_ty), mask=mask)


@_launch.bound
@triton.jit
def _cross_entropy_forward_kernel(
    LOGITS, LABELS, LOSS, LSE, GRAD, GRAD_SCALE,
    stride_logits, stride_grad, n_cols, ignore_index, label_smoothing, softcap, z_loss,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per row: online lse over V, the loss, and (WRITE_GRAD) a second pass writing the gradient (may alias LOGITS)."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = LOGITS + row * stride_logits
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    z_sum = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(logits_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        z, _ = _softcap(x, softcap, HAS_SOFTCAP)
        if HAS_SOFTCAP:
            z = tl.where(mask, z, float("-inf"))  # softcap(-inf) = -c: padding must not add mass
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no (-inf) - (-inf)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m + tl.log(s)
    target = tl.where(valid, label, 0)
    z_target, _ = _softcap(tl.load(logits_row + target).to(tl.float32), softcap, HAS_SOFTCAP)
    loss = lse - z_target
    if HAS_SMOOTHING:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - z_sum / n_cols)
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    tl.store(LSE + row, lse)
    if WRITE_GRAD:
        scale = tl.load(GRAD_SCALE)
        grad_row = GRAD + row * stride_grad
        for start in range(0, n_cols, BLOCK):
            _write_gradient(logits_row, grad_row, start, cols, n_cols, 0, label, valid, lse, scale, n_cols,
                            label_smoothing, softcap, z_loss, HAS_SOFTCAP, HAS_SMOOTHING, HAS_Z_LOSS)


@_launch.bound
@triton.jit
def _cross_entropy_backward_kernel(
    LOGITS, LABELS, LSE, SCALE, GRAD,
    stride_logits, stride_grad, stride_scale, n_cols, col_offset, n_vocab,
    ignore_index, label_smoothing, softcap, z_loss,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Gradient of a row tile (columns col_offset .. col_offset + n_cols of V) from the saved lse; one pass."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    scale = tl.load(SCALE + row * stride_scale)
    lse = tl.load(LSE + row)
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        _write_gradient(LOGITS + row * stride_logits, GRAD + row * stride_grad, start, cols, n_cols, col_offset,
                        label, valid, lse, scale, n_vocab, label_smoothing, softcap, z_loss,
                        HAS_SOFTCAP, HAS_SMOOTHING, HAS_Z_LOSS)


@_launch.bound
@triton.jit
def _row_statistics_kernel(
    LOGITS, LABELS, LSE, ENTROPY, LOG_SUM_SQ, MEAN, TOP1,
    stride_logits, n_cols, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per row, from its lse: entropy, log sum p^2, mean z and argmax z == label (module docstring); one pass."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = LOGITS + row * stride_logits
    lse = tl.load(LSE + row)
    cols = tl.arange(0, BLOCK)
    entropy = tl.zeros((), tl.float32)
    sum_sq = tl.zeros((), tl.float32)
    z_sum = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_col = tl.zeros((), tl.int64)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(logits_row + offs, mask=mask, other=0.0).to(tl.float32)
        z, _ = _softcap(x, softcap, HAS_SOFTCAP)
        log_p = z - lse
        p = tl.exp(log_p)
        entropy -= tl.sum(tl.where(mask, p * tl.where(p > 0.0, log_p, 0.0), 0.0), axis=0)  # p = 0: the limit 0
        sum_sq += tl.sum(tl.where(mask, p * p, 0.0), axis=0)
        z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        block_best = tl.max(z, axis=0)
        block_col = start + tl.argmax(z, axis=0, tie_break_left=True).to(tl.int64)
        better = block_best > best  # strictly: an equal maximum later in the row keeps the first
        best_col = tl.where(better, block_col, best_col)
        best = tl.where(better, block_best, best)
    tl.store(ENTROPY + row, entropy)
    tl.store(LOG_SUM_SQ + row, tl.log(sum_sq))
    tl.store(MEAN + row, z_sum / n_cols)
    tl.store(TOP1 + row, (best_col == tl.load(LABELS + row)).to(tl.int8))


# ----------------------------------------------------------------------------------------------------- launchers
def vocab_block(device: torch.device, n_cols: int) -> int:
    """Vocabulary chunk a program loads per loop iteration (tests place labels in the first/middle/last chunk)."""
    limit = GPU_BLOCK_V if device.type == "cuda" else INTERPRETER_BLOCK_V
    return min(_runtime.next_power_of_2(max(n_cols, 1)), limit)


def _flags(opts: Options) -> dict:
    return {"HAS_SOFTCAP": opts.softcap is not None, "HAS_SMOOTHING": opts.label_smoothing > 0.0,
            "HAS_Z_LOSS": opts.z_loss > 0.0}


def _forward_triton(logits, labels, opts, loss, lse, grad, grad_scale):
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block = vocab_block(logits.device, n_cols)
    _cross_entropy_forward_kernel[(n_rows,)](
        logits, labels, loss, lse, grad if grad is not None else logits,
        grad_scale if grad_scale is not None else lse,
        logits.stride(0), grad.stride(0) if grad is not None else 0, n_cols, opts.ignore_index,
        opts.label_smoothing, opts.softcap or 1.0, opts.z_loss,
        WRITE_GRAD=grad is not None, BLOCK=block, num_warps=_runtime.num_warps_for(block), **_flags(opts),
    )


def _backward_triton(logits, labels, lse, scale, opts, grad, col_offset, n_vocab):
    n_rows, n_cols = logits.shape
    if n_rows == 0 or n_cols == 0:
        return
    block = vocab_block(logits.device, n_cols)
    _cross_entropy_backward_kernel[(n_rows,)](
        logits, labels, lse, scale, grad,
        logits.stride(0), grad.stride(0), scale.stride(0) if scale.dim() else 0, n_cols, col_offset, n_vocab,
        opts.ignore_index, opts.label_smoothing, opts.softcap or 1.0, opts.z_loss,
        BLOCK=block, num_warps=_runtime.num_warps_for(block), **_flags(opts),
    )


def _softcap_torch(x, softcap):
    """(z, dz/dx) for fp32 x: torch's tanh (accurate at every |u|) and the kernel's form of 1 - tanh^2."""
    if softcap is None:
        return x, None
    u = x / softcap
    t = torch.tanh(u)
    e = torch.exp(-2.0 * u.abs())
    return softcap * t, torch.where(u.abs() < _SERIES_BELOW.value, 1.0 - t * t, 4.0 * e / ((1.0 + e) * (1.0 + e)))


def _gradient_from_softmax_(p, labels, lse, scale, opts, dz_dx, col_offset, n_vocab, norm=None):
    """Turn ``p`` (fp32 ``[n, w]``, written in place) into the gradient tile: p holds softmax(z) (times the per-row
    ``norm`` when given: exp(z - max) with norm = 1 / sum exp(z - max)); the terms of ``_write_gradient``, each row
    scaled before the subtractions. One pass per term over the tile, no temporaries of its size."""
    valid = labels != opts.ignore_index
    row_scale = scale.float().expand(labels.shape)
    coef = row_scale if norm is None else row_scale * norm
    if opts.z_loss > 0.0:
        coef = coef * (1.0 + 2.0 * opts.z_loss * lse)
    p.mul_(coef[:, None])
    target_weight = 1.0
    if opts.label_smoothing > 0.0:
        p.sub_((opts.label_smoothing / n_vocab) * row_scale[:, None])
        target_weight = 1.0 - opts.label_smoothing
    # the target column, where it lies in this tile: a gather and a scatter of one element a row, the rows without
    # it written back unchanged (no nonzero(): its data-dependent size is a host sync on a GPU)
    local = labels - col_offset
    hit = valid & (local >= 0) & (local < p.shape[1])
    column = torch.where(hit, local, 0)[:, None]
    picked = p.gather(1, column)
    p.scatter_(1, column, torch.where(hit[:, None], picked - target_weight * row_scale[:, None], picked))
    if dz_dx is not None:
        p.mul_(dz_dx)
    # an ignored row's gradient is exactly 0 whatever its logits (exp(z - lse) may be inf or NaN there)
    p.masked_fill_(~valid[:, None], 0.0)
    return p


def _gradient_torch(logits, labels, lse, scale, opts, col_offset, n_vocab, out):
    """fp32 gradient of a row tile, the same terms as ``_write_gradient``, formed in ``out`` when it is fp32 (it may
    alias ``logits``: every pass is elementwise), else in a new buffer the caller copies from."""
    z, dz_dx = _softcap_torch(logits.float(), opts.softcap)
    if z is not logits:  # a fresh fp32 copy (upcast or softcapped): ours to overwrite
        p = z.sub_(lse[:, None])
    elif out.dtype == torch.float32:
        p = torch.sub(z, lse[:, None], out=out)
    else:
        p = z - lse[:, None]
    return _gradient_from_softmax_(p.exp_(), labels, lse, scale, opts, dz_dx, col_offset, n_vocab)


def _forward_torch(logits, labels, opts, loss, lse, grad, grad_scale):
    """Loss and lse of each row; with ``grad`` also the gradient. Passes over the ``[n, V]`` tile: max, exp(z - max)
    in place (in the gradient buffer when ``grad`` is the logits tile itself, as in the fused loss), its sum, and
    then each gradient term in place: on the CPU each separate op is a trip through memory, and a fresh buffer of
    this size costs page faults on top."""
    if logits.shape[0] == 0:
        return
    valid = labels != opts.ignore_index
    z, dz_dx = _softcap_torch(logits.float(), opts.softcap)
    # max + log sum exp(z - max), as the Triton kernel and F.cross_entropy form it: a +inf logit gives NaN (inf - inf),
    # where torch.logsumexp would return inf and a finite-looking loss of inf
    row_max = z.amax(-1, keepdim=True)
    target = torch.where(valid, labels, 0)
    z_target = z.gather(1, target[:, None]).squeeze(1)
    z_mean = z.mean(-1) if opts.label_smoothing > 0.0 else None
    if z is not logits or grad is logits:  # z may be overwritten: a fresh fp32 copy, or the tile to hold the gradient
        e = z.sub_(row_max)
    elif grad is not None and grad.dtype == torch.float32:
        e = torch.sub(z, row_max, out=grad)
    else:
        e = z - row_max
    sum_e = e.exp_().sum(-1)
    row_lse = row_max.squeeze(-1) + sum_e.log()
    row_loss = row_lse - z_target
    if opts.label_smoothing > 0.0:
        eps = opts.label_smoothing
        row_loss = (1.0 - eps) * row_loss + eps * (row_lse - z_mean)
    if opts.z_loss > 0.0:
        row_loss = row_loss + opts.z_loss * row_lse * row_lse
    loss.copy_(torch.where(valid, row_loss, 0.0))
    lse.copy_(row_lse)
    if grad is not None:  # softmax = exp(z - max) / sum exp(z - max) = exp(z - lse)
        e = _gradient_from_softmax_(e, labels, row_lse, grad_scale, opts, dz_dx, 0, logits.shape[1],
                                    norm=sum_e.reciprocal())
        if e is not grad:
            grad.copy_(e)


def _backward_torch(logits, labels, lse, scale, opts, grad, col_offset, n_vocab):
    if logits.shape[0] and logits.shape[1]:
        p = _gradient_torch(logits, labels, lse, scale, opts, col_offset, n_vocab, grad)
        if p is not grad:
            grad.copy_(p)


def _statistics_triton(logits, labels, lse, softcap, out):
    n_rows, n_cols = logits.shape
    block = vocab_block(logits.device, n_cols)
    _row_statistics_kernel[(n_rows,)](
        logits, labels, lse, out["entropy"], out["log_sum_sq_probs"], out["mean_logits"],
        out["is_top1"].view(torch.int8),
        logits.stride(0), n_cols, softcap or 1.0,
        HAS_SOFTCAP=softcap is not None, BLOCK=block, num_warps=_runtime.num_warps_for(block),
    )


def _statistics_torch(logits, labels, lse, softcap, out):
    z, _ = _softcap_torch(logits.float(), softcap)
    out["mean_logits"].copy_(z.mean(-1))
    out["is_top1"].copy_(z.argmax(-1) == labels)  # torch.argmax returns the first maximum
    log_p = z - lse[:, None]
    p = log_p.exp()
    out["log_sum_sq_probs"].copy_(p.square().sum(-1).log())
    out["entropy"].copy_(-(p * torch.where(p > 0.0, log_p, 0.0)).sum(-1))  # p = 0: 0; a NaN p stays NaN


def loss_rows(impl, logits, labels, opts, loss, lse, grad=None, grad_scale=None):
    """Write per-row loss and lse (fp32 [n]) of ``logits [n, V]``; with ``grad``, also the gradient times
    ``grad_scale`` (0-dim fp32) into ``grad [n, V]``, which may be ``logits`` itself (in place, same launch)."""
    (_forward_triton if impl == "triton" else _forward_torch)(logits, labels, opts, loss, lse, grad, grad_scale)


def gradient_rows(impl, logits, labels, lse, scale, opts, grad, col_offset=0, n_vocab=None):
    """Gradient of the tile ``logits [n, w]`` holding vocab columns ``col_offset .. col_offset + w`` of ``n_vocab``,
    from the saved ``lse``; ``scale`` is 0-dim or ``[n]`` fp32 (dL/dloss_row). ``grad`` may alias ``logits``."""
    n_vocab = logits.shape[1] if n_vocab is None else n_vocab
    (_backward_triton if impl == "triton" else _backward_torch)(
        logits, labels, lse, scale, opts, grad, col_offset, n_vocab)


def row_statistics(impl, logits, labels, lse, softcap, out):
    """Write the statistics of each row of ``logits [n, V]`` (module docstring) into ``out``: fp32 ``[n]`` tensors
    "entropy", "log_sum_sq_probs", "mean_logits" and a bool ``[n]`` "is_top1"; ``lse`` is the rows' fp32 lse from
    :func:`loss_rows` (of the softcapped logits). No gradient; the logits are only read."""
    if logits.shape[0]:
        (_statistics_triton if impl == "triton" else _statistics_torch)(logits, labels, lse, softcap, out)


# ------------------------------------------------------------------------------------------------ autograd + API
class CrossEntropyFunction(torch.autograd.Function):
    """Autograd node of :func:`cross_entropy`; saves logits (by reference), labels, lse [N] fp32, the divisor."""

    @staticmethod
    def forward(ctx, logits, labels, opts, reduction, divisor, with_lse=False):
        impl = _runtime.backend(logits.device)
        n_rows = logits.shape[0]
        loss = _runtime.empty((n_rows,), dtype=torch.float32, device=logits.device)
        lse = _runtime.empty((n_rows,), dtype=torch.float32, device=logits.device)
        loss_rows(impl, logits, labels, opts, loss, lse)
        ctx.save_for_backward(logits, labels, lse, divisor)
        ctx.impl, ctx.opts, ctx.reduction = impl, opts, reduction
        if not with_lse:
            return _runtime.distinct_output(reduce(loss, reduction, divisor))
        out_lse = lse.clone()  # return_z_loss reads it; the saved one stays unshared
        ctx.mark_non_differentiable(out_lse)
        return _runtime.distinct_output(reduce(loss, reduction, divisor)), out_lse

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, grad_output, *_lse):
        logits, labels, lse, divisor = ctx.saved_tensors
        grad = _runtime.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        scale = row_scale(grad_output, ctx.reduction, divisor)
        gradient_rows(ctx.impl, logits, labels, lse, scale, ctx.opts, grad)
        return grad, None, None, None, None, None


def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, softcap=None, z_loss=0.0,
                  reduction="mean", num_items=None, checks="eager", weight=None, use_token_scaling=False,
                  return_z_loss=False, return_token_accuracy=False):
    """Cross-entropy of ``logits`` against ``labels`` with torch's semantics plus softcap and z-loss, fp32 inside.

    Args:
        logits: ``[N, V]`` float32/float16/bfloat16 (rows may be strided; the last dim is made unit-stride). Never
            modified: the gradient goes to a new buffer in backward.
        labels: ``[N]`` int64 in ``[0, V)`` or ``ignore_index``.
        ignore_index: rows with this label contribute 0 to the loss and get a zero gradient.
        label_smoothing: eps in [0, 1]: ``(1 - eps) l + eps (lse - mean z)`` as ``torch.nn.functional.cross_entropy``.
        softcap: c > 0 or None: ``z = c tanh(logits / c)`` before everything else (Gemma 2).
        z_loss: adds ``z_loss * lse^2`` per valid row (PaLM).
        reduction: ``"mean"`` (over valid rows, or over ``num_items``; 0.0 when none is valid), ``"sum"``, ``"none"``
            (``[N]``, 0 at ignored rows).
        num_items: int or 0-dim tensor (on labels' device or the CPU) holding a whole number >= 0, with ``"mean"``
            only: the divisor replacing count(valid) (HF's ``num_items_in_batch``, for gradient accumulation
            across micro-batches). 0 is accepted only when no label is valid (HF Trainer passes 0 for an
            accumulation window without targets): the loss is then 0.0 with zero gradients.
        checks: ``"eager"`` (default): the label range and a tensor ``num_items`` are read back in one host sync
            and a bad value raises ValueError here. ``"deferred"``: no host read (inside a training step): a bad
            label is ignored by the kernels, the loss is NaN and ``leantune.ops.raise_deferred_errors()`` raises the
            ValueError later; ``num_items`` is the divisor as given (0 with valid labels: inf, HF's division).
        weight, use_token_scaling, return_z_loss, return_token_accuracy: Liger's options (formulas:
            :mod:`._loss_options`): ``weight`` ``[V]`` per-class weights as torch's ``F.cross_entropy(weight=)``;
            ``use_token_scaling`` multiplies each row's loss by its detached softmax(z)[label]; ``return_z_loss``
            also returns the z-loss part of the loss (detached); ``return_token_accuracy`` the top-1 accuracy of z
            over valid rows. Off, nothing changes.

    Returns:
        float32 loss: 0-dim, or ``[N]`` for ``"none"``. The gradient w.r.t. logits has logits' dtype. With
        ``return_z_loss`` / ``return_token_accuracy``: ``(loss, [z_loss], [accuracy])``, those asked for, in that
        order, without gradient (accuracy a 0-dim fp32 tensor).

    Raises:
        ValueError: logits not a 2-D float tensor, labels not int64 ``[N]``, tensors on different devices, a label
            outside ``[0, V)`` that is not ``ignore_index``, an unknown reduction, ``num_items`` not a whole number
            in [0, 2^63), 0 while some label is valid, or given without ``"mean"``, label_smoothing outside [0, 1],
            softcap <= 0, z_loss < 0, any of these three not a finite real number, an ignore_index outside int64,
            ``checks`` not "eager" or "deferred" (deferred: the label and num_items value errors are not raised here).
        RuntimeError: ``LEANTUNE_BACKEND=triton`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _runtime.check_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dim V")
    if (weight is not None or use_token_scaling is not False or return_token_accuracy is not False
            or return_z_loss is not False):
        return _loss_options.cross_entropy_with_options(
            logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
            z_loss=z_loss, reduction=reduction, num_items=num_items, checks=checks, weight=weight,
            use_token_scaling=use_token_scaling, return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy, row_losses=_cross_entropy, softcap_fn=_softcap_torch)
    return _cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                          softcap=softcap, z_loss=z_loss, reduction=reduction, num_items=num_items, checks=checks)


def _cross_entropy(logits, labels, *, ignore_index, label_smoothing, softcap, z_loss, reduction, num_items, checks,
                   with_lse=False):
    """:func:`cross_entropy` without Liger's options (logits already checked); ``with_lse``: ``(loss, lse [N])``."""
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be a torch.Tensor, got {type(labels).__name__}")  # noqa: TRY004 (contract)
    _runtime.check_shape("labels", labels, (logits.shape[0],), "logits' first dim N")
    _runtime.check_same_device(logits=logits, labels=labels)
    opts, n_valid, labels, poison = check_options(labels, logits.shape[1], ignore_index, label_smoothing, softcap,
                                                  z_loss, reduction, num_items, checks)
    _runtime.backend(logits.device)  # raise configuration errors before any work
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    labels = labels.contiguous()
    divisor = mean_divisor(n_valid, reduction, num_items, labels.device)
    out = CrossEntropyFunction.apply(logits, labels, opts, reduction, divisor, with_lse)
    loss, lse = out if with_lse else (out, None)
    loss = loss if poison is None else loss + poison
    return (loss, lse) if with_lse else loss

