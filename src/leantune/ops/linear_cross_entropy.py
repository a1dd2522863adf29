r"""Fused linear cross-entropy: the loss of ``hidden @ weight.T + bias`` without ever holding the [N, V] logits.

Value and gradients are those of :func:`leantune.ops.cross_entropy` on ``logits = hidden @ weight.T + bias`` (see
that module for the loss and dl/dlogits). With G = dL/dlogits (already scaled by dL/dloss_row):

    dhidden = G @ weight          dweight = G^T @ hidden          dbias = sum over rows of G

The logits exist only one chunk at a time, in a work buffer leantune owns, sized from a fixed byte budget
(``chunk_bytes``; never from free memory, so peaks and bf16 sums do not depend on what else the card holds). The
matmuls are cuBLAS (``torch.mm``/``addmm`` with ``out=``, fp32 accumulation inside each call); the loss and the
gradient come from cross_entropy's kernel, which overwrites the chunk with its gradient in place.

memory="fast" (default): everything happens in the forward, token chunk by token chunk (rows = chunk_bytes /
    (V * itemsize)): logits_c = h_c W^T + b -> kernel writes loss, lse and G_c = dl/dlogits_c / D in place ->
    dhidden[c] = G_c W, dweight += G_c^T h_c, dbias += sum G_c (fp32). A 16-bit dweight spanning several chunks is
    summed in an fp32 [V, H] buffer (only when the weight requires grad) and cast once at the end, so its error does
    not grow with the chunk count (docs/design.md, "Numerics"). Saved: dhidden [N, H], dweight [V, H], dbias [V]
    (only those that are wanted). Backward multiplies them by the scalar grad_output in place (also when it is 1:
    deciding would read it back, a host sync; x * 1 is exact), so the node supports one backward (a second, with
    retain_graph, raises). 2 N H V multiply-adds in all.
    reduction="none" has one grad_output per row, which dweight needs before its matmul; it runs the "low" path,
    and so do requested ``statistics`` (they read the logits, which this path overwrites with their gradient).
memory="low": the forward computes only loss and lse per token chunk; saved: hidden, weight, bias, labels, lse
    [N] fp32. Backward recomputes the logits (3 N H V multiply-adds in all). With a weight/bias gradient it walks
    vocab tiles of all N rows (columns = chunk_bytes / (N * itemsize)): each dweight/dbias slice is written once
    with the full fp32 reduction over N inside cuBLAS, and dhidden accumulates over tiles in the compute dtype. With
    only dhidden wanted (frozen lm_head, LoRA) it walks token chunks and writes each dhidden row block once.

``statistics`` (entropy, log sum p^2, mean logit, top-1 agreement; cross_entropy's :func:`row_statistics`) are read
from each forward chunk after its loss: one more pass over the chunk, no matmul (a separate no-grad pass would
cost another N H V multiply-adds), fp32 [N] each, without gradient.

Extra peak (beyond inputs and the returned gradients): one chunk buffer (at most 128 MiB fast, 32 MiB low) plus
O(N) fp32 rows; with a trainable 16-bit weight over several chunks, memory="fast" also holds the fp32 dweight sum
(V H 4 bytes, freed after its one cast). Under ``torch.autocast`` hidden, weight and bias are cast to the autocast
dtype first, as HF's ``lm_head`` (an ``nn.Linear``) would be; gradients come back in each input's own dtype.
"""

from __future__ import annotations

import numbers

import torch

from . import _loss_options, _runtime
from ._loss import STATISTICS, check_options, check_statistics, mean_divisor, reduce, row_scale
from .cross_entropy import gradient_rows, loss_rows, row_statistics

MEMORY_MODES = ("fast", "low")
DEFAULT_CHUNK_BYTES = {"fast": 128 * 2**20, "low": 32 * 2**20}


