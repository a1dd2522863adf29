r"""NF4 (QLoRA 4-bit NormalFloat) frozen weights in bitsandbytes' layout, and their dequantisation.

Format (Dettmers et al. 2023, "QLoRA", sections 3 and the appendix table of NF4 values). A weight W with n elements
(any shape; n a multiple of 64) is cut, in row-major order, into n / 64 blocks of 64. Block j stores

    absmax_j = max |W[64 j : 64 j + 64]|                         (fp32)
    nibble_i = the NF4 code index nearest to W_i / absmax_j       (4 bits, 16 values sorted from -1 to 1)

and the dequantised value is ``NF4[nibble_i] * absmax_j``. Double quantisation stores the absmaxes themselves in
8 bits: offset = mean(absmax) over all blocks, then absmax - offset is quantised blockwise (blocks of 256 absmaxes)
with the signed 8-bit dynamic map, each 256-block keeping its own fp32 scale ``nested_absmax``:

    absmax_j = dynamic[absmax_code_j] * nested_absmax[j // 256] + offset

Facts checked against bitsandbytes 0.50.2 (its Python source, and bit-for-bit by tests/test_nf4.py):

- Packed codes (``functional.quantize_4bit``; CPU kernel ``backends/default/ops.py`` ``quantize_4bit``): uint8 of
  shape ``[ceil(n / 2), 1]``; element 2i is the HIGH nibble of byte i and element 2i+1 the low nibble. The element
  order is the flat row-major order of the weight, so a 64-block is 32 consecutive bytes.
- 4-bit rounding: ``scaled = clamp(W_i * (1 / max(absmax_j, 1e-38)), -1, 1)`` in fp32, then the index of the first
  midpoint ``(NF4[k] + NF4[k+1]) / 2`` (fp32) that is >= scaled (a value exactly on a midpoint takes the lower code).
  An all-zero block gets absmax 0 and code 7 (the value 0).
- Code table: ``functional.get_4bit_type("nf4")``, 16 fp32 values, stored in the state dict as ``quant_map``. The
  dequantisation kernels of bitsandbytes (CPU and CUDA) use a built-in copy of the table and ignore ``quant_map``;
  loading therefore refuses a ``quant_map`` that is not this table.
- Double quantisation (``compress_statistics=True``): ``offset = absmax.mean()`` (fp32 0-dim tensor), then
  ``quantize_blockwise(absmax - offset, blocksize=256)`` with ``create_dynamic_map()`` (256 sorted fp32 values in
  [-0.993, 1]): ``nested_absmax`` has ceil(n_blocks / 256) entries, and a last, partial 256-block takes the max over
  the absmaxes it holds. On CPU the 8-bit code is not the nearest one: bitsandbytes' C kernel rounds
  ``((clamp(x / a, -1, 1) + 1) * 0.5) * 65535 + 0.5`` down to a bin of a 65536-entry table, each bin holding the code
  whose midpoint interval contains ``-1 + 2 bin / 65535`` (a block with a = 0 gets codes 0). :func:`quantize_nf4`
  reproduces that (so its bytes equal bitsandbytes' on CPU); bitsandbytes' CUDA quantiser may pick a neighbouring
  8-bit code for some absmaxes (not checked here). Either dequantises through the same formula.
- Dequantisation (``functional.dequantize_4bit``): ``absmax = dynamic[q] * nested_absmax[j // 256]`` in fp32, then
  ``absmax += offset`` in fp32 (two roundings, no fused multiply-add), then ``NF4[nibble] * absmax`` in fp32, rounded
  once (to nearest even) to the output dtype, which defaults to the dtype the weight had when quantised. (Its CPU
  C kernel gets weights whose last dim is not a multiple of 64 wrong, round-trip error O(absmax); its torch kernel
  ``backends/default/ops.py`` ``_dequantize_4bit_compute`` and this module use the flat 64-blocks for every shape.)
- State dict (``QuantState.as_dict(packed=True)``, read back by ``QuantState.from_dict``), next to the packed codes
  under ``<name>``: ``<name>.absmax`` (uint8 codes), ``<name>.quant_map`` (fp32 [16]), ``<name>.nested_absmax``
  (fp32), ``<name>.nested_quant_map`` (fp32 [256]) and ``<name>.quant_state.bitsandbytes__nf4``: a uint8 tensor of
  the UTF-8 JSON ``{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [out, in],
  "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": <offset as a float>}``.

Kernel (GPU target: 14336 x 4096 -> bf16 at >= 80% of its bandwidth floor, 0.5 B read + 2 B written per weight). One
program dequantises BLOCKS whole 64-blocks: it loads their BLOCKS absmax codes and 256-block scales once, the packed
bytes as a [BLOCKS, 32] tile (32 contiguous bytes per row, vectorised loads), splits each byte into its two nibbles,
looks each up in the 64-byte NF4 table (one L1 line: one transaction per warp; a select tree over the nibble's bits held
the 16 values in registers but cost ~20 instructions per element: 0.073 ms against the table's 0.042 on the H200, 47% vs
82% of the floor, benchmarks/RESULTS.md), interleaves the two halves back into element order and stores [BLOCKS, 64]
contiguous values. Memory per program: 16 * BLOCKS bytes of metadata, 32 * BLOCKS bytes of codes in, 64 * BLOCKS * (2 or
4) bytes out. Launched with fp fusion off, so ``dynamic * scale + offset`` is two roundings as in bitsandbytes. Under
the interpreter the kernel computes in fp32 and casts once at the store (docs/design.md, "Backends").

FP8 compute (issue #26): the kernel also writes e4m3 codes given per-row scales; :mod:`leantune.ops.nf4_fp8`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import torch
import triton
import triton.language as tl

from . import _runtime
from ._fp8_rows import _store_codes

BLOCKSIZE = 64  # weights per absmax
NESTED_BLOCKSIZE = 256  # absmaxes per nested (second-level) scale
QUANT_TYPE = "nf4"
# bitsandbytes 0.50.2 get_4bit_type("nf4"): quantiles of N(0, 1) normalised to [-1, 1] (QLoRA, appendix E).
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
_LUT_BINS = 65536  # bins of bitsandbytes' CPU 8-bit quantiser over [-1, 1]
_TORCH_CHUNK_BLOCKS = 4096  # 64-blocks the torch path dequantises at once (bounded temporaries when out= is given)
_KERNEL_BLOCKS = 128  # 64-blocks per program: 8192 weights, 4 KiB of codes in (fastest of a launch sweep on the H200)
_STATE_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


# ------------------------------------------------------------------------------------------------------ code tables
def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic quantisation map (Dettmers 2015, "8-Bit Approximations for Parallelism in Deep
    Learning"): fp32 [256], sorted. For each decade e = 0..6 the 2^e midpoints of fp32 ``linspace(0.1, 1, 2^e + 1)``
    scaled by 10^(e - 6), both signs, then 0 and 1. Equal to bitsandbytes' ``create_dynamic_map()``."""
    values = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1.0, 2**e + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        magnitudes = (10.0 ** (e - 6) * mids).tolist()
        values += magnitudes + [-m for m in magnitudes]
    return torch.tensor(sorted(values), dtype=torch.float32)


