r"""Rotary position embedding (RoPE) for q and k in one launch, with the true adjoint as backward.

Forward (Su et al. 2021, "RoFormer"; HF's rotate-half convention, transformers' ``apply_rotary_pos_emb``). Per
(batch b, position s, head), on the first R = rotary_dim dims of a head, with h = R / 2 and the halves
x1 = x[:h], x2 = x[h:R], c1 = cos[:h], c2 = cos[h:R], s1 = sin[:h], s2 = sin[h:R], in fp32:

    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = [-x2, x1]
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    y[R:] = x[R:]                          (partial rotary: the remaining dims pass through)

The result is rounded once to promote(x, cos, sin), the dtype HF's expression returns (HF rounds three times in
low precision, so the two agree within rounding).

Backward. y is linear in x, so dx is the transpose of that map applied to dy:

    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1              i.e.  dx = dy * cos - rotate_half(dy * sin)
    dx[R:] = dy[R:]

This holds for any cos/sin. When the halves are duplicated (c1 = c2, s1 = s2, as HF builds them) it is the rotation
by -theta, but this kernel never assumes that. The backward is the forward formula with (s1, s2) replaced by
(-s2, -s1), so one kernel serves both directions (``BACKWARD`` flag).

Saved for backward: cos and sin only (never q or k). cos/sin are treated as constants: they get no gradient,
and passing ones that require grad raises. One program handles one (b, s) row and a block of q heads and a block of
k heads: it loads that row's cos/sin once and reuses them for every head, and reads and writes each q/k element
once. q, k, the upstream gradients and cos/sin may have any strides, e.g. q/k as views of a packed qkv projection.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _launch, _runtime

MAX_TILE_ELEMENTS = 4096  # elements of one tensor a program holds at once (a head block of q, or one of k)


# ------------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _load_heads(
    X, b, s, head_start, n_heads, stride_xb, stride_xh, stride_xs, half, rotary_dim, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """Heads [head_start, head_start + BLOCK_H) of one (b, s) row (unit stride along the head dim): the two rotary
    halves in fp32 and the pass-through dims >= rotary_dim as stored (all masked off when rotary_dim == head_dim)."""
    heads = (head_start + tl.arange(0, BLOCK_H)).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    pass_cols = rotary_dim + tl.arange(0, BLOCK_PASS)
    head_mask = (heads < n_heads)[:, None]
    mask = head_mask & (cols < half)[None, :]
    x_row = X + b * stride_xb + s * stride_xs + heads[:, None] * stride_xh
    x1 = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (cols[None, :] + half), mask=mask, other=0.0).to(tl.float32)
    pass_mask = head_mask & (pass_cols < head_dim)[None, :]
    x_pass = tl.load(x_row + pass_cols[None, :], mask=pass_mask, other=0.0)
    return x1, x2, x_pass


@triton.jit
def _store_heads(
    Y, y1, y2, y_pass, b, s, head_start, n_heads, stride_yb, stride_yh, stride_ys, half, rotary_dim,
    head_dim, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """Store what :func:`_load_heads` read (rotated) into Y, each value rounded once to Y's dtype."""
    heads = (head_start + tl.arange(0, BLOCK_H)).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    pass_cols = rotary_dim + tl.arange(0, BLOCK_PASS)
    head_mask = (heads < n_heads)[:, None]
    mask = head_mask & (cols < half)[None, :]
    y_row = Y + b * stride_yb + s * stride_ys + heads[:, None] * stride_yh
    tl.store(y_row + cols[None, :], y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + (cols[None, :] + half), y2.to(Y.dtype.element_ty), mask=mask)
    pass_mask = head_mask & (pass_cols < head_dim)[None, :]
    tl.store(y_row + pass_cols[None, :], y_pass.to(Y.dtype.element_ty), mask=pass_mask)


