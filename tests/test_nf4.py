"""NF4 weights: bit-exact against bitsandbytes 0.50.2 (quantise, dequantise, state dict), the Triton kernel through
the interpreter, reusable output workspaces, and the errors."""

import pytest
import reference
import torch
from conftest import DEVICE, ON_GPU

from leantune.ops import _runtime, nf4
from leantune.ops.nf4 import NF4Weight, dequantize_nf4, quantize_nf4

bnb_functional = pytest.importorskip("bitsandbytes.functional")
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute  # noqa: E402

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# (rows, cols): 280 blocks (a partial last 256-group, 9 kernel programs, the last partial); 108 blocks with rows that
# cross 64-blocks; exactly 256 blocks; one block.
SHAPES = [(40, 448), (72, 96), (256, 64), (1, 64)]


def bnb_quantize(weight):
    return bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")


def bnb_dequantize(packed, state, dtype):
    """bitsandbytes' dequantisation to ``dtype``. Its CPU C kernel assumes rows made of whole 64-blocks (with 96
    columns its own round trip is off by O(1)), so for other shapes this takes its torch kernel, the same formula."""
    state = bnb_functional.QuantState.from_dict(dict(state.as_dict(packed=True)), device=packed.device)
    state.dtype = dtype
    if state.shape[-1] % 64 == 0:
        return bnb_functional.dequantize_4bit(packed, state)
    absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return _dequantize_4bit_compute(packed.reshape(-1), absmax, state.code, 64, state.shape, dtype)


def weight_with_edge_blocks(shape, dtype):
    """Gaussian weights plus an all-zero block and a block sitting exactly on the NF4 rounding midpoints."""
    w = torch.randn(shape, dtype=torch.float32) * 0.02
    flat = w.view(-1)
    flat[:64] = 0.0
    if flat.numel() >= 128:
        table = torch.tensor(nf4.NF4_VALUES)
        mids = (table[:-1] + table[1:]) / 2
        flat[64:128] = torch.cat([torch.ones(1), mids, -mids, mids, -mids, mids])[:64]
    return w.to(dtype)


# ------------------------------------------------------------------------------------------------ format constants
def test_code_tables_equal_bitsandbytes():
    assert torch.equal(nf4.dynamic_map(), bnb_functional.create_dynamic_map())
    assert torch.equal(torch.tensor(nf4.NF4_VALUES, dtype=torch.float32), bnb_functional.get_4bit_type("nf4", "cpu"))


# ---------------------------------------------------------------------------------------------------- quantisation
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES + [(3, 19264)])
def test_quantize_bit_exact_with_bitsandbytes(shape, dtype):
    w = weight_with_edge_blocks(shape, dtype)
    packed, state = bnb_quantize(w)
    ours = quantize_nf4(w)
    assert torch.equal(ours.codes, packed.reshape(-1))
    assert torch.equal(ours.absmax_codes, state.absmax)
    assert torch.equal(ours.nested_absmax, state.state2.absmax)
    assert ours.offset == state.offset.item()
    assert ours.shape == tuple(shape) and ours.dtype == dtype


def test_quantize_constant_absmax_groups():
    """Every block with the same absmax: absmax - offset is all zero, so each 256-group has scale 0 and codes 0."""
    w = torch.randn(8, 64 * 300).sign().float()
    packed, state = bnb_quantize(w)
    ours = quantize_nf4(w)
    assert torch.equal(ours.absmax_codes, state.absmax) and torch.equal(ours.nested_absmax, state.state2.absmax)
    assert torch.equal(dequantize_nf4(ours), w)


# -------------------------------------------------------------------------------------------------- dequantisation
def dequantize_ref64(w: NF4Weight) -> torch.Tensor:
    """The format's formula in float64 from the stored fields (module docstring of ops/nf4.py)."""
    table = torch.tensor(nf4.NF4_VALUES, dtype=torch.float64)
    byte = w.codes.cpu().long()
    nibbles = torch.stack((byte >> 4, byte & 15), dim=-1).reshape(-1)
    group = torch.arange(w.n_blocks) // 256
    absmax = w.nested_code.double().cpu()[w.absmax_codes.cpu().long()] * w.nested_absmax.double().cpu()[group]
    absmax = absmax + w.offset
    return (table[nibbles].view(-1, 64) * absmax[:, None]).view(w.shape)


