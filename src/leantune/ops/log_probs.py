r"""Fused per-token log-prob head: log p(token) under ``softmax((hidden @ weight.T + bias) / T)`` without ever
holding the [N, V] logits. The primitive under the RL, preference and distillation losses (:mod:`.preference`).

Forward, per row n with logits x_n = h_n W^T + b, temperature T and token y_n (softcap c optional, Gemma 2):

    z_n    = x_n / T                    (c: z_n = c tanh(x_n / c) / T = c' tanh(x'_n / c') with x' = x / T, c' = c / T)
    lse_n  = log sum_j exp(z_nj)
    logp_n = z_{n, y_n} - lse_n         0 at ignored rows (y_n == ignore_index)
    H_n    = -sum_j p_nj log p_nj       p = softmax(z_n); optional, 0 at ignored rows

The 1 / T is cuBLAS's ``alpha`` on the fp32 accumulator (:func:`linear_cross_entropy._logits_into`): no extra pass,
no extra rounding. logp_n is minus the cross-entropy row loss of z_n, so the row kernels are those of
:mod:`leantune.ops.cross_entropy` (``loss_rows`` for lse and z_y, ``row_statistics`` for the entropy).

Backward, for any upstream g_n = dL/dlogp_n (the losses weight tokens after the head, so it is unknown at forward
time and the logits are recomputed):

    dL/dz_nj = g_n ([j == y_n] - p_nj)        dL/dx_nj = -(g_n / T) (p_nj - [j == y_n])   (times 1 - tanh^2 with c)

which is cross_entropy's dl/dz with the per-row scale r_n = -g_n / T (``gradient_rows``). With an upstream
gradient e_n = dL/dH_n on the entropy too (GRPO's entropy bonus), dH_n/dz_nj = -p_nj (log p_nj + H_n), so

    dL/dz_nj = g_n [j == y_n] - p_nj (g_n + e_n (log p_nj + H_n))                          (this module's kernel)

from the saved lse and H (log p = z - lse). dhidden = G W,
dweight = G^T h, dbias = sum_n G_n, as in :mod:`.linear_cross_entropy`'s recompute path (vocab tiles over all rows
when the weight or bias wants a gradient, token chunks otherwise). 2 N H V multiply-adds forward, 2 or 4 more
backward (dhidden only, or with dweight).

Saved: hidden, weight, bias (references), tokens, lse [N] fp32 (and H [N] with the entropy). Extra peak: one
logits chunk (``chunk_bytes``, default 256 MiB) plus O(N) fp32 rows. Under ``torch.autocast`` the inputs are cast to
the autocast dtype, as HF's ``lm_head`` would be; gradients come back in each input's dtype.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from . import _launch, _runtime
from ._loss import Options, check_options
from .cross_entropy import _softcap, _softcap_torch, loss_rows, row_statistics, vocab_block
from .linear_cross_entropy import _logits_into, _recompute_backward, chunk_length, compute_inputs

# Measured on the H200 at N 65,536, H 4,096, V 151,936 bf16, fwd + bwd of dhidden (benchmarks/RESULTS.md,
# 2026-12-04): 632 ms and 0.53 GiB beyond the inputs at 32 MiB chunks (110 rows each), 391 ms and 0.72 GiB at
# 256 MiB (the [N, V] torch path: 372 ms, 111 GiB). Narrow chunks leave the GEMMs short of rows.
DEFAULT_LOG_PROBS_CHUNK_BYTES = 256 * 2**20

_SCRATCH_STATISTICS = ("log_sum_sq_probs", "mean_logits", "is_top1")  # row_statistics writes them beside entropy


@_launch.bound
@triton.jit
def _log_probs_entropy_backward_kernel(
    LOGITS, TOKENS, LSE, ROWS, GRAD,
    stride_logits, stride_grad, n_cols, col_offset, ignore_index, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    """dL/dx of a row tile with upstream gradients on logp and H (module docstring); ROWS holds per row
    (g_n / T, e_n / T, H_n). May write over LOGITS."""
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(TOKENS + row)
    valid = token != ignore_index
    lse = tl.load(LSE + row)
    g_lp = tl.load(ROWS + row * 3)
    g_h = tl.load(ROWS + row * 3 + 1)
    h = tl.load(ROWS + row * 3 + 2)
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(LOGITS + row * stride_logits + offs, mask=mask, other=0.0).to(tl.float32)
        z, dz_dx = _softcap(x, softcap, HAS_SOFTCAP)
        log_p = z - lse
        g = -tl.exp(log_p) * (g_lp + g_h * (log_p + h))
        g = tl.where(offs + col_offset == token, g + g_lp, g)
        g = tl.where(valid, g * dz_dx, 0.0)  # an ignored row's logp and H are constants 0
        tl.store(GRAD + row * stride_grad + offs, g.to(GRAD.dtype.element_ty), mask=mask)


def _entropy_gradient_rows(impl, logits, tokens, lse, rows, opts, grad, col_offset=0, n_vocab=None):
    """``_recompute_backward``'s ``rows_fn`` with the entropy's gradient: ``rows`` [n, 3] fp32 holds
    (g_n / T, e_n / T, H_n) per row; writes the tile's dL/dx into ``grad`` (may alias ``logits``)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0 or n_cols == 0:
        return
    if impl == "triton":
        block = vocab_block(logits.device, n_cols)
        _log_probs_entropy_backward_kernel[(n_rows,)](
            logits, tokens, lse, rows, grad, logits.stride(0), grad.stride(0), n_cols, col_offset,
            opts.ignore_index, opts.softcap or 1.0,
            HAS_SOFTCAP=opts.softcap is not None, BLOCK=block, num_warps=_runtime.num_warps_for(block))
        return
    z, dz_dx = _softcap_torch(logits.float(), opts.softcap)
    log_p = z - lse[:, None]
    g = log_p.mul(rows[:, 1:2]).add_(rows[:, 1:2] * rows[:, 2:3]).add_(rows[:, 0:1]).mul_(log_p.exp()).neg_()
    local = tokens - col_offset
    hit = torch.nonzero((tokens != opts.ignore_index) & (local >= 0) & (local < n_cols)).squeeze(1)
    g[hit, local[hit]] += rows[hit, 0]
    if dz_dx is not None:
        g.mul_(dz_dx)
    g.masked_fill_((tokens == opts.ignore_index)[:, None], 0.0)
    grad.copy_(g)