@_launch.bound
@triton.jit
def _rope_kernel(
    Q, K, Q_OUT, K_OUT, COS, SIN,
    seq_len, n_q_heads, n_k_heads, half, rotary_dim, head_dim,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_qob, stride_qoh, stride_qos,
    stride_kob, stride_koh, stride_kos,
    stride_cb, stride_cs,
    BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * seq_len + s
    head_block = tl.program_id(1)
    b = row // seq_len
    s = row - b * seq_len
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    # one load of this row's cos/sin serves every head of the program (stride_cb = 0 for [S, R] or batch 1);
    # the launcher gives cos and sin one layout with unit stride along R
    cos_row = COS + b * stride_cb + s * stride_cs
    sin_row = SIN + b * stride_cb + s * stride_cs
    c1 = tl.load(cos_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + (cols + half), mask=col_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + (cols + half), mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:  # the adjoint is the forward map with (s1, s2) -> (-s2, -s1)
        s1, s2 = -s2, -s1
    q_start = head_block * BLOCK_HQ
    k_start = head_block * BLOCK_HK
    # every load before any store: the compiler cannot know the outputs do not alias the inputs
    q1, q2, q_pass = _load_heads(
        Q, b, s, q_start, n_q_heads, stride_qb, stride_qh, stride_qs, half, rotary_dim, head_dim,
        BLOCK_HQ, BLOCK_HALF, BLOCK_PASS,
    )
    k1, k2, k_pass = _load_heads(
        K, b, s, k_start, n_k_heads, stride_kb, stride_kh, stride_ks, half, rotary_dim, head_dim,
        BLOCK_HK, BLOCK_HALF, BLOCK_PASS,
    )
    _store_heads(
        Q_OUT, q1 * c1 - q2 * s1, q2 * c2 + q1 * s2, q_pass, b, s, q_start, n_q_heads,
        stride_qob, stride_qoh, stride_qos, half, rotary_dim, head_dim, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS,
    )
    _store_heads(
        K_OUT, k1 * c1 - k2 * s1, k2 * c2 + k1 * s2, k_pass, b, s, k_start, n_k_heads,
        stride_kob, stride_koh, stride_kos, half, rotary_dim, head_dim, BLOCK_HK, BLOCK_HALF, BLOCK_PASS,
    )


# ----------------------------------------------------------------------------------------------------- launchers
def _cos_sin_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, seq) strides of cos/sin (unit stride along R); batch stride 0 for [S, R] and a broadcast batch of 1."""
    if t.dim() == 2:
        return 0, t.stride(0)
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim has unit stride (the kernels' assumption, true for HF's q/k views), else a copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=256)
def _launch_shape(n_q_heads, n_k_heads, head_dim, rotary_dim):
    """(half, n_blocks, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_PASS, num_warps) for one head configuration (a few
    per model: computed once, not per launch)."""
    half = rotary_dim // 2
    block_half = _runtime.next_power_of_2(half)
    block_pass = _runtime.next_power_of_2(head_dim - rotary_dim)  # 1 (masked off) without pass-through dims
    per_head = 2 * block_half + (block_pass if head_dim > rotary_dim else 0)
    max_heads = 1 << max(0, (MAX_TILE_ELEMENTS // per_head).bit_length() - 1)  # a power of two, >= 1
    n_blocks = max(_runtime.cdiv(n_q_heads, max_heads), _runtime.cdiv(n_k_heads, max_heads))
    block_hq = _runtime.next_power_of_2(_runtime.cdiv(n_q_heads, n_blocks))
    block_hk = _runtime.next_power_of_2(_runtime.cdiv(n_k_heads, n_blocks))
    num_warps = _runtime.num_warps_for(max(block_hq, block_hk) * per_head)
    return half, n_blocks, block_hq, block_hk, block_half, block_pass, num_warps


def _rope_triton(q, k, q_out, k_out, cos, sin, backward):
    """One launch: q -> q_out and k -> k_out (either pair may be None: no heads of that tensor)."""
    ref = q if q is not None else k
    if ref is None:
        return
    batch, _, seq_len, head_dim = ref.shape
    n_q_heads = 0 if q is None else q.shape[1]
    n_k_heads = 0 if k is None else k.shape[1]
    if batch * seq_len == 0 or n_q_heads + n_k_heads == 0:
        return
    rotary_dim = cos.shape[-1]
    half, n_blocks, block_hq, block_hk, block_half, block_pass, num_warps = _launch_shape(
        n_q_heads, n_k_heads, head_dim, rotary_dim)
    # an absent tensor: 0 heads, its pointers/strides borrowed from the other one (never dereferenced)
    q, q_out = (_unit_last(q), q_out) if q is not None else (k, k_out)
    k, k_out = (_unit_last(k), k_out) if k is not None else (q, q_out)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():  # one stride set for both (few arguments: cheap launch)
        cos, sin = cos.contiguous(), sin.contiguous()
    _rope_kernel[(batch * seq_len, n_blocks)](
        q, k, q_out, k_out, cos, sin,
        seq_len, n_q_heads, n_k_heads, half, rotary_dim, head_dim,
        *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3], *_cos_sin_strides(cos),
        BACKWARD=backward, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        num_warps=num_warps,
    )


def _rope_torch(q, k, q_out, k_out, cos, sin, backward):
    """The same formulas in torch (fp32, one rounding at the copy into the output)."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    c = cos.float()[:, None] if cos.dim() == 3 else cos.float()[None, None]  # [B or 1, 1, S, R]
    sn = sin.float()[:, None] if sin.dim() == 3 else sin.float()[None, None]
    c1, c2 = c[..., :half], c[..., half:]
    s1, s2 = sn[..., :half], sn[..., half:]
    if backward:
        s1, s2 = -s2, -s1
    for x, out in ((q, q_out), (k, k_out)):
        if x is None:
            continue
        x1, x2 = x[..., :half].float(), x[..., half:rotary_dim].float()
        out[..., :half] = x1 * c1 - x2 * s1
        out[..., half:rotary_dim] = x2 * c2 + x1 * s2
        out[..., rotary_dim:] = x[..., rotary_dim:]


def _layout(x: torch.Tensor) -> tuple[int, ...]:
    """Order of x's first three dims from outermost to innermost stride; the head dim stays innermost."""
    if torch.compiler.is_compiling():  # symbolic strides (dynamic shapes): no cache, no sorted(key=...)
        return _order(x.stride()[:3])
    return _layout_of(x.stride()[:3])


@functools.lru_cache(maxsize=256)
def _layout_of(strides: tuple[int, ...]) -> tuple[int, ...]:
    return _order(strides)


def _order(strides) -> tuple[int, ...]:
    """The dims by descending stride, ties in dim order (a stable insertion sort: plain comparisons, which
    torch.compile traces on symbolic strides), then the head dim."""
    order = [0, 1, 2]
    for i in (1, 2):
        j = i
        while j > 0 and strides[order[j - 1]] < strides[order[j]]:
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    return (*order, 3)


@functools.lru_cache(maxsize=64)
def _inverse(layout: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(layout.index(d) for d in range(4))


def _out_dtype(x, cos, sin) -> torch.dtype:
    """The dtype of HF's ``x * cos + rotate_half(x) * sin``: torch's promotion of the three."""
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def _empty_in_layout(shape, layout, dtype, device) -> torch.Tensor:
    """A [B, H, S, D] buffer from the allocator, laid out in memory in ``layout`` order (as x was: no copies
    downstream, e.g. a gradient flowing back into a packed qkv view stays contiguous there)."""
    buf = _runtime.empty([shape[d] for d in layout], dtype=dtype, device=device)
    return buf.permute(_inverse(layout))


# ------------------------------------------------------------------------------------------------ autograd + API
class RoPEFunction(torch.autograd.Function):
    """Autograd node of :func:`rope`; saves cos and sin only. No ``torch.amp.custom_fwd``/``custom_bwd``: nothing
    here is autocast-eligible (output dtypes follow promote(x, cos, sin) either way), and re-entering autocast in
    backward cost host time on every call."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, impl):
        q_meta = (q.shape, _layout(q), q.dtype)
        k_meta = (k.shape, _layout(k), k.dtype)
        q_out = _empty_in_layout(q.shape, q_meta[1], _out_dtype(q, cos, sin), q.device)
        k_out = _empty_in_layout(k.shape, k_meta[1], _out_dtype(k, cos, sin), k.device)
        rotate = _rope_triton if impl == "triton" else _rope_torch
        rotate(q, k, q_out, k_out, cos, sin, False)
        ctx.save_for_backward(cos, sin)
        ctx.impl = impl
        ctx.meta = (q_meta, k_meta)
        return _runtime.distinct_output(q_out), _runtime.distinct_output(k_out)

    @staticmethod
    @_runtime.first_derivative_only
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        grads = []
        for wanted, (shape, layout, dtype) in zip(ctx.needs_input_grad[:2], ctx.meta):
            grads.append(_empty_in_layout(shape, layout, dtype, cos.device) if wanted else None)
        dq, dk = grads
        rotate = _rope_triton if ctx.impl == "triton" else _rope_torch
        rotate(dq_out if dq is not None else None, dk_out if dk is not None else None, dq, dk, cos, sin, True)
        return dq, dk, None, None, None


def rope(q, k, cos, sin):
    """Rotary position embedding of q and k (HF rotate-half convention), one kernel launch for both.

    ``y = x * cos + rotate_half(x) * sin`` on the first R dims of every head, dims >= R copied; the same value as
    transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (Llama and the families that reuse it) within rounding:
    computed in fp32 and rounded once, where HF rounds three times in low precision. Backward is the true adjoint
    ``dx = dy * cos - rotate_half(dy * sin)`` for any cos/sin; only cos and sin are saved.

    Args:
        q: ``[B, Hq, S, D]`` float32/float16/bfloat16, any strides (e.g. a transposed view of a packed qkv output).
        k: ``[B, Hk, S, D]`` float, any strides; Hk may differ from Hq (GQA/MQA).
        cos: ``[B, S, R]`` (per-row positions; a batch of 1 broadcasts) or ``[S, R]``, float32/float16/bfloat16; R even,
            0 < R <= D. Treated as a constant: it gets no gradient.
        sin: same shape as ``cos``.

    Returns:
        ``(q_out, k_out)``: new tensors of q's and k's shapes, each of dtype ``promote(x, cos, sin)`` (as HF's
        expression), laid out in memory as the input was (head dim innermost). q and k are never modified.

    Raises:
        ValueError: q or k not 4-D, or not float32/float16/bfloat16; k's batch, sequence or head dim differing from
            q's; cos/sin not 2-D or 3-D, of different shapes, not float, with a sequence length other than q's, a
            batch other than q's or 1, R odd, zero or > D; cos or sin requiring grad (no gradient is computed for
            them); tensors on different devices.
        RuntimeError: ``LEANTUNE_BACKEND=triton`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _runtime.check_tensor(name, t)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {tuple(t.shape)}")
    batch, _, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(
            f"k must be [B, Hk, S, D] with q's B={batch}, S={seq_len}, D={head_dim}, got shape {tuple(k.shape)}"
        )
    if cos.dim() not in (2, 3):
        raise ValueError(f"cos must be [B, S, R] or [S, R], got shape {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if cos.shape[-2] != seq_len:
        raise ValueError(f"cos/sin sequence length must be q's S={seq_len}, got shape {tuple(cos.shape)}")
    if cos.dim() == 3 and cos.shape[0] not in (1, batch):
        raise ValueError(f"cos/sin batch must be q's B={batch} or 1, got shape {tuple(cos.shape)}")
    rotary_dim = cos.shape[-1]
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos/sin last dim R (rotary_dim) must be even and in [2, D={head_dim}], got {rotary_dim}"
        )
    _runtime.check_same_device(q=q, k=k, cos=cos, sin=sin)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("cos and sin must not require grad: rope treats them as constants (no gradient for them)")
    impl = _runtime.backend(q.device)  # configuration errors raised before any work
    return RoPEFunction.apply(q, k, cos, sin, impl)
