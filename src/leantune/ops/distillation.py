r"""Distillation loss between a teacher's and a student's lm_head without holding either's [N, V] logits.

Per row n, with s = (h_s W_s^T + b_s) / T and t = (h_t W_t^T + b_t) / T (the 1 / T is the GEMM's alpha),
P = softmax(s) (student), Q = softmax(t) (teacher), log M = log((1 - beta) P + beta Q) (a logaddexp per element),
following TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (Agarwal et al. 2024, "On-policy distillation", Eq. 1):

    beta = 0:      l = KL(Q || P) = sum_j Q_j (log Q_j - log P_j)                      (forward KL)
    beta = 1:      l = KL(P || Q) = sum_j P_j (log P_j - log Q_j)                      (reverse KL)
    0 < beta < 1:  l = beta KL(Q || M) + (1 - beta) KL(P || M)                          (generalised JSD)

Gradient w.r.t. the student's scaled logits s (derivation: with dP_k/ds_j = P_k ([k == j] - P_j), the terms through
log M cancel, since sum_k (beta Q_k + (1 - beta) P_k) / M_k * P_k ([k == j] - P_j) = sum_k P_k ([k == j] - P_j) = 0):

    beta = 0:      dl/ds_j = P_j - Q_j
    otherwise:     dl/ds_j = c P_j (r_j - sum_k P_k r_k),  r = log P - log M (log Q at beta = 1), c = 1 - beta (1 at
                   beta = 1)

and dl/dx = dl/ds / T for the raw logits x. The teacher gets no gradient (it is the target; its tensors are read
under no_grad). Reductions: "batchmean" sum over valid rows / count(valid) (labels None: / N; 0.0 when none is
valid), "sum"; ``num_items`` replaces the count (gradient accumulation). Ignored rows (label == ignore_index)
contribute 0.

As memory="fast" of :mod:`.linear_cross_entropy`: everything happens in the forward, token chunk by token chunk
(rows = chunk_bytes / (V * (itemsize_s + itemsize_t))): both chunks' logits, then one row kernel (three passes: both
lse online; loss and E_P[r]; the gradient written over the student's chunk), then dhidden_s[c] = G W_s,
dweight_s += G^T h_s (fp32 across chunks for 16-bit weights), dbias_s += sum G. Saved: those gradients; backward
multiplies them by grad_output (one backward per forward). Extra peak: the two chunk buffers (default 128 MiB
together) plus O(N) fp32 rows.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from . import _launch, _runtime
from ._loss import check_options
from .cross_entropy import vocab_block
from .linear_cross_entropy import DEFAULT_CHUNK_BYTES, _add_product, _logits_into, chunk_length

REDUCTIONS = ("batchmean", "sum")
_FORWARD_KL, _REVERSE_KL, _JSD = 0, 1, 2


@_launch.bound
@triton.jit
def _distillation_rows_kernel(
    STUDENT, TEACHER, LABELS, LOSS, GRAD_SCALE,
    stride_s, stride_t, n_cols, ignore_index, beta, log_beta, log_1m_beta,
    MODE: tl.constexpr, HAS_LABELS: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row: lse of s and t (online), then l and E_P[r], then (WRITE_GRAD) dl/ds over the student row in place."""
    row = tl.program_id(0).to(tl.int64)
    s_row = STUDENT + row * stride_s
    t_row = TEACHER + row * stride_t
    valid = True
    if HAS_LABELS:
        valid = tl.load(LABELS + row) != ignore_index
    cols = tl.arange(0, BLOCK)
    m_s = tl.full((), float("-inf"), tl.float32)
    m_t = tl.full((), float("-inf"), tl.float32)
    sum_s = tl.zeros((), tl.float32)
    sum_t = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        s = tl.load(s_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        t = tl.load(t_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_s = tl.maximum(m_s, tl.max(s, axis=0))
        new_t = tl.maximum(m_t, tl.max(t, axis=0))
        sum_s = sum_s * tl.exp(m_s - new_s) + tl.sum(tl.exp(s - new_s), axis=0)
        sum_t = sum_t * tl.exp(m_t - new_t) + tl.sum(tl.exp(t - new_t), axis=0)
        m_s, m_t = new_s, new_t
    lse_s = m_s + tl.log(sum_s)
    lse_t = m_t + tl.log(sum_t)
    loss = tl.zeros((), tl.float32)
    expect = tl.zeros((), tl.float32)  # E_P[r]
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        log_p = tl.load(s_row + start + cols, mask=mask, other=0.0).to(tl.float32) - lse_s
        log_q = tl.load(t_row + start + cols, mask=mask, other=0.0).to(tl.float32) - lse_t
        p = tl.exp(log_p)
        q = tl.exp(log_q)
        if MODE == 0:
            term = q * (log_q - log_p)
        elif MODE == 1:
            term = p * (log_p - log_q)
            expect += tl.sum(tl.where(mask, term, 0.0), axis=0)
        else:
            a = log_p + log_1m_beta
            b = log_q + log_beta
            hi = tl.maximum(a, b)
            log_m = hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))
            p_r = p * (log_p - log_m)
            term = beta * q * (log_q - log_m) + (1.0 - beta) * p_r
            expect += tl.sum(tl.where(mask, p_r, 0.0), axis=0)
        loss += tl.sum(tl.where(mask, term, 0.0), axis=0)
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    if WRITE_GRAD:
        scale = tl.load(GRAD_SCALE)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            log_p = tl.load(s_row + start + cols, mask=mask, other=0.0).to(tl.float32) - lse_s
            log_q = tl.load(t_row + start + cols, mask=mask, other=0.0).to(tl.float32) - lse_t
            p = tl.exp(log_p)
            if MODE == 0:
                g = p - tl.exp(log_q)
            elif MODE == 1:
                g = p * (log_p - log_q - expect)
            else:
                a = log_p + log_1m_beta
                b = log_q + log_beta
                hi = tl.maximum(a, b)
                log_m = hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))
                g = (1.0 - beta) * p * (log_p - log_m - expect)
            g = tl.where(valid, g * scale, 0.0)
            tl.store(s_row + start + cols, g.to(STUDENT.dtype.element_ty), mask=mask)