def chunk_length(chunk_bytes: int, bytes_per_item: int, total: int, granule: int = 128) -> int:
    """Rows (or columns) of one logits chunk: as many as ``chunk_bytes`` holds, at least 1, at most ``total``;
    from 2 granules up, rounded down to a multiple of ``granule`` (cuBLAS tiles are 64-256 wide: a 523-row chunk
    pays for 640 rows of tiles in each of its three matmuls, a 512-row one for 512)."""
    length = max(1, min(total, chunk_bytes // bytes_per_item))
    if length < total and length >= 2 * granule:
        length -= length % granule
    return length


def _logits_into(out, hidden, weight, bias, alpha=1.0):
    """out = alpha (hidden @ weight.T (+ bias)), written into leantune's buffer (cuBLAS, fp32 accumulation inside;
    ``alpha`` is applied to the fp32 accumulator, so a temperature costs no pass and no extra rounding)."""
    if alpha == 1.0:
        if bias is None:
            torch.mm(hidden, weight.t(), out=out)
        else:
            torch.addmm(bias, hidden, weight.t(), out=out)
    elif bias is None:  # beta=0: addmm ignores its input (the buffer's old contents, NaN included)
        torch.addmm(out, hidden, weight.t(), beta=0.0, alpha=alpha, out=out)
    else:
        torch.addmm(bias, hidden, weight.t(), beta=alpha, alpha=alpha, out=out)
    return out


# cuBLAS's 16-bit x 16-bit -> fp32 GEMM (``out_dtype``) came with torch 2.8
_MIXED_GEMM = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def _add_product(out, a, b, first):
    """out = a @ b (``first``) or out += a @ b, with the sum in out's dtype. An fp32 ``out`` of 16-bit operands
    takes cuBLAS's fp32 output (no rounding between chunks, no copies) on CUDA; elsewhere (the CPU has no
    mixed-dtype GEMM) the operands are upcast, chunk-sized copies."""
    if out.dtype != a.dtype:
        if a.is_cuda and _MIXED_GEMM:
            if first:
                torch.mm(a, b, out_dtype=out.dtype, out=out)
            else:
                torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            return
        a, b = a.to(out.dtype), b.to(out.dtype)
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _chunked_forward(impl, hidden, weight, bias, labels, opts, chunk_bytes, grad_scale, wants, stats=None,
                     accum_dtype=None):
    """Loss and lse per row over token chunks; with ``grad_scale`` also dhidden/dweight/dbias (see module doc);
    without it, ``stats`` (name -> [N] output, or None) are filled from each chunk. ``accum_dtype``: dweight's
    dtype across chunks (None: fp32 for 16-bit inputs)."""
    n_rows, n_vocab = hidden.shape[0], weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    want_h, want_w, want_b = wants
    loss = _runtime.empty((n_rows,), dtype=torch.float32, device=device)
    lse = _runtime.empty((n_rows,), dtype=torch.float32, device=device)
    dhidden = _runtime.empty(hidden.shape, dtype=dtype, device=device) if want_h else None
    dbias = _runtime.empty((n_vocab,), dtype=torch.float32, device=device).zero_() if want_b else None
    rows = chunk_length(chunk_bytes, n_vocab * hidden.element_size(), max(n_rows, 1))
    # dweight sums one product per chunk: across several chunks a 16-bit sum would round once per chunk (its error
    # growing with the chunk count), so it accumulates in fp32 and is cast once at the end
    # (accum_dtype set to the inputs' dtype: a 16-bit sum, no [V, H] fp32 buffer)
    wide = want_w and dtype != torch.float32 and n_rows > rows and accum_dtype in (None, torch.float32)
    dweight = _runtime.empty(weight.shape, dtype=torch.float32 if wide else dtype, device=device) if want_w else None
    if n_rows == 0:
        if dweight is not None:
            dweight.zero_()
        return loss, lse, dhidden, dweight, dbias
    buffer = _runtime.empty((rows, n_vocab), dtype=dtype, device=device)
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        hidden_c = hidden[start:end]
        logits = _logits_into(buffer[: end - start], hidden_c, weight, bias)
        grad = logits if grad_scale is not None else None
        loss_rows(impl, logits, labels[start:end], opts, loss[start:end], lse[start:end], grad, grad_scale)
        if stats:
            row_statistics(impl, logits, labels[start:end], lse[start:end], opts.softcap,
                           {name: out[start:end] for name, out in stats.items()})
        if want_h:
            torch.mm(logits, weight, out=dhidden[start:end])
        if want_w:
            _add_product(dweight, logits.t(), hidden_c, first=start == 0)
        if want_b:
            dbias += logits.sum(0, dtype=torch.float32)
    if wide:
        dweight = dweight.to(dtype)
    return loss, lse, dhidden, dweight, dbias


def _recompute_backward(impl, hidden, weight, bias, labels, lse, scale, opts, chunk_bytes, wants, alpha=1.0,
                        rows_fn=gradient_rows):
    """dhidden/dweight/dbias from recomputed logits (memory="low", and "none" reductions); ``scale``: 0-dim or [N].
    ``alpha``: the logits the kernels read are alpha (h W^T + b) (ops.linear_log_probs' 1 / temperature); the
    caller folds alpha into ``scale`` for the chain rule. ``rows_fn``: the gradient of a tile, with
    ``gradient_rows``' arguments (``scale`` may then carry more per-row values: [N, k], sliced by rows)."""
    want_h, want_w, want_b = wants
    n_rows, n_vocab = hidden.shape[0], weight.shape[0]
    device, dtype, itemsize = hidden.device, hidden.dtype, hidden.element_size()
    dhidden = _runtime.empty(hidden.shape, dtype=dtype, device=device) if want_h else None
    dweight = _runtime.empty(weight.shape, dtype=dtype, device=device) if want_w else None
    dbias = _runtime.empty((n_vocab,), dtype=torch.float32, device=device) if want_b else None
    if n_rows == 0:
        for t in (dhidden, dweight, dbias):
            if t is not None:
                t.zero_()
        return dhidden, dweight, dbias
    if want_w or want_b:
        # vocab tiles over all rows: each dweight/dbias slice is written once, fully reduced over N
        cols = chunk_length(chunk_bytes, n_rows * itemsize, n_vocab)
        buffer = _runtime.empty((n_rows * cols,), dtype=dtype, device=device)
        for start in range(0, n_vocab, cols):
            end = min(start + cols, n_vocab)
            weight_t = weight[start:end]
            logits = _logits_into(buffer[: n_rows * (end - start)].view(n_rows, end - start), hidden, weight_t,
                                  None if bias is None else bias[start:end], alpha)
            rows_fn(impl, logits, labels, lse, scale, opts, logits, col_offset=start, n_vocab=n_vocab)
            if want_w:
                torch.mm(logits.t(), hidden, out=dweight[start:end])
            if want_b:
                torch.sum(logits, 0, dtype=torch.float32, out=dbias[start:end])
            if want_h:
                if start == 0:
                    torch.mm(logits, weight_t, out=dhidden)
                else:
                    dhidden.addmm_(logits, weight_t)
    elif want_h:
        rows = chunk_length(chunk_bytes, n_vocab * itemsize, n_rows)
        buffer = _runtime.empty((rows, n_vocab), dtype=dtype, device=device)
        for start in range(0, n_rows, rows):
            end = min(start + rows, n_rows)
            logits = _logits_into(buffer[: end - start], hidden[start:end], weight, bias, alpha)
            scale_c = scale if scale.dim() == 0 else scale[start:end]
            rows_fn(impl, logits, labels[start:end], lse[start:end], scale_c, opts, logits)
            torch.mm(logits, weight, out=dhidden[start:end])
    return dhidden, dweight, dbias


def compute_inputs(hidden, weight, bias, compute_dtype):
    """hidden, weight and bias (or None) in the dtype the head's GEMMs run in (autocast's, else hidden's)."""
    return hidden.to(compute_dtype), weight.to(compute_dtype), None if bias is None else bias.to(compute_dtype)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd node of :func:`linear_cross_entropy`.

    fast: saves dhidden, dweight, dbias (those wanted) and the divisor. low (and "none", and with statistics):
    saves hidden, weight, bias, labels, lse [N] fp32 and the divisor. Never an [N, V] tensor. Returns the loss and
    then the requested statistics (not differentiable).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, opts, reduction, divisor, memory, chunk_bytes, wants,
                compute_dtype, statistics, accum_dtype=None):
        impl = _runtime.backend(hidden.device)
        ctx.impl, ctx.opts, ctx.reduction, ctx.chunk_bytes, ctx.wants = impl, opts, reduction, chunk_bytes, wants
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, b = compute_inputs(hidden, weight, bias, compute_dtype)
            fast = memory == "fast" and reduction != "none" and any(wants) and not statistics
            ctx.fast = fast
            # "lse" (internal, for return_z_loss) is the forward's own lse: no statistics pass for it alone
            stats = {name: _runtime.empty((hidden.shape[0],), dtype=torch.bool if name == "is_top1" else torch.float32,
                                          device=hidden.device) for name in STATISTICS} \
                if set(statistics) - {"lse"} else None
            if fast:
                grad_scale = (1.0 / divisor) if reduction == "mean" else torch.ones(
                    (), dtype=torch.float32, device=hidden.device)
                loss, _, dh, dw, db = _chunked_forward(impl, h, w, b, labels, opts, chunk_bytes, grad_scale, wants,
                                                       accum_dtype=accum_dtype)
                ctx.save_for_backward(dh, dw, db)
            else:
                loss, lse, *_ = _chunked_forward(impl, h, w, b, labels, opts, chunk_bytes, None, (False,) * 3,
                                                 stats)
                ctx.save_for_backward(h, w, b, labels, lse, divisor)
        picked = [lse.clone() if name == "lse" else stats[name] for name in statistics] if statistics else []
        ctx.mark_non_differentiable(*picked)
        return (_runtime.distinct_output(reduce(loss, reduction, divisor)), *picked)

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, grad_output, *_statistics):
        if ctx.fast:
            if getattr(ctx, "consumed", False):
                raise RuntimeError("linear_cross_entropy(memory='fast') supports one backward per forward (its "
                                   "gradients are scaled in place); use memory='low' to backward twice")
            ctx.consumed = True
            grads = list(ctx.saved_tensors)
            # always scaled, without reading grad_output back (a host sync): x * 1.0 == x exactly, so a
            # grad_output of 1 gives the same bits; one cheap elementwise pass over each saved gradient
            for g in grads:
                if g is not None:
                    g.mul_(grad_output.to(g.dtype))
        else:
            h, w, b, labels, lse, divisor = ctx.saved_tensors
            scale = row_scale(grad_output, ctx.reduction, divisor)
            with torch.autocast(h.device.type, enabled=False):
                grads = _recompute_backward(ctx.impl, h, w, b, labels, lse, scale, ctx.opts, ctx.chunk_bytes,
                                            ctx.wants)
        out = [None if g is None or dt is None else g.to(dt) for g, dt in zip(grads, ctx.dtypes)]
        return (*out, None, None, None, None, None, None, None, None, None, None)