def _forward(impl, hidden, weight, bias, tokens, opts, alpha, chunk_bytes, with_entropy):
    """logp [N], lse [N] and (with_entropy) H [N], fp32, over token chunks of the logits."""
    n_rows, n_vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    log_probs = _runtime.empty((n_rows,), dtype=torch.float32, device=device)
    lse = _runtime.empty((n_rows,), dtype=torch.float32, device=device)
    entropy = _runtime.empty((n_rows,), dtype=torch.float32, device=device) if with_entropy else None
    if n_rows == 0:
        return log_probs, lse, entropy
    rows = chunk_length(chunk_bytes, n_vocab * hidden.element_size(), n_rows)
    buffer = _runtime.empty((rows, n_vocab), dtype=hidden.dtype, device=device)
    scratch = None
    if with_entropy:
        scratch = {name: _runtime.empty((rows,), dtype=torch.bool if name == "is_top1" else torch.float32,
                                        device=device) for name in _SCRATCH_STATISTICS}
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        z = _logits_into(buffer[: end - start], hidden[start:end], weight, bias, alpha)
        # the cross-entropy row loss lse - z_y is -logp (0 at ignored rows)
        loss_rows(impl, z, tokens[start:end], opts, log_probs[start:end], lse[start:end])
        if with_entropy:
            out = {name: t[: end - start] for name, t in scratch.items()}
            out["entropy"] = entropy[start:end]
            row_statistics(impl, z, tokens[start:end], lse[start:end], opts.softcap, out)
    log_probs.neg_().add_(0.0)  # + 0.0: an ignored row's -0.0 becomes 0.0 (IEEE -0 + 0 = +0)
    if with_entropy:
        entropy.masked_fill_(tokens == opts.ignore_index, 0.0)
    return log_probs, lse, entropy