def _rows_triton(student, teacher, labels, mode, beta, ignore_index, loss, grad_scale):
    n_rows, n_cols = student.shape
    block = vocab_block(student.device, n_cols)
    _distillation_rows_kernel[(n_rows,)](
        student, teacher, labels if labels is not None else loss, loss,
        grad_scale if grad_scale is not None else loss,
        student.stride(0), teacher.stride(0), n_cols, ignore_index, beta,
        math.log(beta) if beta > 0 else 0.0, math.log1p(-beta) if beta < 1 else 0.0,
        MODE=mode, HAS_LABELS=labels is not None, WRITE_GRAD=grad_scale is not None, BLOCK=block,
        num_warps=_runtime.num_warps_for(block),
    )


def _rows_torch(student, teacher, labels, mode, beta, ignore_index, loss, grad_scale):
    """The kernel's formulas in torch, fp32; the gradient is written over ``student`` (the chunk buffer)."""
    log_p = torch.log_softmax(student.float(), -1)
    log_q = torch.log_softmax(teacher.float(), -1)
    p = log_p.exp()
    if mode == _FORWARD_KL:
        row = (log_q.exp() * (log_q - log_p)).sum(-1)
        grad = None if grad_scale is None else p - log_q.exp()
    else:
        log_m = log_q if mode == _REVERSE_KL else torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))
        p_r = p * (log_p - log_m)
        expect = p_r.sum(-1)
        row = expect if mode == _REVERSE_KL else beta * (log_q.exp() * (log_q - log_m)).sum(-1) + (1 - beta) * expect
        grad = None
        if grad_scale is not None:
            grad = p_r.sub_(p * expect[:, None])
            if mode == _JSD:
                grad.mul_(1.0 - beta)
    valid = None if labels is None else labels != ignore_index
    loss.copy_(row if valid is None else torch.where(valid, row, 0.0))
    if grad is not None:
        grad.mul_(grad_scale)
        if valid is not None:
            grad.masked_fill_(~valid[:, None], 0.0)
        student.copy_(grad)