def _nf4_values(device) -> torch.Tensor:
    """The 16 NF4 values, fp32, on ``device``: cached, or while torch.compile traces a constant of the graph (the
    cached path builds the quantiser's tables too, whose Python lists would break the graph)."""
    if torch.compiler.is_compiling():
        return torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)
    return _tables(str(device))[0]


@functools.lru_cache(maxsize=8)
def _tables(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(NF4 values fp32 [16], dynamic map fp32 [256], CPU-quantiser bin -> 8-bit code table int64 [65536])."""
    nf4 = torch.tensor(NF4_VALUES, dtype=torch.float32)
    dynamic = dynamic_map()
    mids = 0.5 * (dynamic[:-1] + dynamic[1:])
    bins = -1.0 + (2.0 * torch.arange(_LUT_BINS, dtype=torch.float32)) / float(_LUT_BINS - 1)
    lut = torch.searchsorted(mids, bins, side="left")  # number of midpoints strictly below the bin's value
    return nf4.to(device), dynamic.to(device), lut.to(device)


# -------------------------------------------------------------------------------------------------------- container
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True, eq=False)
class NF4Weight:
    """A weight quantised to NF4 with double-quantised absmax, in bitsandbytes' layout (module docstring).

    Fields (all tensors on one device):
        codes: uint8, ceil(n / 2) elements (bitsandbytes stores ``[n / 2, 1]``), two weights per byte, high nibble
            first.
        absmax_codes: uint8 [n / 64], the 8-bit code of each block's ``absmax - offset``.
        nested_absmax: fp32 [ceil(n / 16384)], the scale of each group of 256 absmaxes.
        offset: the mean absmax (an fp32 value held as a Python float).
        code: fp32 [16], the NF4 table (bitsandbytes' ``quant_map``).
        nested_code: fp32 [256], the dynamic map (``nested_quant_map``).
        shape: the weight's shape, e.g. ``(out_features, in_features)``.
        dtype: the weight's dtype before quantisation, the default output dtype of :func:`dequantize_nf4`.
        blocksize: 64 (the only blocksize supported).
        fp8_scale: None, or (FP8 compute, :func:`with_fp8_compute`) fp32 ``[out]``: the per-output-channel e4m3
            scales of the dequantised 2-D weight; the fused LoRA ops then dequantise the codes straight to e4m3
            (:func:`dequantize_nf4_fp8`) and run the frozen GEMMs in FP8. Derived from the other fields, so
            :meth:`state_dict` leaves it out.
        name: what error messages call the weight (e.g. the layer), default "weight".

    Raises (at construction):
        ValueError: a field of the wrong dtype or size for ``shape`` (the message names the field).
    """

    codes: torch.Tensor
    absmax_codes: torch.Tensor
    nested_absmax: torch.Tensor
    offset: float
    code: torch.Tensor
    nested_code: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocksize: int = BLOCKSIZE
    fp8_scale: torch.Tensor | None = None
    name: str = dataclasses.field(default="weight", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        _check_layout(self, self.name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_blocks(self) -> int:
        return self.numel // self.blocksize

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device) -> NF4Weight:
        """The same weight with every tensor on ``device``."""
        move = {f: getattr(self, f).to(device) for f in ("codes", "absmax_codes", "nested_absmax", "code",
                                                         "nested_code")}
        if self.fp8_scale is not None:
            move["fp8_scale"] = self.fp8_scale.to(device)
        return dataclasses.replace(self, **move)

    # ------------------------------------------------------------------------------------ bitsandbytes interchange
    def state_dict(self, prefix: str = "weight") -> dict[str, torch.Tensor]:
        """The entries bitsandbytes (and transformers' 4-bit models) save for this weight under ``prefix``:
        ``prefix`` (packed codes [n / 2, 1]), ``prefix.absmax``, ``prefix.quant_map``, ``prefix.nested_absmax``,
        ``prefix.nested_quant_map``, ``prefix.quant_state.bitsandbytes__nf4`` (module docstring)."""
        meta = {
            "quant_type": QUANT_TYPE, "blocksize": self.blocksize, "dtype": _dtype_name(self.dtype),
            "shape": list(self.shape), "nested_blocksize": NESTED_BLOCKSIZE, "nested_dtype": "float32",
            "nested_offset": self.offset,
        }
        packed_meta = torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)
        return {
            prefix: self.codes.reshape(-1, 1),
            f"{prefix}.absmax": self.absmax_codes,
            f"{prefix}.quant_map": self.code,
            f"{prefix}.nested_absmax": self.nested_absmax,
            f"{prefix}.nested_quant_map": self.nested_code,
            f"{prefix}.quant_state.bitsandbytes__{QUANT_TYPE}": packed_meta.to(self.device),
        }

    @classmethod
    def from_state_dict(cls, state_dict, prefix: str = "weight", *, name: str | None = None) -> NF4Weight:
        """Read the entries :meth:`state_dict` writes (as bitsandbytes saves them) under ``prefix``. Other keys of
        ``state_dict`` are ignored. ``name`` (default ``prefix``) names the layer in error messages.

        Raises:
            ValueError: a missing entry, a quant type other than nf4 (fp4 is not supported yet), no double
                quantisation, a blocksize other than 64 (nested: 256), a ``quant_map`` that is not the NF4 table, or
                tensors that do not fit the recorded shape.
        """
        name = name or prefix
        meta_keys = [k for k in state_dict if k.startswith(f"{prefix}.quant_state.bitsandbytes__")]
        if not meta_keys:
            raise ValueError(f"{name}: no quant state (expected the key {prefix}.quant_state.bitsandbytes__nf4)")
        quant_type = meta_keys[0].rsplit("__", 1)[1]
        if quant_type != QUANT_TYPE or len(meta_keys) != 1:
            raise ValueError(f"{name}: quant type {quant_type!r} is not supported yet (only nf4)")
        missing = [k for k in (prefix, *(f"{prefix}.{s}" for s in _STATE_KEYS)) if k not in state_dict]
        try:
            meta = json.loads(bytes(state_dict[meta_keys[0]].cpu().tolist()).decode("utf-8"))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name}: the quant state {meta_keys[0]} is not bitsandbytes' packed JSON ({e})") from e
        if "nested_offset" not in meta or missing:
            if f"{prefix}.nested_absmax" in missing or "nested_offset" not in meta:
                raise ValueError(f"{name}: the weight is not double-quantised (bitsandbytes compress_statistics / "
                                 "bnb_4bit_use_double_quant=True is needed; plain fp32 absmax is not supported yet)")
            raise ValueError(f"{name}: the quant state lacks {', '.join(missing)}")
        for key, expected in (("quant_type", QUANT_TYPE), ("blocksize", BLOCKSIZE),
                              ("nested_blocksize", NESTED_BLOCKSIZE), ("nested_dtype", "float32")):
            if meta.get(key) != expected:
                raise ValueError(f"{name}: quant state {key} must be {expected!r}, got {meta.get(key)!r}")
        dtype = getattr(torch, str(meta.get("dtype")), None)
        if dtype not in _runtime.FLOAT_DTYPES:
            raise ValueError(
                f"{name}: quant state dtype must be float32, float16 or bfloat16, got {meta.get('dtype')!r}")
        if not isinstance(meta.get("shape"), list):
            raise ValueError(f"{name}: quant state shape must be a list of sizes, got {meta.get('shape')!r}")
        _check_state_dtypes(state_dict, prefix, name)
        weight = cls(
            codes=state_dict[prefix].reshape(-1),
            absmax_codes=state_dict[f"{prefix}.absmax"],
            nested_absmax=state_dict[f"{prefix}.nested_absmax"],
            offset=float(torch.tensor(float(meta["nested_offset"]), dtype=torch.float32)),
            code=state_dict[f"{prefix}.quant_map"],
            nested_code=state_dict[f"{prefix}.nested_quant_map"],
            shape=tuple(meta["shape"]),
            dtype=dtype,
            name=name,
        )
        _check_tables(weight, name)
        return weight

    @classmethod
    def from_bnb(cls, packed: torch.Tensor, quant_state, *, name: str = "weight") -> NF4Weight:
        """From bitsandbytes' ``quantize_4bit(..., quant_type="nf4", compress_statistics=True)`` result (packed
        codes, ``QuantState``), e.g. a ``Params4bit``'s data and ``quant_state``. Raises as :meth:`from_state_dict`."""
        entries = {f"w.{k}": v for k, v in quant_state.as_dict(packed=True).items()}
        entries["w"] = packed
        return cls.from_state_dict(entries, "w", name=name)

    def to_bnb(self):
        """``(packed codes [n / 2, 1] uint8, bitsandbytes.functional.QuantState)`` for bitsandbytes'
        ``dequantize_4bit`` / ``Params4bit``. Needs bitsandbytes installed (not a leantune dependency)."""
        from bitsandbytes.functional import QuantState

        entries = self.state_dict("w")
        packed = entries.pop("w")
        return packed, QuantState.from_dict({k[2:]: v for k, v in entries.items()}, device=self.device)


def _check_state_dtypes(state_dict, prefix: str, name: str) -> None:
    """ValueError naming the entry unless the state-dict tensors have bitsandbytes' dtypes."""
    for key, dtype in (("", torch.uint8), (".absmax", torch.uint8), (".nested_absmax", torch.float32),
                       (".quant_map", torch.float32), (".nested_quant_map", torch.float32)):
        t = state_dict[prefix + key]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {prefix + key} must be a {dtype} tensor, got {got}")


def _check_layout(w: NF4Weight, name: str) -> None:
    """Metadata-only checks (no device sync): dtypes, sizes against ``shape``, one device."""
    if w.blocksize != BLOCKSIZE:
        raise ValueError(f"{name}: blocksize must be {BLOCKSIZE}, got {w.blocksize}")
    if w.dtype not in _runtime.FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype must be float32, float16 or bfloat16, got {w.dtype}")
    if any(s < 0 for s in w.shape) or w.numel == 0 or w.numel % BLOCKSIZE:
        raise ValueError(f"{name}: shape {w.shape} must hold a positive multiple of {BLOCKSIZE} weights")
    n_nested = _runtime.cdiv(w.n_blocks, NESTED_BLOCKSIZE)
    for field, dtype, size in (("codes", torch.uint8, w.numel // 2), ("absmax_codes", torch.uint8, w.n_blocks),
                               ("nested_absmax", torch.float32, n_nested), ("code", torch.float32, 16),
                               ("nested_code", torch.float32, 256)):
        t = getattr(w, field)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {field} must be a {dtype} tensor, got {got}")
        if t.numel() != size:
            raise ValueError(f"{name}: {field} must have {size} elements for shape {w.shape} "
                             f"(blocksize {BLOCKSIZE}, nested blocksize {NESTED_BLOCKSIZE}), got {t.numel()}")
        if t.device != w.codes.device:
            raise ValueError(f"{name}: {field} is on {t.device} but codes on {w.codes.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {field} must be contiguous")
    if not isinstance(w.offset, float) or not math.isfinite(w.offset):
        raise ValueError(f"{name}: offset must be a finite float, got {w.offset!r}")
    if w.fp8_scale is not None:
        _check_fp8_layout(w, name)


def _check_fp8_layout(w: NF4Weight, name: str) -> None:
    s = w.fp8_scale
    if len(w.shape) != 2 or w.shape[1] % BLOCKSIZE:
        raise ValueError(f"{name}: FP8 compute needs a 2-D [out, in] weight with in a multiple of {BLOCKSIZE} (each "
                         f"row whole 64-blocks), got shape {w.shape}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (w.shape[0],):
        got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"{name}: fp8_scale must be a float32 tensor of shape ({w.shape[0]},), got {got}")
    if s.device != w.codes.device:
        raise ValueError(f"{name}: fp8_scale is on {s.device} but codes on {w.codes.device}")
    if not s.is_contiguous():
        raise ValueError(f"{name}: fp8_scale must be contiguous")


def _check_tables(w: NF4Weight, name: str) -> None:
    """ValueError unless ``code`` is the NF4 table (bitsandbytes' kernels use their own copy of it)."""
    nf4, _, _ = _tables("cpu")
    if not torch.equal(w.code.detach().cpu(), nf4):
        raise ValueError(f"{name}: quant_map is not the NF4 table (a corrupt quant state, or another 4-bit type)")


# --------------------------------------------------------------------------------------------------- quantisation
def quantize_nf4(weight: torch.Tensor, *, name: str = "weight") -> NF4Weight:
    """Quantise ``weight`` (fp32/fp16/bf16, any shape, numel a multiple of 64) to NF4 with double-quantised absmax.

    Bit-identical to bitsandbytes 0.50.2 ``quantize_4bit(weight, blocksize=64, compress_statistics=True,
    quant_type="nf4")`` on CPU (same packed bytes, absmax codes, nested absmax and offset; module docstring). Runs
    in torch ops on the weight's device; temporaries of 4 bytes per weight.

    Raises:
        ValueError: not a float tensor, numel not a positive multiple of 64, non-finite values, or block maxima
            whose float32 mean overflows (weights near the float32 limit); the message names ``name`` (e.g. the
            layer).
    """
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _runtime.FLOAT_DTYPES:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{name}: must be a float32, float16 or bfloat16 tensor to quantise to NF4, got {got}")
    n = weight.numel()
    if n == 0 or n % BLOCKSIZE:
        raise ValueError(f"{name}: NF4 needs a number of weights that is a positive multiple of the blocksize "
                         f"{BLOCKSIZE}, got shape {tuple(weight.shape)} ({n} weights)")
    blocks = weight.detach().reshape(-1, BLOCKSIZE).float()
    if not torch.isfinite(blocks).all():
        raise ValueError(f"{name}: holds inf or NaN, which NF4 cannot represent")
    nf4, dynamic, lut = _tables(str(weight.device))

    absmax = blocks.abs().amax(dim=1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1)
    nibbles = torch.bucketize(scaled, (nf4[:-1] + nf4[1:]) / 2, out_int32=True).to(torch.uint8).reshape(-1)
    codes = (nibbles[0::2] << 4) | nibbles[1::2]

    offset = absmax.mean()
    if not math.isfinite(offset):  # the fp32 sum of block maxima overflows (bitsandbytes' fp32 mean, kept exact)
        raise ValueError(f"{name}: its 64-blocks' absolute maxima (up to {absmax.max().item():.3g}) are too large "
                         "for NF4's double quantisation: their float32 mean overflows")
    centred = absmax - offset
    n_nested = _runtime.cdiv(centred.numel(), NESTED_BLOCKSIZE)
    groups = torch.nn.functional.pad(centred, (0, n_nested * NESTED_BLOCKSIZE - centred.numel()))
    groups = groups.view(n_nested, NESTED_BLOCKSIZE)  # zero padding leaves each group's abs max unchanged
    nested_absmax = groups.abs().amax(dim=1)
    empty = (nested_absmax == 0)[:, None]
    normed = torch.clamp(groups * (1.0 / nested_absmax)[:, None], -1, 1).masked_fill(empty, 0.0)
    bins = (((normed + 1.0) * 0.5) * float(_LUT_BINS - 1) + 0.5).to(torch.int64)  # truncation, as bitsandbytes
    absmax_codes = lut[bins].masked_fill(empty, 0).to(torch.uint8).reshape(-1)[: centred.numel()]

    return NF4Weight(codes=codes.contiguous(), absmax_codes=absmax_codes.contiguous(), nested_absmax=nested_absmax,
                     offset=float(offset), code=nf4.clone(), nested_code=dynamic.clone(), shape=tuple(weight.shape),
                     dtype=weight.dtype, name=name)


# ------------------------------------------------------------------------------------------------------- kernel
@triton.jit
def _dequantize_nf4_kernel(
    CODES, ABSMAX_CODES, NESTED_ABSMAX, NESTED_CODE, NF4, OUT, FP8_SCALE, offset, n_blocks, blocks_per_row,
    BLOCKS: tl.constexpr, BLOCKSIZE_: tl.constexpr, NESTED_BLOCKSIZE_: tl.constexpr, FP8: tl.constexpr,
):
    """v[64 j + i] = NF4[nibble] * (dynamic[absmax_code_j] * nested_absmax[j // 256] + offset) for BLOCKS blocks j,
    stored rounded to OUT's dtype, or (FP8) as e4m3(clamp(v / s_row, -448, 448)) with s_row = FP8_SCALE[j //
    blocks_per_row] (a row is whole 64-blocks), the rounding of ``fp8.quantize_rows``."""
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = blocks < n_blocks
    absmax_code = tl.load(ABSMAX_CODES + blocks, mask=live, other=0).to(tl.int32)
    scale = tl.load(NESTED_ABSMAX + blocks // NESTED_BLOCKSIZE_, mask=live, other=0.0)
    absmax = tl.load(NESTED_CODE + absmax_code) * scale + offset  # two roundings: launched with fp fusion off
    HALF: tl.constexpr = BLOCKSIZE_ // 2
    byte = tl.load(CODES + blocks[:, None] * HALF + tl.arange(0, HALF)[None, :], mask=live[:, None], other=0)
    byte = byte.to(tl.int32)
    first = tl.load(NF4 + (byte >> 4)) * absmax[:, None]  # even elements: the high nibble
    second = tl.load(NF4 + (byte & 15)) * absmax[:, None]
    values = tl.reshape(tl.join(first, second), (BLOCKS, BLOCKSIZE_))  # interleave back to element order
    cols = tl.arange(0, BLOCKSIZE_)
    if FP8:  # block j's codes at OUT + 64 j: the row-major [out, in] layout, n_cols = 64 per "row" of the tile
        row_scale = tl.load(FP8_SCALE + blocks // blocks_per_row, mask=live, other=1.0)
        _store_codes(OUT, values, row_scale, blocks, cols, live[:, None] & (cols < BLOCKSIZE_)[None, :], BLOCKSIZE_)
    else:
        tl.store(OUT + blocks[:, None] * BLOCKSIZE_ + cols[None, :], values.to(OUT.dtype.element_ty),
                 mask=live[:, None])


# ---------------------------------------------------------------------------------------------------- dequantise
def _block_values(w: NF4Weight, start: int, stop: int) -> torch.Tensor:
    """The fp32 values of 64-blocks [start, stop) as ``[stop - start, 64]``: the kernel's formula in torch ops."""
    nf4 = _nf4_values(w.device)
    offset = torch.tensor(w.offset, dtype=torch.float32, device=w.device)
    group = torch.arange(start, stop, device=w.device) // NESTED_BLOCKSIZE
    absmax = w.nested_code[w.absmax_codes[start:stop].long()] * w.nested_absmax[group]
    absmax = absmax + offset
    byte = w.codes.reshape(-1)[start * BLOCKSIZE // 2: stop * BLOCKSIZE // 2]
    nibbles = torch.stack((byte >> 4, byte & 15), dim=-1).view(stop - start, BLOCKSIZE).long()
    return nf4[nibbles] * absmax[:, None]


def _dequantize_torch(w: NF4Weight, out: torch.Tensor) -> None:
    """The kernel's formula in torch ops, in chunks of 64-blocks so temporaries stay small."""
    flat = out.view(-1)
    for start in range(0, w.n_blocks, _TORCH_CHUNK_BLOCKS):
        stop = min(start + _TORCH_CHUNK_BLOCKS, w.n_blocks)
        flat[start * BLOCKSIZE: stop * BLOCKSIZE].view(stop - start, BLOCKSIZE).copy_(_block_values(w, start, stop))


def dequantize_nf4(w: NF4Weight, *, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dequantised weight, ``[*w.shape]`` (``[out_features, in_features]`` for a linear weight).

    value = NF4[nibble] * (dynamic[absmax_code] * nested_absmax + offset), in fp32, rounded once to the output dtype:
    bit-identical to bitsandbytes' ``dequantize_4bit`` (module docstring). Triton kernel or torch ops by
    ``backend(device)`` (docs/design.md, "Backends").

    Args:
        w: the NF4 weight.
        out: a contiguous float tensor of shape ``w.shape`` on w's device to write into (a reusable workspace; no
            full-size allocation happens when it is given).
        dtype: output dtype (fp32, fp16, bf16); default ``out.dtype`` when out is given, else ``w.dtype``.

    Raises:
        ValueError: w not an NF4Weight, an ``out`` of the wrong shape, device, layout or dtype, or a ``dtype`` that
            is not a float dtype or disagrees with ``out``.
    """
    if not isinstance(w, NF4Weight):
        raise ValueError(f"w must be an NF4Weight, got {type(w).__name__}")
    if dtype is not None and dtype not in _runtime.FLOAT_DTYPES:
        raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    if out is None:
        out = _runtime.empty(w.shape, dtype=dtype or w.dtype, device=w.device)
    else:
        _runtime.check_tensor("out", out)
        _runtime.check_shape("out", out, w.shape, "the NF4 weight's shape")
        if out.device != w.device:
            raise ValueError(f"out is on {out.device} but the NF4 weight on {w.device}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous (the kernel writes the weight's row-major order)")
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype {dtype} disagrees with out.dtype {out.dtype}")
    if _runtime.backend(w.device) == "torch":
        _dequantize_torch(w, out)
        return out
    _launch_dequantize(w, out, None)
    return out


def _launch_dequantize(w: NF4Weight, out: torch.Tensor, fp8_scale: torch.Tensor | None) -> None:
    nf4 = _nf4_values(w.device)
    fp8 = fp8_scale is not None
    _dequantize_nf4_kernel[(_runtime.cdiv(w.n_blocks, _KERNEL_BLOCKS),)](
        w.codes, w.absmax_codes, w.nested_absmax, w.nested_code, nf4, out.view(torch.uint8) if fp8 else out,
        fp8_scale if fp8 else nf4, w.offset, w.n_blocks, w.shape[-1] // BLOCKSIZE if fp8 else 1,
        BLOCKS=_KERNEL_BLOCKS, BLOCKSIZE_=BLOCKSIZE, NESTED_BLOCKSIZE_=NESTED_BLOCKSIZE, FP8=fp8, num_warps=4,
        enable_fp_fusion=False,
    )