@pytest.mark.parametrize("out_dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_bit_exact_with_bitsandbytes(backend, shape, out_dtype):
    """Ours on DEVICE against bitsandbytes' dequantisation on DEVICE of its CPU quantisation (the bytes
    test_quantize_bit_exact_with_bitsandbytes holds ours to, bit for bit): on the card its CUDA kernel, whose
    rounding ours follows (its CPU kernel's fp16 output differs by an ulp on some draws)."""
    w = weight_with_edge_blocks(shape, torch.bfloat16)
    packed, state = bnb_quantize(w)
    ours = quantize_nf4(w).to(DEVICE)
    out = dequantize_nf4(ours, dtype=out_dtype)
    expected = bnb_dequantize(packed.to(DEVICE), state, out_dtype)
    assert out.dtype == out_dtype and out.shape == tuple(shape)
    reference.assert_close("dequantize_nf4", out, dequantize_ref64(ours), out_dtype)
    if backend == "triton" and out_dtype == torch.bfloat16 and not ON_GPU:
        # The interpreter truncates fp32 -> bf16 at the store (docs/design.md, "Backends"): one ulp toward zero.
        fp32 = dequantize_nf4(ours, dtype=torch.float32)
        truncated = (fp32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        assert torch.equal(torch.where(out == expected, truncated, out), truncated)
    else:
        assert torch.equal(out, expected)


def test_dequantize_defaults_to_the_quantised_dtype(backend):
    w = quantize_nf4(torch.randn(4, 128, dtype=torch.float16, device=DEVICE))
    assert dequantize_nf4(w).dtype == torch.float16


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_dequantize_into_poisoned_workspace(backend, out_dtype, monkeypatch):
    """``out=`` is written in place, every element (it starts as NaN), with no allocation through the op allocator;
    the torch path in several chunks."""
    monkeypatch.setattr(nf4, "_TORCH_CHUNK_BLOCKS", 7)
    w = quantize_nf4(torch.randn(24, 320, device=DEVICE))
    out = torch.full(w.shape, float("nan"), dtype=out_dtype, device=DEVICE)
    allocated = []

    def counting(shape, dtype, device):
        allocated.append(shape)
        return reference.nan_allocator(shape, dtype, device)

    with _runtime.use_allocator(counting):
        result = dequantize_nf4(w, out=out)
    assert result is out and not allocated
    packed, state = w.to_bnb()
    assert torch.equal(out, bnb_dequantize(packed, state, out_dtype))
    reference.assert_close("dequantize_nf4(out=)", out, dequantize_ref64(w), out_dtype)


# ---------------------------------------------------------------------------------------------- bitsandbytes I/O
def test_state_dict_equals_bitsandbytes_and_round_trips():
    w = torch.randn(48, 320, dtype=torch.bfloat16)
    packed, state = bnb_quantize(w)
    ours = quantize_nf4(w, name="model.layers.0.mlp.up_proj")
    entries = ours.state_dict("model.layers.0.mlp.up_proj.weight")
    theirs = {f"model.layers.0.mlp.up_proj.weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    theirs["model.layers.0.mlp.up_proj.weight"] = packed
    assert entries.keys() == theirs.keys()
    for key in entries:
        assert torch.equal(entries[key], theirs[key]), key

    loaded = NF4Weight.from_state_dict(theirs, "model.layers.0.mlp.up_proj.weight")
    from_bnb = NF4Weight.from_bnb(packed, state)
    for w2 in (loaded, from_bnb):
        for field in ("codes", "absmax_codes", "nested_absmax", "code", "nested_code"):
            assert torch.equal(getattr(w2, field), getattr(ours, field)), field
        assert (w2.offset, w2.shape, w2.dtype) == (ours.offset, ours.shape, ours.dtype)

    packed_back, state_back = ours.to_bnb()
    assert torch.equal(packed_back, packed)
    assert torch.equal(bnb_functional.dequantize_4bit(packed_back, state_back), dequantize_nf4(ours))


# ---------------------------------------------------------------------------------------------------------- errors
def test_quantize_errors_name_the_layer():
    with pytest.raises(ValueError, match=r"layers\.3\.q_proj: .*multiple of the blocksize 64"):
        quantize_nf4(torch.randn(3, 10), name="layers.3.q_proj")
    with pytest.raises(ValueError, match=r"layers\.3\.q_proj: must be a float32"):
        quantize_nf4(torch.zeros(4, 64, dtype=torch.int32), name="layers.3.q_proj")
    bad = torch.randn(2, 64)
    bad[1, 5] = float("inf")
    with pytest.raises(ValueError, match=r"layers\.3\.q_proj: holds inf or NaN"):
        quantize_nf4(bad, name="layers.3.q_proj")


def fields(w: NF4Weight) -> dict:
    return {f: getattr(w, f) for f in ("codes", "absmax_codes", "nested_absmax", "offset", "code", "nested_code",
                                       "shape", "dtype")}


def test_container_checks_dtypes_and_sizes():
    good = fields(quantize_nf4(torch.randn(8, 128)))
    cases = [
        (dict(codes=good["codes"].to(torch.int16)), r"codes must be a torch.uint8 tensor"),
        (dict(absmax_codes=good["absmax_codes"].float()), r"absmax_codes must be a torch.uint8 tensor"),
        (dict(nested_absmax=good["nested_absmax"].half()), r"nested_absmax must be a torch.float32"),
        (dict(shape=(8, 256)), r"codes must have 1024 elements for shape \(8, 256\)"),
        (dict(codes=good["codes"][:-32]), r"codes must have 512 elements"),
        (dict(shape=(4, 100)), r"shape \(4, 100\) must hold a positive multiple of 64"),
        (dict(dtype=torch.int8), r"dtype must be float32, float16 or bfloat16, got torch.int8"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=r"layers\.0\.o_proj: " + message):
            NF4Weight(**{**good, **change}, name="layers.0.o_proj")


def test_state_dict_errors_name_the_layer():
    w = torch.randn(16, 128)
    packed, state = bnb_quantize(w)
    entries = {f"q.weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    entries["q.weight"] = packed

    missing = {k: v for k, v in entries.items() if k != "q.weight.quant_map"}
    with pytest.raises(ValueError, match=r"q\.weight: the quant state lacks q\.weight\.quant_map"):
        NF4Weight.from_state_dict(missing, "q.weight")
    no_meta = {k: v for k, v in entries.items() if "quant_state" not in k}
    with pytest.raises(ValueError, match=r"layer 7: no quant state"):
        NF4Weight.from_state_dict(no_meta, "q.weight", name="layer 7")
    corrupt = {**entries, "q.weight.quant_map": entries["q.weight.quant_map"].flip(0)}
    with pytest.raises(ValueError, match=r"q\.weight: quant_map is not the NF4 table"):
        NF4Weight.from_state_dict(corrupt, "q.weight")
    wrong_dtype = {**entries, "q.weight.absmax": entries["q.weight.absmax"].float()}
    with pytest.raises(ValueError, match=r"q\.weight: q\.weight\.absmax must be a torch\.uint8 tensor"):
        NF4Weight.from_state_dict(wrong_dtype, "q.weight")
    truncated = {**entries, "q.weight": entries["q.weight"][:-1]}
    with pytest.raises(ValueError, match=r"q\.weight: codes must have 1024 elements"):
        NF4Weight.from_state_dict(truncated, "q.weight")

    packed_fp4, state_fp4 = bnb_functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="fp4")
    with pytest.raises(ValueError, match=r"k_proj: quant type 'fp4' is not supported yet"):
        NF4Weight.from_bnb(packed_fp4, state_fp4, name="k_proj")
    packed_plain, state_plain = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4")
    with pytest.raises(ValueError, match=r"k_proj: the weight is not double-quantised"):
        NF4Weight.from_bnb(packed_plain, state_plain, name="k_proj")
    packed_128, state_128 = bnb_functional.quantize_4bit(w, blocksize=128, compress_statistics=True, quant_type="nf4")
    with pytest.raises(ValueError, match=r"k_proj: quant state blocksize must be 64, got 128"):
        NF4Weight.from_bnb(packed_128, state_128, name="k_proj")


def test_dequantize_errors():
    w = quantize_nf4(torch.randn(8, 128))
    with pytest.raises(ValueError, match=r"out must have shape \(8, 128\)"):
        dequantize_nf4(w, out=torch.empty(128, 8))
    with pytest.raises(ValueError, match=r"dtype torch.float16 disagrees with out.dtype torch.float32"):
        dequantize_nf4(w, out=torch.empty(8, 128), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"out must be contiguous"):
        dequantize_nf4(w, out=torch.empty(128, 8).t())
    with pytest.raises(ValueError, match=r"out must be float32, float16 or bfloat16"):
        dequantize_nf4(w, out=torch.empty(8, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"dtype must be torch.float32"):
        dequantize_nf4(w, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"w must be an NF4Weight"):
        dequantize_nf4(torch.randn(8, 128))


# ------------------------------------------------------------------------------------------- leantune.quantize
def test_quantize_model_loss_matches_float64_of_dequantised_weights(monkeypatch):
    """A tiny Llama with NF4 decoder linears: its loss is near the fp32 model's (NF4 error) and equals, within fp32
    rounding, a float64 run of the same model whose linear weights are the dequantised NF4 values."""
    import copy

    from test_patch_families import batch, tiny_model

    import leantune
    from leantune.quantize import NF4Linear

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_model("llama", device=DEVICE)
    input_ids, labels = batch(device=DEVICE)
    quantised = copy.deepcopy(model)
    summary = leantune.quantize(quantised, "nf4")
    assert summary["layers"] == 2 * 7 and summary["bytes_after"] < summary["bytes_before"] / 7
    assert isinstance(quantised.lm_head, torch.nn.Linear) and not isinstance(quantised.lm_head, NF4Linear)
    assert type(quantised.model.embed_tokens) is torch.nn.Embedding

    reference64 = copy.deepcopy(model)
    for name, module in quantised.named_modules():
        if isinstance(module, NF4Linear):
            target = reference64.get_submodule(name)
            with torch.no_grad():
                target.weight.copy_(dequantize_nf4(module.weight_nf4, dtype=torch.float32))
    reference64.double()

    with reference.fp32_products():  # on CUDA: the NF4 model's fp32 products in full fp32, as the 1e-5 bar needs
        loss = quantised(input_ids=input_ids, labels=labels).loss
        loss.backward()
        loss64 = reference64(input_ids=input_ids, labels=labels).loss
        loss64.backward()
        with torch.no_grad():
            loss_fp32 = model(input_ids=input_ids, labels=labels).loss
    reference.assert_close("NF4 model loss", loss, loss64, torch.float32)
    reference.assert_close("embedding gradient through NF4 linears", quantised.model.embed_tokens.weight.grad,
                           reference64.model.embed_tokens.weight.grad, torch.float32)
    # NF4 moves a random tiny model's loss by a few percent (up to 6.6% over 40 seeds): a sanity bound only, the
    # exactness is the float64 comparison above and the bit-exact tests against bitsandbytes
    assert 0 < abs(loss.item() - loss_fp32.item()) < 0.2 * loss_fp32.item()


def test_quantize_model_errors_leave_it_unchanged():
    from test_patch_families import tiny_model

    import leantune

    model = tiny_model("llama")
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(10, 3)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: NF4 needs a number of weights"):
        leantune.quantize(model, "nf4")
    from leantune.quantize import NF4Linear

    assert not any(isinstance(m, NF4Linear) for m in model.modules())
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with pytest.raises(ValueError, match=r"quant_type must be one of \('nf4', 'fp8', 'nf4-fp8'\) \(lower case\), "
                                         r"got 'fp4'"):
        leantune.quantize(model, "fp4")
    with pytest.raises(ValueError, match=r"quantize needs a Hugging Face causal LM with get_decoder\(\), got Linear"):
        leantune.quantize(torch.nn.Linear(64, 64), "nf4")


# ------------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.skipif(not ON_GPU, reason="bitsandbytes' CUDA kernels and the Triton kernel on the card")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(14336, 4096), (4096, 4096), (72, 96)])
def test_cuda_dequantize_bit_exact_with_bitsandbytes_cuda(shape, dtype, monkeypatch):
    """A weight quantised by bitsandbytes on the GPU, dequantised by its CUDA kernel and by ours (Triton), bit for
    bit, at Llama-3-8B projection sizes."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    w = (torch.randn(shape, device="cuda") * 0.02).to(dtype)
    packed, state = bnb_quantize(w)
    ours = dequantize_nf4(NF4Weight.from_bnb(packed, state), dtype=dtype)
    theirs = bnb_functional.dequantize_4bit(packed, state)
    assert ours.dtype == theirs.dtype == dtype and ours.shape == theirs.shape
    assert torch.equal(ours, theirs), (ours != theirs).sum().item()
