r"""FP8 (e4m3) frozen weights: row-wise quantisation and the two frozen GEMMs of a LoRA step, y = x W^T and dX = dY W.

Format. ``float8_e4m3fn``: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities, largest finite 448, smallest
normal 2^-6, subnormal spacing 2^-9. A tensor T ``[R, C]`` is quantised row by row (weights: per output channel,
activations and gradients: per token):

    s_r   = max(absmax_r / 448, 2^-126)                     (fp32; the floor keeps an all-zero row finite: its q = 0)
    q_rc  = e4m3(clamp(T_rc / s_r, -448, 448))              (fp32 division, round to nearest even, saturating)
    T_rc ~= s_r q_rc

The two GEMMs, weight W ``[out, in]`` ~= diag(s_w) Wq:

    y  = x W^T  ~= diag(s_x) (xq Wq^T) diag(s_w)                                   (reduces over in)
    dX = dY W   = (dY diag(s_w)) Wq ~= diag(s_g) (gq Wq),   g = dY diag(s_w)       (reduces over out)

The output-channel scales of W sit on the reduction index of dX, so they do not factor out of that GEMM; they fold
into dY instead (one fp32 product per element, inside the pass that quantises dY per token anyway). One FP8 copy of
the weight and one scale vector serve both GEMMs: no per-input-channel scales, block scales or second copy.

Error bound (docs/design.md, "FP8 frozen weights"). With u = 2^-4 (3 mantissa bits, round to nearest) an element
rounds to v (1 + d) + e with |d| <= u and |e| <= 2^-10 s (half the subnormal spacing, in the row's scale). The
products of two e4m3 values are exact in fp32, and the K-long sum accumulates in fp32 (relative 2^-24 per add), so

    |y_mn - (x W^T)_mn| <= (2u + u^2 + K 2^-24) sum_k |x_mk| |W_nk| + 2^-10 (1 + u) (s_x_m sum_k |W_nk|
                           + s_w_n sum_k |x_mk|) + 2^-20 K s_x_m s_w_n

(the rounding of the output to a 16-bit dtype comes on top: 2^-8 |y| for bf16).

Implementations (one arithmetic). CUDA on the Triton backend: ``torch._scaled_mm`` with row-wise scales (scale_a
``[M, 1]``, scale_b ``[1, N]``, fp32, contiguous). Its CUDA path takes only a row-major mat1 and a column-major mat2
(both K-contiguous, the only FP8 tensor-core layout on Hopper) with K and mat2's dims multiples of 16. For y that is
free: mat2 = Wq^T is a view of the row-major Wq. For dX mat2 = Wq must be [out, in] column-major, i.e. Wq^T stored
row-major: backward makes that transposed copy of the e4m3 weight (1 B read + 1 B written per weight) into a
workspace reused per shape, then runs ``_scaled_mm`` with scale_b = 1 (the weight's scales are in g). Persisting the
copy would double the weight bytes (16 GiB at 8B); dequantising to bf16 for a bf16 dX would cost 1 + 2 B per weight
and the GEMM at bf16 rate. The row-wise kernel writes bf16; fp16/fp32 compute dtypes get a cast. Elsewhere (CPU, the
torch backend): the same quantisation, and the GEMM as fp32 matmuls of the e4m3 values (exact products), scaled
after: what CI proves.

Kernels (Triton backend: CUDA, or the interpreter on the CPU). The pieces around the GEMMs are two Triton kernels;
the torch backend keeps the torch chains, which are the reference the kernels equal bit for bit
(tests/test_fp8_kernels.py):
- ``_quantize_rows_kernel``: s and q above in one pass over t (any strides; rows up to 8192 wide stay in registers,
  wider ones loop twice over 2048-column blocks: ``QUANT_ONE_BLOCK``, measured). With a column multiplier m it
  quantises t diag(m) formed in registers: :func:`quantize_grad_output`, g = dY diag(s_w) without an fp32 copy of
  dY. The fp32 division is ``tl.math.div_rn`` (Triton's ``/`` is approximate on the card); the absmax reduction
  and the clamp propagate NaN explicitly; the rounding to e4m3 is the hardware conversion on the card and integer
  arithmetic on the quotient's bits under the interpreter (Triton 3.6's interpreter casts fp32 to float8e4nv
  wrongly: ties away from zero, lost mantissa carries, truncated subnormals; ``_fp8_rows``), and bf16 inputs
  are read as their bits (a 16-bit shift is the exact fp32 value). The sm_90 PTX (compiled on the CPU by
  tests/test_fp8_kernels.py) has ``div.rn.f32``, ``mul.f32`` and ``abs.f32`` without
  ``.ftz`` (fp32 subnormals kept, as torch keeps them), ``max.NaN.f32`` and 128-bit loads and stores.
- ``_quantize_rows_absmax_kernel``: the same codes when the kernel that wrote t left its row absmaxes in parts
  (the LoRA MLP's fused gate/up pass, :mod:`leantune.ops.lora.glu_lowrank`): one read of t instead of two.
- ``_transpose_kernel``: Wq^T into the reused workspace in 128 x 128 byte tiles (or into a column block of a
  wider one: a group's stacked [Wq_1; ...; Wq_k]^T).

Groups (q/k/v, gate/up: one dX GEMM for projections of one x): :mod:`leantune.ops.fp8_group`.
Bytes (predicted times at 4 TB/s, not yet measured on the card; the torch chains measured 0.242 ms for quant x at
4096 x 4096 and 0.347 ms for the W^T copy of 14336 x 4096): quantising a bf16 [M, C] moves 3 B per element (2 read,
1 written) + 4 B per row, 0.013 ms at 4096 x 4096 and 0.044 ms at 4096 x 14336; the fused dY quantisation the same
+ 4 B per column; the transpose 2 B per weight, 0.008 ms for 4096 x 4096 and 0.029 ms for 14336 x 4096.

Fused activation quantisation. :func:`fp8_linear` takes an already quantised activation (``x_quantized=(x_fp8,
x_scale)``); the RMSNorm (``ops.rms_norm(..., fp8_out=True)``) and GLU kernels (``glu_forward(..., fp8_out=True)``,
the LoRA MLP's fused gate/up pass) write those codes of their output in the same pass, with the jit pieces of
:mod:`leantune.ops._fp8_rows` (bit for bit :func:`quantize_rows` of the stored output), and a patched model hands
them on (:mod:`leantune.patch.fp8_inputs`). Inputs no kernel of ours makes (o_proj's, from SDPA) keep the separate
pass here.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import _launch, _runtime
from ._fp8_rows import _load_fp32, _max_propagating_nan, _row_scales, _store_codes

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_FLOOR = 2.0 ** -126  # smallest normal fp32: an all-zero row's scale
_transposed_workspaces: dict[tuple, torch.Tensor] = {}
_ones: dict[tuple, torch.Tensor] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class FP8Weight:
    """A frozen linear weight W ``[out, in]`` ~= diag(scale) qweight (module docstring).

    Fields:
        qweight: ``float8_e4m3fn [out, in]``, contiguous.
        scale: fp32 ``[out]``, one per output channel (absmax / 448).
        dtype: the dtype W had (fp32/fp16/bf16): the compute dtype the fused ops give its outputs.
        name: what error messages call the weight.

    Raises (at construction):
        ValueError: a field of the wrong dtype, shape, layout or device (the message names the field).
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    name: str = dataclasses.field(default="weight", compare=False)

    def __post_init__(self):
        q, s = self.qweight, self.scale
        if not isinstance(q, torch.Tensor) or q.dtype != E4M3 or q.dim() != 2 or not q.is_contiguous():
            got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"{self.name}: qweight must be a contiguous 2-D float8_e4m3fn tensor, got {got}")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (q.shape[0],):
            got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"{self.name}: scale must be a float32 tensor of shape ({q.shape[0]},), got {got}")
        if s.device != q.device:
            raise ValueError(f"{self.name}: scale is on {s.device} but qweight on {q.device}")
        if self.dtype not in _runtime.FLOAT_DTYPES:
            raise ValueError(f"{self.name}: dtype must be float32, float16 or bfloat16, got {self.dtype}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        """Bytes held: 1 per weight plus 4 per output channel."""
        return self.qweight.numel() + 4 * self.scale.numel()

    def to(self, device) -> FP8Weight:
        """The same weight on ``device``."""
        return dataclasses.replace(self, qweight=self.qweight.to(device), scale=self.scale.to(device))


# ------------------------------------------------------------------------------------------------------ kernels

@triton.jit
def _column_blocks(absmax, Q, T, M, scale, rows, row_mask, stride_row, stride_col, n_cols, q_cols,
                   BF16_BITS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, BLOCK: tl.constexpr, CODES: tl.constexpr):
    # a row too wide for registers, in column blocks: its absmax into ``absmax`` (returned), or (CODES) its codes
    # into Q (rows q_cols apart; a group's part writes its column block)
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        block_cols = start + cols
        mask = row_mask[:, None] & (block_cols < n_cols)[None, :]
        x = _load_fp32(T, M, rows, block_cols, mask, stride_row, stride_col, n_cols, BF16_BITS, HAS_MULTIPLIER)
        if CODES:
            _store_codes(Q, x, scale, rows, block_cols, mask, q_cols)
        else:
            absmax = tl.maximum(absmax, tl.reduce(tl.abs(x), 1, _max_propagating_nan),
                                propagate_nan=tl.PropagateNan.ALL)
    return absmax


@_launch.bound
@triton.jit
def _quantize_rows_kernel(
    T, M, Q, S,
    stride_row, stride_col, n_rows, n_cols,
    BF16_BITS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    # s_r = max(absmax_r / 448, 2^-126), q_rc = e4m3(clamp(t_rc / s_r, -448, 448)) for a [ROWS, n_cols] slab; with
    # a multiplier t = x diag(m). One block: the row stays in registers (one read); wider rows loop over column
    # blocks twice (absmax, then quantise: the second read mostly hits L2).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = _load_fp32(T, M, rows, cols, mask, stride_row, stride_col, n_cols, BF16_BITS, HAS_MULTIPLIER)
        absmax = tl.reduce(tl.abs(x), 1, _max_propagating_nan)
    else:
        absmax = tl.zeros([ROWS], dtype=tl.float32)
        absmax = _column_blocks(absmax, Q, T, M, absmax, rows, row_mask, stride_row, stride_col, n_cols, n_cols,
                                BF16_BITS, HAS_MULTIPLIER, BLOCK, False)
    scale = _row_scales(absmax)
    tl.store(S + rows, scale, mask=row_mask)
    if ONE_BLOCK:
        _store_codes(Q, x, scale, rows, cols, mask, n_cols)
    else:
        _column_blocks(scale, Q, T, M, scale, rows, row_mask, stride_row, stride_col, n_cols, n_cols, BF16_BITS,
                       HAS_MULTIPLIER, BLOCK, True)


@_launch.bound
@triton.jit
def _quantize_rows_absmax_kernel(
    T, A, Q, S, stride_row, n_rows, n_cols, n_parts,
    BF16_BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, PARTS: tl.constexpr,
):
    # quantize_rows of t (unit column stride) when the kernel that wrote t left each row's absmax in parts:
    # A [n_rows, n_parts] (the max over a row's parts is its absmax, exactly); one read of t instead of two
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    parts = tl.arange(0, PARTS)
    partial = tl.load(A + rows[:, None] * n_parts + parts[None, :],
                      mask=row_mask[:, None] & (parts < n_parts)[None, :], other=0.0)
    scale = _row_scales(tl.reduce(partial, 1, _max_propagating_nan))
    tl.store(S + rows, scale, mask=row_mask)
    _column_blocks(scale, Q, T, S, scale, rows, row_mask, stride_row, 1, n_cols, n_cols, BF16_BITS, False, BLOCK,
                   True)


@_launch.bound
@triton.jit
def _transpose_kernel(W, WT, n_rows, n_cols, stride_out, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # WT[c, r] = W[r, c] for one [BLOCK_R, BLOCK_C] tile (bytes: the e4m3 codes as uint8); WT's rows stride_out
    # apart (n_rows, or wider: a column block of a group's workspace)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    tile = tl.load(W + rows[:, None] * n_cols + cols[None, :], mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :])
    tl.store(WT + cols[:, None] * stride_out + rows[None, :], tl.trans(tile),
             mask=(cols < n_cols)[:, None] & (rows < n_rows)[None, :])


# ---------------------------------------------------------------------------------------------------- quantisation
MAX_ONE_BLOCK = 16384  # widest row a fused kernel (ops.glu) holds in registers (14336, the MLP width, fits)
# The row quantiser's launch, from device times on the H200 (2026-12-04, benchmarks/lora_probe.py, 4096 rows, dY with
# W's scales): rows up to QUANT_ONE_BLOCK wide in registers, 4096-wide ones two to a program (0.0252 ms against
# 0.0277 one to a program; floor 0.0126); wider ones loop over LOOP_BLOCK columns, two rows and 4 warps to a program
# (14336: 0.0967 ms against 0.1177 for one 16384 block; floor 0.0440).
QUANT_ONE_BLOCK, LOOP_BLOCK = 8192, 2048


def _check_rows(t, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _runtime.FLOAT_DTYPES or t.dim() != 2:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D float32, float16 or bfloat16 tensor to quantise to FP8, got {got}")


def _quantize_rows_triton(t: torch.Tensor, multiplier: torch.Tensor | None = None, *, block: int | None = None,
                          rows: int | None = None, num_warps: int | None = None):
    """:func:`quantize_rows` of ``t`` (or of ``t.float() * multiplier[None, :]``) in one kernel; any strides. Checked
    arguments (the callers check). ``block``/``rows``/``num_warps``: launch overrides for benchmarks."""
    n_rows, n_cols = t.shape
    q = _runtime.empty((n_rows, n_cols), dtype=E4M3, device=t.device)
    scale = _runtime.empty((n_rows,), dtype=torch.float32, device=t.device)
    if n_rows == 0:
        return q, scale
    one_block = block is None and n_cols <= QUANT_ONE_BLOCK
    block = block or (_runtime.next_power_of_2(n_cols) if one_block else LOOP_BLOCK)
    one_block = n_cols <= block
    if one_block:  # ~4K elements a program (8K for 4096-wide rows), as ops.rms_norm
        rows = rows or (2 if block == 4096 else max(1, min(16, 4096 // block)))
        num_warps = num_warps or (8 if block == 4096 else _runtime.num_warps_for(block * rows))
    else:
        rows, num_warps = rows or 2, num_warps or 4
    bf16 = t.dtype == torch.bfloat16
    _quantize_rows_kernel[(_runtime.cdiv(n_rows, rows),)](
        t.view(torch.int16) if bf16 else t, multiplier if multiplier is not None else scale, q.view(torch.uint8),
        scale, t.stride(0), t.stride(1), n_rows, n_cols,
        BF16_BITS=bf16, HAS_MULTIPLIER=multiplier is not None, BLOCK=block, ROWS=rows, ONE_BLOCK=one_block,
        num_warps=num_warps,
    )
    return q, scale


def _quantize_rows_absmax_triton(t: torch.Tensor, absmax_parts: torch.Tensor):
    """:func:`quantize_rows` of ``t [R, C]`` (unit column stride) given ``absmax_parts`` fp32 ``[R, P]`` (contiguous)
    whose row maxima are t's row absmaxes (NaN where the row holds one), as a kernel that wrote t leaves them:
    one read of t. Bit for bit :func:`quantize_rows` when the parts are right. Checked arguments (the callers)."""
    n_rows, n_cols = t.shape
    q = _runtime.empty((n_rows, n_cols), dtype=E4M3, device=t.device)
    scale = _runtime.empty((n_rows,), dtype=torch.float32, device=t.device)
    if n_rows == 0:
        return q, scale
    bf16 = t.dtype == torch.bfloat16
    _quantize_rows_absmax_kernel[(_runtime.cdiv(n_rows, 2),)](
        t.view(torch.int16) if bf16 else t, absmax_parts, q.view(torch.uint8), scale, t.stride(0), n_rows, n_cols,
        absmax_parts.shape[1], BF16_BITS=bf16, BLOCK=min(LOOP_BLOCK, _runtime.next_power_of_2(n_cols)), ROWS=2,
        PARTS=_runtime.next_power_of_2(absmax_parts.shape[1]), num_warps=4,
    )
    return q, scale


def _quantize_rows_torch(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t32 = t.float()
    if t.shape[1]:  # absmax / 448 by a tensor: CUDA's torch divides by a Python scalar as a multiply by its rounded
        # reciprocal (1 ulp off IEEE division, seen on the card); the kernel divides exactly (div_rn)
        amax = t32.abs().amax(dim=1)
        scale = (amax / torch.full_like(amax, E4M3_MAX)).clamp_(min=SCALE_FLOOR)
    else:
        scale = torch.full((t.shape[0],), SCALE_FLOOR, device=t.device)
    q = (t32 / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def quantize_rows(t: torch.Tensor, *, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [R, C], s fp32 [R])`` with t ~= diag(s) q: s = max(absmax / 448, 2^-126) per row,
    q = e4m3(clamp(t / s, -448, 448)) (fp32 division, round to nearest even). ``t [R, C]`` float32/float16/bfloat16,
    any strides. Triton backend: one kernel (``_quantize_rows_kernel``); torch backend: a chain of torch ops, the
    reference (the two agree bit for bit: tests/test_fp8_kernels.py). NaN/inf in t are not checked (no host sync):
    they propagate to q and s (a row holding NaN or inf gets a NaN or inf scale and NaN codes where t / s is NaN).

    Raises:
        ValueError: t not a 2-D float32/float16/bfloat16 tensor (the message names ``name``).
    """
    _check_rows(t, name)
    if _runtime.backend(t.device) == "triton":
        return _quantize_rows_triton(t)
    return _quantize_rows_torch(t)


def quantize_fp8(weight: torch.Tensor, *, name: str = "weight", dtype: torch.dtype | None = None) -> FP8Weight:
    """``weight [out, in]`` (fp32/fp16/bf16) as an :class:`FP8Weight` with per-output-channel scales
    (:func:`quantize_rows`). ``dtype``: the compute dtype recorded in it (default: the weight's own; a weight
    dequantised in fp32 for a bf16 model passes bfloat16). Temporaries: 4 bytes per weight.

    Raises:
        ValueError: not a 2-D float tensor, an empty one, or non-finite values (the message names ``name``).
    """
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _runtime.FLOAT_DTYPES or weight.dim() != 2:
        got = f"{weight.dtype} of shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) \
            else type(weight).__name__
        raise ValueError(f"{name}: FP8 needs a 2-D [out, in] float32, float16 or bfloat16 weight, got {got}")
    if weight.numel() == 0:
        raise ValueError(f"{name}: FP8 needs a non-empty weight, got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():  # quantisation time, not a training step: a sync is fine
        raise ValueError(f"{name}: holds inf or NaN, which FP8 weights cannot represent")
    q, scale = quantize_rows(weight.detach(), name=name)
    return FP8Weight(q.contiguous(), scale, dtype or weight.dtype, name)


def dequantize_blocks(qweight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] | None, *,
                      name: str = "weight") -> torch.Tensor:
    """The fp32 weight ``[out, in]`` of a block-scaled FP8 checkpoint tensor (DeepSeek-V3 / Qwen3 "fine-grained"
    FP8, transformers' ``FineGrainedFP8Config``): W[i, j] = qweight[i, j] * scale_inv[i // b0, j // b1] with
    ``block_size = (b0, b1)`` (128 x 128 in those releases), ``scale_inv`` fp32 (or e8m0) ``[ceil(out / b0),
    ceil(in / b1)]``: the last block of a row or column may be partial. ``block_size=None``: one per-tensor scale
    (``scale_inv`` of one element). One fp32 product per weight, rounded once (the e4m3 value has 4 significant
    bits, the scale 24: the product is exact unless it needs more than fp32's 24, so within 2^-24 relative).

    Raises:
        ValueError: qweight not a 2-D float8 tensor, or scale_inv not of the grid's shape (names ``name``).
    """
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2 or qweight.dtype not in (E4M3,
                                                                                          torch.float8_e5m2):
        got = f"{qweight.dtype} {tuple(qweight.shape)}" if isinstance(qweight, torch.Tensor) \
            else type(qweight).__name__
        raise ValueError(f"{name}: a block-scaled FP8 weight must be a 2-D float8 tensor, got {got}")
    rows, cols = qweight.shape
    b0, b1 = (rows, cols) if block_size is None else (int(block_size[0]), int(block_size[1]))
    grid = (-(-rows // b0), -(-cols // b1)) if b0 > 0 and b1 > 0 else None
    if grid is None or not isinstance(scale_inv, torch.Tensor) or scale_inv.numel() != grid[0] * grid[1]:
        got = tuple(scale_inv.shape) if isinstance(scale_inv, torch.Tensor) else type(scale_inv).__name__
        raise ValueError(f"{name}: block size {block_size} of a {rows} x {cols} weight needs a scale grid of "
                         f"{grid}, got scale_inv of shape {got}")
    scale = scale_inv.float().reshape(grid)
    scale = scale.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    return qweight.float() * scale


def requantize_blocks(qweight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] | None, *,
                      dtype: torch.dtype, name: str = "weight") -> FP8Weight:
    """A block-scaled FP8 checkpoint weight (:func:`dequantize_blocks`, in fp32) requantised per output channel
    as an :class:`FP8Weight` of compute dtype ``dtype``: the one FP8 object the LoRA ops take.

    Extra error (docs/design.md, "FP8 checkpoints"): the block-dequantised value v is rounded once more, to the
    row's grid s_row = absmax_row / 448, so |dequantize_fp8(result) - v| <= u |v| + 2^-10 s_row (u = 2^-4), on
    top of the checkpoint's own rounding. Blocks whose scale is far below the row's lose the most (their small
    values fall below 2^-6 s_row, the subnormal range, absolute spacing 2^-9 s_row).

    Raises:
        ValueError: as :func:`dequantize_blocks`, or non-finite values.
    """
    return quantize_fp8(dequantize_blocks(qweight, scale_inv, block_size, name=name), name=name, dtype=dtype)


def dequantize_fp8(w: FP8Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """diag(scale) qweight ``[out, in]`` formed in fp32 and rounded once to ``dtype`` (default ``w.dtype``)."""
    if not isinstance(w, FP8Weight):
        raise ValueError(f"w must be an FP8Weight, got {type(w).__name__}")
    return (w.qweight.float() * w.scale[:, None]).to(dtype or w.dtype)


# -------------------------------------------------------------------------------------------------------- GEMMs
def fp8_gemms(weight) -> bool:
    """Whether the fused LoRA ops run a frozen weight's GEMMs (y and dX) in e4m3: an :class:`FP8Weight`, or an
    ``NF4Weight`` with FP8 compute (its ``fp8_scale`` set: ``ops.nf4_fp8.with_fp8_compute``)."""
    return isinstance(weight, FP8Weight) or getattr(weight, "fp8_scale", None) is not None


def _native(w: FP8Weight) -> bool:
    """``torch._scaled_mm`` on the card (Triton backend on CUDA, both weight dims multiples of 16, which it
    requires); the emulation everywhere else."""
    return (w.device.type == "cuda" and _runtime.backend(w.device) == "triton"
            and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0)


def _ones_row(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    if key not in _ones:
        _ones[key] = torch.ones((1, n), dtype=torch.float32, device=device)
    return _ones[key]


def _scaled_mm(a_q, a_scale, b_colmajor, b_scale, out_dtype):
    y = torch._scaled_mm(a_q, b_colmajor, scale_a=a_scale[:, None], scale_b=b_scale, out_dtype=torch.bfloat16)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def fp8_linear(x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None = None, *, out_dtype: torch.dtype,
               x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y = x W^T + b ``[M, out]`` in ``out_dtype`` with x ``[M, in]`` quantised per row (or given as
    ``x_quantized = (x_fp8 [M, in] e4m3, x_scale fp32 [M])``) and W = diag(w.scale) w.qweight. Not differentiable
    by itself (the LoRA nodes call it)."""
    xq, xs = quantize_rows(x) if x_quantized is None else x_quantized
    if _native(w):
        y = _scaled_mm(xq, xs, w.qweight.t(), w.scale[None, :], out_dtype)
    else:  # e4m3 x e4m3 products are exact in fp32; the scales multiply the fp32 sums
        y = ((xq.float() @ w.qweight.float().t()) * xs[:, None] * w.scale[None, :]).to(out_dtype)
    return y if bias is None else y.add_(bias.to(out_dtype))


def _transposed(w: FP8Weight, *, block: int = 128, num_warps: int = 8) -> torch.Tensor:
    """Wq^T ``[in, out]`` row-major in a workspace reused per (shape, device): ``_scaled_mm``'s mat2 for dX. Triton
    backend: ``_transpose_kernel`` (``block`` x ``block`` byte tiles; the arguments are benchmark overrides); torch
    backend: ``copy_`` of the transposed view."""
    key = (w.shape, w.device)
    if key not in _transposed_workspaces:
        _transposed_workspaces[key] = _runtime.empty((w.shape[1], w.shape[0]), dtype=E4M3, device=w.device)
    out = _transposed_workspaces[key]
    _transpose_into(out, w, block, num_warps)
    return out


def _transpose_into(out: torch.Tensor, w: FP8Weight, block: int = 128, num_warps: int = 8) -> None:
    """out ``[in, out]`` (unit column stride, any row stride: a column block of a wider workspace) = Wq^T."""
    if _runtime.backend(w.device) != "triton":
        out.copy_(w.qweight.t())
        return
    n_rows, n_cols = w.shape
    _transpose_kernel[(_runtime.cdiv(n_rows, block), _runtime.cdiv(n_cols, block))](
        w.qweight.view(torch.uint8), out.view(torch.uint8), n_rows, n_cols, out.stride(0), BLOCK_R=block,
        BLOCK_C=block, num_warps=num_warps,
    )


def _check_grad_output(dy, w: FP8Weight) -> None:
    _check_rows(dy, "dY")
    if dy.shape[1] != w.shape[0]:
        raise ValueError(f"dY must have {w.shape[0]} columns (the weight's out features), got shape {tuple(dy.shape)}")
    if dy.device != w.device:
        raise ValueError(f"dY is on {dy.device} but {w.name} on {w.device}")


def quantize_grad_output(dy: torch.Tensor, w: FP8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(dy.float() * w.scale[None, :])``: g = dY diag(s_w) quantised per row (``dy [M, out]``
    fp32/fp16/bf16, any strides). Triton backend: the product formed inside the quantisation kernel (no fp32 copy
    of dY); torch backend: the product as an fp32 tensor, then :func:`quantize_rows`.

    Raises:
        ValueError: dy not 2-D float, not ``out`` columns wide, or on another device than w.
    """
    _check_grad_output(dy, w)
    if _runtime.backend(dy.device) == "triton":
        return _quantize_rows_triton(dy, w.scale)
    return _quantize_rows_torch(dy.float() * w.scale[None, :])


def fp8_grad_input(dy: torch.Tensor, w: FP8Weight, *, out_dtype: torch.dtype) -> torch.Tensor:
    """dX = dY W ``[M, in]`` in ``out_dtype``: g = dY diag(w.scale) (fp32), quantised per row
    (:func:`quantize_grad_output`), times w.qweight (module docstring: the weight's scales fold into dY, so the
    forward's FP8 copy serves).

    Raises:
        ValueError: as :func:`quantize_grad_output`.
    """
    gq, gs = quantize_grad_output(dy, w)
    if _native(w):
        return _scaled_mm(gq, gs, _transposed(w).t(), _ones_row(w.shape[1], gq.device), out_dtype)
    return ((gq.float() @ w.qweight.float()) * gs[:, None]).to(out_dtype)