class LinearLogProbsFunction(torch.autograd.Function):
    """Autograd node of :func:`linear_log_probs`: saves hidden, weight, bias, tokens, lse [N] fp32 (and the entropy
    [N] when returned); never [N, V]. Returns logp and (if asked) the entropy, both differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, opts, alpha, chunk_bytes, wants, compute_dtype, with_entropy):
        impl = _runtime.backend(hidden.device)
        ctx.impl, ctx.opts, ctx.alpha, ctx.chunk_bytes, ctx.wants = impl, opts, alpha, chunk_bytes, wants
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, b = compute_inputs(hidden, weight, bias, compute_dtype)
            log_probs, lse, entropy = _forward(impl, h, w, b, tokens, opts, alpha, chunk_bytes, with_entropy)
        if any(wants):
            ctx.save_for_backward(h, w, b, tokens, lse, entropy)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no entropy pass without one
        log_probs = _runtime.distinct_output(log_probs)
        return log_probs if entropy is None else (log_probs, _runtime.distinct_output(entropy))

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, grad_log_probs, grad_entropy=None):
        h, w, b, tokens, lse, entropy = ctx.saved_tensors
        if grad_log_probs is None:
            grad_log_probs = torch.zeros_like(lse)
        if grad_entropy is None:
            # dL/dx = r (p - onehot) with r = -g / T: cross_entropy's gradient rows with that per-row scale
            scale, rows_fn = (grad_log_probs.float() * -ctx.alpha).contiguous(), None
        else:
            scale = torch.stack([grad_log_probs.float(), grad_entropy.float(), entropy], 1)
            scale[:, :2] *= ctx.alpha
            rows_fn = _entropy_gradient_rows
        with torch.autocast(h.device.type, enabled=False):
            grads = _recompute_backward(ctx.impl, h, w, b, tokens, lse, scale, ctx.opts, ctx.chunk_bytes, ctx.wants,
                                        ctx.alpha, **({"rows_fn": rows_fn} if rows_fn else {}))
        out = [None if g is None or dt is None else g.to(dt) for g, dt in zip(grads, ctx.dtypes)]
        return (*out, None, None, None, None, None, None, None)


def linear_log_probs(hidden, weight, tokens, bias=None, *, temperature=1.0, entropy=False, ignore_index=-100,
                     softcap=None, chunk_bytes=None, checks="eager"):
    """Per-token ``log softmax((hidden @ weight.T + bias) / temperature)[token]`` without an [N, V] tensor.

    Args:
        hidden: ``[..., H]`` float32/float16/bfloat16 (the final hidden states at the positions that predict
            ``tokens``, i.e. already shifted).
        weight: ``[V, H]`` (lm_head), hidden's dtype unless under ``torch.autocast``.
        tokens: ``[...]`` int64 (hidden's leading shape), in ``[0, V)`` or ``ignore_index``.
        bias: ``[V]`` or None.
        temperature: T > 0; logits are divided by it before the softmax (TRL's GRPO ``temperature``).
        entropy: also return the entropy of softmax(z) per row (differentiable: an entropy bonus trains through it).
        ignore_index: rows with this token give logp 0 (and entropy 0) and no gradient.
        softcap: c > 0 or None: ``c tanh(x / c)`` applied to the logits before the temperature (Gemma 2).
        chunk_bytes: byte budget of the logits work buffer (default :data:`DEFAULT_LOG_PROBS_CHUNK_BYTES`, 256 MiB):
            token chunks of
            ``chunk_bytes / (V * itemsize)`` rows forward; vocab tiles of ``chunk_bytes / (N * itemsize)`` columns
            backward when the weight or bias wants a gradient.
        checks: ``"eager"`` (a bad token raises ValueError, after one host sync) or ``"deferred"`` (no host sync: a
            bad token is read as ignore_index, the log-probs become NaN and ``ops.raise_deferred_errors`` raises
            later), as :func:`leantune.ops.cross_entropy`.

    Returns:
        float32 log-probs of ``tokens``' shape; with ``entropy=True`` a tuple ``(log_probs, entropy)``. Gradients
        for hidden, weight and bias (those requiring grad) in their own dtypes, for any upstream gradient.

    Raises:
        ValueError: hidden/weight/bias not float tensors of one dtype (outside autocast), weight not ``[V, H]``,
            bias not ``[V]``, tokens not int64 of hidden's leading shape, a token outside ``[0, V)`` other than
            ``ignore_index``, temperature not a finite number > 0, softcap <= 0, chunk_bytes not a positive int,
            entropy not a bool, tensors on different devices.
        RuntimeError: ``LEANTUNE_BACKEND=triton`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _runtime.check_tensor("hidden", hidden)
    _runtime.check_tensor("weight", weight)
    if hidden.dim() < 1:
        raise ValueError("hidden must have a last dim H, got a 0-dim tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V, H] with V > 0 and H = {hidden.shape[-1]} (hidden's last dim), "
                         f"got shape {tuple(weight.shape)}")
    if bias is not None:
        _runtime.check_tensor("bias", bias)
        _runtime.check_shape("bias", bias, (weight.shape[0],), "weight's first dim V")
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")  # noqa: TRY004 (contract)
    _runtime.check_shape("tokens", tokens, tuple(hidden.shape[:-1]), "hidden's leading dims")
    if tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be int64, got {tokens.dtype}")
    temperature = _runtime.check_real("temperature", temperature, low=0.0, low_open=True,
                                      expected="a finite number > 0")
    if not isinstance(entropy, bool):
        raise ValueError(f"entropy must be a bool, got {entropy!r}")
    if chunk_bytes is None:
        chunk_bytes = DEFAULT_LOG_PROBS_CHUNK_BYTES
    elif isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, numbers.Integral) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    _runtime.check_same_device(hidden=hidden, weight=weight, bias=bias, tokens=tokens)
    compute_dtype = _runtime.autocast_dtype(hidden.device)
    if compute_dtype is None:
        if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
            where = f"hidden {hidden.dtype}, weight {weight.dtype}" + ("" if bias is None else f", bias {bias.dtype}")
            raise ValueError(f"hidden, weight and bias must share one dtype outside torch.autocast, got {where}")
        compute_dtype = hidden.dtype
    shape = tokens.shape
    flat_tokens = tokens.reshape(-1).contiguous()
    try:
        opts, _, flat_tokens, poison = check_options(flat_tokens, weight.shape[0], ignore_index, 0.0, softcap, 0.0,
                                                     "none", None, checks, name="tokens")
    except ValueError as error:  # the shared type checks name "labels"; this op calls them tokens
        raise ValueError(str(error).replace("labels", "tokens")) from None
    _runtime.backend(hidden.device)  # raise configuration errors before any work
    alpha = 1.0 / temperature
    if not math.isfinite(alpha):
        raise ValueError(f"temperature must be a finite number > 0 whose inverse is finite, got {temperature!r}")
    # c tanh(x / c) / T = c' tanh((x / T) / c') with c' = c / T: the kernels softcap the already scaled logits
    opts = Options(opts.ignore_index, 0.0, None if opts.softcap is None else opts.softcap * alpha, 0.0)
    grad_on = torch.is_grad_enabled()
    wants = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    hidden2d = _runtime.as_rows(hidden)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = LinearLogProbsFunction.apply(hidden2d, weight, bias, flat_tokens, opts, alpha, int(chunk_bytes), wants,
                                       compute_dtype, entropy)
    if entropy:
        log_probs, row_entropy = out[0].view(shape), out[1].view(shape)
    else:
        log_probs, row_entropy = out.view(shape), None
    if poison is not None:  # deferred checks: NaN everywhere when a token was bad (docs/design.md)
        log_probs = log_probs + poison
    return (log_probs, row_entropy) if entropy else log_probs