class LinearDistillationFunction(torch.autograd.Function):
    """Autograd node of :func:`linear_distillation_loss`: saves the student's dhidden, dweight, dbias (those
    wanted), formed in the forward; backward scales them by grad_output in place (one backward per forward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, labels, mode, beta,
                ignore_index, alpha, divisor, chunk_bytes, wants):
        impl = _runtime.backend(hidden.device)
        rows_fn = _rows_triton if impl == "triton" else _rows_torch
        n_rows, n_vocab = hidden.shape[0], weight.shape[0]
        device, dtype = hidden.device, hidden.dtype
        want_h, want_w, want_b = wants
        loss = _runtime.empty((n_rows,), dtype=torch.float32, device=device)
        dhidden = _runtime.empty(hidden.shape, dtype=dtype, device=device) if want_h else None
        dbias = _runtime.empty((n_vocab,), dtype=torch.float32, device=device).zero_() if want_b else None
        itemsize = hidden.element_size() + teacher_hidden.element_size()
        rows = chunk_length(chunk_bytes, n_vocab * itemsize, max(n_rows, 1))
        wide = want_w and dtype != torch.float32 and n_rows > rows
        dweight = _runtime.empty(weight.shape, dtype=torch.float32 if wide else dtype, device=device) if want_w \
            else None
        # dl/dx = dl/ds / T, and the reduction's 1 / D
        grad_scale = (torch.full((), alpha, dtype=torch.float32, device=device) / divisor) if any(wants) else None
        if n_rows == 0 and dweight is not None:
            dweight.zero_()
        if n_rows:
            buffer = _runtime.empty((rows, n_vocab), dtype=dtype, device=device)
            teacher_buffer = _runtime.empty((rows, n_vocab), dtype=teacher_hidden.dtype, device=device)
        for start in range(0, n_rows, rows):
            end = min(start + rows, n_rows)
            hidden_c = hidden[start:end]
            s = _logits_into(buffer[: end - start], hidden_c, weight, bias, alpha)
            t = _logits_into(teacher_buffer[: end - start], teacher_hidden[start:end], teacher_weight, teacher_bias,
                             alpha)
            rows_fn(s, t, None if labels is None else labels[start:end], mode, beta, ignore_index, loss[start:end],
                    grad_scale)
            if want_h:
                torch.mm(s, weight, out=dhidden[start:end])
            if want_w:
                _add_product(dweight, s.t(), hidden_c, first=start == 0)
            if want_b:
                dbias += s.sum(0, dtype=torch.float32)
        if wide:
            dweight = dweight.to(dtype)
        ctx.save_for_backward(dhidden, dweight, dbias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return _runtime.distinct_output(loss.sum() / divisor)

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, grad_output):
        if getattr(ctx, "consumed", False):
            raise RuntimeError("linear_distillation_loss supports one backward per forward (its gradients, formed in "
                               "the forward, are scaled in place)")
        ctx.consumed = True
        grads = list(ctx.saved_tensors)
        if not bool(grad_output == 1.0):
            for g in grads:
                if g is not None:
                    g.mul_(grad_output.to(g.dtype))
        out = [None if g is None or dt is None else g.to(dt) for g, dt in zip(grads, ctx.dtypes)]
        return (*out, *([None] * 11))


def _check_head(prefix, hidden, weight, bias, n_vocab=None):
    _runtime.check_tensor(f"{prefix}hidden", hidden)
    _runtime.check_tensor(f"{prefix}weight", weight)
    if hidden.dim() != 2:
        raise ValueError(f"{prefix}hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"{prefix}weight must be [V, H] with V > 0 and H = {hidden.shape[1]}, got shape "
                         f"{tuple(weight.shape)}")
    if n_vocab is not None and weight.shape[0] != n_vocab:
        raise ValueError(f"{prefix}weight must have the student's vocabulary V = {n_vocab}, got {weight.shape[0]}")
    if bias is not None:
        _runtime.check_tensor(f"{prefix}bias", bias)
        _runtime.check_shape(f"{prefix}bias", bias, (weight.shape[0],), "the vocabulary V")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(f"{prefix}hidden, {prefix}weight and {prefix}bias must share one dtype, got "
                         f"{hidden.dtype}, {weight.dtype}" + ("" if bias is None else f", {bias.dtype}"))


def linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, labels=None, *, bias=None,
                             teacher_bias=None, beta=0.5, temperature=1.0, ignore_index=-100, reduction="batchmean",
                             num_items=None, chunk_bytes=None):
    """Generalised JSD / forward KL / reverse KL (module docstring) between the student's head
    ``hidden @ weight.T + bias`` and the teacher's, row by row, without an [N, V] tensor.

    Args:
        hidden: ``[N, H]`` student hidden states; weight ``[V, H]``; bias ``[V]`` or None (one float dtype).
        teacher_hidden: ``[N, Ht]``; teacher_weight ``[V, Ht]``; teacher_bias ``[V]`` or None (their own dtype).
            No gradient flows to the teacher.
        labels: ``[N]`` int64 or None; rows equal to ``ignore_index`` are left out (their value is otherwise
            unused: the loss compares whole distributions).
        beta: in [0, 1]: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), else the generalised
            JSD (TRL's ``beta``).
        temperature: T > 0, dividing both heads' logits.
        reduction: ``"batchmean"`` (sum / count of valid rows, or / ``num_items``) or ``"sum"``.
        num_items: int or 0-dim tensor, ``"batchmean"`` only: the divisor (gradient accumulation).
        chunk_bytes: byte budget of both logits chunks together (default 128 MiB).

    Returns:
        0-dim float32 loss, differentiable w.r.t. hidden, weight and bias.

    Raises:
        ValueError: non-float or mixed dtypes within a head, wrong shapes (N or V differing between the heads),
            labels not int64 ``[N]``, beta outside [0, 1], temperature not > 0 (or 1 / temperature not finite), an
            unknown reduction, num_items with "sum", negative, or 0 while rows are scored, chunk_bytes not a
            positive int, tensors on different devices.
        RuntimeError: ``LEANTUNE_BACKEND=triton`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check_head("", hidden, weight, bias)
    _check_head("teacher_", teacher_hidden, teacher_weight, teacher_bias, weight.shape[0])
    _runtime.check_shape("teacher_hidden", teacher_hidden, (hidden.shape[0], teacher_hidden.shape[1]),
                         "the student's rows N")
    beta = _runtime.check_real("beta", beta, low=0.0, high=1.0)
    temperature = _runtime.check_real("temperature", temperature, low=0.0, low_open=True,
                                      expected="a finite number > 0")
    if not math.isfinite(1.0 / temperature):
        raise ValueError(f"temperature must be a finite number > 0 whose inverse is finite, got {temperature!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if num_items is not None and reduction != "batchmean":  # before check_options, which names its own "mean"
        raise ValueError(f"num_items is only valid with reduction='batchmean', got reduction={reduction!r}")
    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES["fast"]
    elif isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, numbers.Integral) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    _runtime.check_same_device(hidden=hidden, weight=weight, bias=bias, teacher_hidden=teacher_hidden,
                               teacher_weight=teacher_weight, teacher_bias=teacher_bias,
                               labels=labels if isinstance(labels, torch.Tensor) else None)
    n_rows = hidden.shape[0]
    if labels is not None:
        if isinstance(labels, torch.Tensor):
            _runtime.check_shape("labels", labels, (n_rows,), "hidden's first dim N")
        # the range of a label is irrelevant here (only == ignore_index is read): V = 2^62 accepts any token
        _, n_valid, _, _ = check_options(labels, 2**62, ignore_index, 0.0, None, 0.0,
                                         "mean" if reduction == "batchmean" else "sum", num_items)
        labels = labels.contiguous()
    else:
        n_valid = n_rows
        # every row counts: a 0 divisor is refused for N > 0 as with labels (a tensor num_items is read back by
        # the check anyway, so its rows ride along; otherwise no tensor is read)
        rows = n_rows if isinstance(num_items, torch.Tensor) else 0
        check_options(torch.zeros(rows, dtype=torch.int64, device=hidden.device), 1, ignore_index, 0.0, None, 0.0,
                      "mean" if reduction == "batchmean" else "sum", num_items)
        if num_items is not None and not isinstance(num_items, torch.Tensor) and num_items == 0 and n_rows:
            raise ValueError(f"num_items is 0 but all {n_rows} rows are scored (labels=None): a divisor of 0 is only "
                             "accepted when no row is")
    if reduction == "sum":
        divisor = torch.ones((), dtype=torch.float32, device=hidden.device)
    elif isinstance(num_items, torch.Tensor):
        divisor = num_items.detach().to(device=hidden.device, dtype=torch.float32).clamp_min(1.0)
    else:
        divisor = torch.full((), float(max(n_valid if num_items is None else num_items, 1)), dtype=torch.float32,
                             device=hidden.device)
    _runtime.backend(hidden.device)
    grad_on = torch.is_grad_enabled()
    wants = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    mode = _FORWARD_KL if beta == 0.0 else _REVERSE_KL if beta == 1.0 else _JSD
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    with torch.no_grad():
        teacher = [None if t is None else t.detach() for t in (teacher_hidden, teacher_weight, teacher_bias)]
    teacher[0] = teacher[0] if teacher[0].stride(-1) == 1 else teacher[0].contiguous()
    teacher[1] = teacher[1] if teacher[1].stride(-1) == 1 else teacher[1].contiguous()
    with torch.autocast(hidden.device.type, enabled=False):
        return LinearDistillationFunction.apply(hidden, weight, bias, *teacher, labels, mode, beta, int(ignore_index),
                                                1.0 / temperature, divisor, int(chunk_bytes), wants)
