r"""NF4 storage with FP8 compute: NF4 codes dequantised straight to e4m3 for the fused LoRA ops' FP8 GEMMs.

Issue #26, docs/design.md "NF4 storage, FP8 compute". A 2-D weight given per-output-channel scales
(:func:`with_fp8_compute`: s_r = max(absmax_r / 448, 2^-126) of the fp32 dequantised row, computed once) is
dequantised by the NF4 kernel of :mod:`leantune.ops.nf4` straight to e4m3 codes, q = e4m3(clamp(v / s_r, -448, 448))
with v the fp32 value :func:`~leantune.ops.nf4.dequantize_nf4` rounds (:func:`dequantize_nf4_fp8`: 0.5 B read and
1 B written per weight), i.e. bit for bit ``fp8.quantize_fp8`` of the fp32 dequantised weight; the fused LoRA ops
then run the frozen GEMMs as e4m3 GEMMs (:mod:`leantune.ops.fp8`).
"""

from __future__ import annotations

import dataclasses

import torch

from . import _runtime
from .fp8 import E4M3, E4M3_MAX, SCALE_FLOOR, FP8Weight
from .nf4 import _TORCH_CHUNK_BLOCKS, BLOCKSIZE, NF4Weight, _block_values, _launch_dequantize, dequantize_nf4


def _dequantize_fp8_torch(w: NF4Weight, out: torch.Tensor) -> None:
    """The FP8 kernel's formula in torch ops (``fp8._quantize_rows_torch``'s rounding), in chunks of whole rows."""
    n_rows, n_cols = w.shape
    per_row = n_cols // BLOCKSIZE
    rows = max(1, _TORCH_CHUNK_BLOCKS // per_row)
    for start in range(0, n_rows, rows):
        stop = min(start + rows, n_rows)
        values = _block_values(w, start * per_row, stop * per_row).view(stop - start, n_cols)
        out[start:stop].copy_((values / w.fp8_scale[start:stop, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3))


def with_fp8_compute(w: NF4Weight) -> NF4Weight:
    """``w`` with :attr:`NF4Weight.fp8_scale` set: the frozen GEMMs of the fused LoRA ops then run in e4m3 on
    codes dequantised straight from NF4 (:func:`dequantize_nf4_fp8`). The scales are those
    ``fp8.quantize_rows`` gives the fp32 dequantised weight, s_r = max(absmax_r / 448, 2^-126), computed once here
    (the weight is frozen): temporaries of 5 bytes per weight, at quantisation time, not in a step.

    Raises:
        ValueError: w not an NF4Weight, or not 2-D [out, in] with in a multiple of 64 (the message names w).
    """
    if not isinstance(w, NF4Weight):
        raise ValueError(f"w must be an NF4Weight, got {type(w).__name__}")
    if len(w.shape) != 2 or w.shape[1] % BLOCKSIZE:
        raise ValueError(f"{w.name}: FP8 compute needs a 2-D [out, in] weight with in a multiple of {BLOCKSIZE}, "
                         f"got shape {w.shape}")
    dense = dequantize_nf4(dataclasses.replace(w, fp8_scale=None), dtype=torch.float32)
    amax = dense.abs().amax(dim=1)
    scale = (amax / torch.full_like(amax, E4M3_MAX)).clamp_(min=SCALE_FLOOR)  # fp8._quantize_rows_torch's rule
    return dataclasses.replace(w, fp8_scale=scale.contiguous())


def dequantize_nf4_fp8(w: NF4Weight, *, out: torch.Tensor | None = None) -> FP8Weight:
    """The weight as an :class:`~leantune.ops.fp8.FP8Weight` (e4m3 ``[out, in]``, scales ``w.fp8_scale``), made
    from the NF4 codes in one pass: q = e4m3(clamp(v / s_row, -448, 448)) with v the fp32 value
    :func:`dequantize_nf4` rounds (fp32 division, round to nearest even), bit for bit
    ``fp8.quantize_fp8(dequantize_nf4(w, dtype=torch.float32))`` (tests/test_nf4_fp8.py). Reads 0.5 B and writes
    1 B per weight (bf16 dequantisation writes 2). Triton kernel or torch ops by ``backend(device)``.

    Args:
        w: an NF4 weight with FP8 compute (:func:`with_fp8_compute`).
        out: a contiguous ``float8_e4m3fn`` tensor of shape ``w.shape`` on w's device to write the codes into (a
            reusable workspace), or None to allocate one.

    Raises:
        ValueError: w not an NF4Weight with ``fp8_scale``, or an ``out`` of the wrong shape, dtype, device or layout.
    """
    if not isinstance(w, NF4Weight) or w.fp8_scale is None:
        got = type(w).__name__ if not isinstance(w, NF4Weight) else "an NF4Weight without fp8_scale"
        raise ValueError(f"w must be an NF4Weight with FP8 compute (with_fp8_compute), got {got}")
    if out is None:
        out = _runtime.empty(w.shape, dtype=E4M3, device=w.device)
    elif (not isinstance(out, torch.Tensor) or out.dtype != E4M3 or tuple(out.shape) != w.shape
          or out.device != w.device or not out.is_contiguous()):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) \
            else type(out).__name__
        raise ValueError(f"out must be a contiguous float8_e4m3fn tensor of shape {w.shape} on {w.device}, got {got}")
    if _runtime.backend(w.device) == "torch":
        _dequantize_fp8_torch(w, out)
    else:
        _launch_dequantize(w, out, w.fp8_scale)
    return FP8Weight(out, w.fp8_scale, w.dtype, w.name)