def linear_cross_entropy(hidden, weight, labels, bias=None, *, memory="fast", ignore_index=-100,
                         label_smoothing=0.0, softcap=None, z_loss=0.0, reduction="mean", num_items=None,
                         chunk_bytes=None, statistics=(), checks="eager", ce_weight=None, use_token_scaling=False,
                         return_token_accuracy=False, return_z_loss=False, accum_dtype=None):
    """``cross_entropy(hidden @ weight.T + bias, labels, ...)`` without an [N, V] tensor; grads for all three.

    Args:
        hidden: ``[N, H]`` float32/float16/bfloat16 (HF's final hidden states, flattened).
        weight: ``[V, H]`` (the lm_head / tied embedding), hidden's dtype unless under ``torch.autocast``.
        labels: ``[N]`` int64 in ``[0, V)`` or ``ignore_index`` (already shifted, as HF's loss does).
        bias: ``[V]`` or None.
        memory: ``"fast"`` (gradients formed in the forward; saves dhidden/dweight/dbias) or ``"low"`` (logits
            recomputed in backward; saves hidden and lse, smallest peak).
        ignore_index, label_smoothing, softcap, z_loss, reduction, num_items, checks: as
            :func:`leantune.ops.cross_entropy` (``checks="deferred"``: no host sync anywhere in forward or backward).
        chunk_bytes: byte budget of the logits work buffer (default 128 MiB for "fast", 32 MiB for "low"); it fixes
            the token-chunk rows (chunk_bytes / (V * itemsize)) or vocab-tile columns (chunk_bytes / (N * itemsize)),
            rounded down to a multiple of 128 from 256 up (:func:`chunk_length`).
        statistics: names from ``("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")``: per-row statistics of
            softmax(z) for logging (entropy -sum p log p, log sum p^2, mean z, argmax z == label; formulas in
            :mod:`leantune.ops.cross_entropy`), read from the forward's logits chunks (the "low" path runs).
        ce_weight, use_token_scaling, return_z_loss, return_token_accuracy: Liger's options (formulas:
            :mod:`._loss_options`): ``ce_weight`` ``[V]`` per-class weights as torch's ``F.cross_entropy(weight=)``
            (hidden's device); ``use_token_scaling`` multiplies each row's loss by its detached softmax(z)[label];
            ``return_z_loss`` also returns the z-loss part of the loss (detached); ``return_token_accuracy`` the
            top-1 accuracy over valid rows (0-dim fp32), last. Any of them runs the "low" path (per-row gradient
            scales); off, nothing changes.
        accum_dtype: dtype of dweight's sum over token chunks in the "fast" path: None (default) or torch.float32
            sum in fp32 (16-bit inputs: cast once at the end), the compute dtype sums in it (no ``[V, H]`` fp32
            buffer; one rounding per chunk). The "low" path forms each dweight tile in one matmul over all rows
            (no sum over chunks), so it does not apply there; dbias always sums in fp32.

    Returns:
        float32 loss: 0-dim, or ``[N]`` for ``"none"``. Gradients for hidden, and for weight/bias when they require
        grad, in their own dtypes. With ``statistics``: ``(loss, {name: [N] tensor})``, fp32 (``is_top1`` bool),
        without gradient. With ``return_z_loss`` / ``return_token_accuracy``: a tuple ``(loss, [statistics],
        [z_loss], [accuracy])`` holding those asked for, in that order.

    Raises:
        ValueError: non-float or mismatched dtypes (outside autocast), wrong shapes (hidden not 2-D, weight not
            ``[V, H]``, bias not ``[V]``, labels not ``[N]`` int64), tensors on different devices, an unknown
            ``memory``, ``chunk_bytes`` not a positive int, ``statistics`` not a tuple of known names, ``accum_dtype``
            not None, torch.float32 or the compute dtype, Liger's options out of their domain, and every
            error of :func:`cross_entropy`.
        RuntimeError: ``LEANTUNE_BACKEND=triton`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    kwargs = dict(memory=memory, ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
                  z_loss=z_loss, reduction=reduction, num_items=num_items, chunk_bytes=chunk_bytes,
                  statistics=statistics, checks=checks, accum_dtype=accum_dtype)
    if (ce_weight is not None or use_token_scaling is not False or return_token_accuracy is not False
            or return_z_loss is not False):
        return _with_options(hidden, weight, labels, bias, ce_weight=ce_weight, use_token_scaling=use_token_scaling,
                             return_token_accuracy=return_token_accuracy, return_z_loss=return_z_loss, **kwargs)
    return _linear_cross_entropy(hidden, weight, labels, bias, **kwargs)


def _linear_cross_entropy(hidden, weight, labels, bias, *, memory, ignore_index, label_smoothing, softcap, z_loss,
                          reduction, num_items, chunk_bytes, statistics, checks, accum_dtype=None, lse=False):
    """:func:`linear_cross_entropy` without Liger's options; ``lse``: also return the rows' fp32 lse as the
    statistic "lse" (for ``return_z_loss``)."""
    _runtime.check_tensor("hidden", hidden)
    _runtime.check_tensor("weight", weight)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V, H] with V > 0 and H = {hidden.shape[1]} (hidden's last dim), "
                         f"got shape {tuple(weight.shape)}")
    if bias is not None:
        _runtime.check_tensor("bias", bias)
        _runtime.check_shape("bias", bias, (weight.shape[0],), "weight's first dim V")
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {MEMORY_MODES}, got {memory!r}")
    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES[memory]
    elif isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, numbers.Integral) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    statistics = check_statistics(statistics) + (("lse",) if lse else ())
    _runtime.check_same_device(hidden=hidden, weight=weight, bias=bias,
                               labels=labels if isinstance(labels, torch.Tensor) else None)
    compute_dtype = _runtime.autocast_dtype(hidden.device)
    if compute_dtype is None:
        if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
            where = f"hidden {hidden.dtype}, weight {weight.dtype}" + ("" if bias is None else f", bias {bias.dtype}")
            raise ValueError(f"hidden, weight and bias must share one dtype outside torch.autocast, got {where}")
        compute_dtype = hidden.dtype
    if accum_dtype not in (None, torch.float32, compute_dtype):
        raise ValueError(f"accum_dtype must be None, torch.float32 or the compute dtype {compute_dtype}, got "
                         f"{accum_dtype!r}")
    if isinstance(labels, torch.Tensor):  # shape first: the range check reads the labels
        _runtime.check_shape("labels", labels, (hidden.shape[0],), "hidden's first dim N")
    opts, n_valid, labels, poison = check_options(labels, weight.shape[0], ignore_index, label_smoothing, softcap,
                                                  z_loss, reduction, num_items, checks)
    _runtime.backend(hidden.device)  # raise configuration errors before any work
    grad_on = torch.is_grad_enabled()
    wants = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    labels = labels.contiguous()
    divisor = mean_divisor(n_valid, reduction, num_items, labels.device)
    loss, *stats = LinearCrossEntropyFunction.apply(hidden, weight, bias, labels, opts, reduction, divisor, memory,
                                                    int(chunk_bytes), wants, compute_dtype, statistics, accum_dtype)
    if poison is not None:
        loss = loss + poison
    return (loss, dict(zip(statistics, stats))) if statistics else loss


def _with_options(hidden, weight, labels, bias, *, reduction, num_items, statistics, ce_weight, use_token_scaling,
                  return_token_accuracy, return_z_loss, **kwargs):
    """Liger's options on the op's rows (:mod:`._loss_options`)."""
    for name, value in (("return_token_accuracy", return_token_accuracy), ("return_z_loss", return_z_loss)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    _runtime.check_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    _loss_options.check_extras(labels, weight.shape[0], ce_weight, "ce_weight", use_token_scaling,
                               kwargs["label_smoothing"], kwargs["z_loss"])
    _loss_options.check_reduction(reduction, num_items, hidden.device)
    asked = check_statistics(statistics)
    wanted = (asked + (("is_top1",) if return_token_accuracy and "is_top1" not in asked else ())
)
    out = _linear_cross_entropy(hidden, weight, labels, bias, reduction="none", num_items=None, statistics=wanted,
                                lse=return_z_loss, **kwargs)
    rows, stats = out if wanted or return_z_loss else (out, {})
    loss = _loss_options.reduce_rows(rows, labels, kwargs["ignore_index"], reduction, num_items, ce_weight,
                                     use_token_scaling)
    result = (loss, {name: stats[name] for name in asked}) if asked else (loss,)
    if return_z_loss:
        result += (_loss_options.z_loss_term(stats["lse"], labels, kwargs["ignore_index"], kwargs["z_loss"],
                                             reduction, num_items),)
    if return_token_accuracy:
        result += (_loss_options.token_accuracy(stats["is_top1"], labels, kwargs["ignore_index"]),)
    return result if len(result) > 1 else result[0]

