"""The GLU backward that writes the e4m3 codes of [d_gate diag(m_gate), d_up diag(m_up)] in its own pass
(``ops.glu_fp8.glu_backward_fp8``, issue #26): d_gate/d_up bit for bit ``glu_backward``'s, codes and scales bit for
bit the separate quantisation of the stored halves (``fp8._quantize_rows_torch`` of the concatenated fp32 product,
the chain ``fp8_group.quantize_grad_outputs`` runs), on both backends (Triton through the interpreter), one register
block and column blocks, in place and not; the LoRA MLP and a patched FP8 model take the codes and skip the
separate pass with the same loss and gradients. Outputs come from the NaN-poisoning allocator (conftest)."""

import importlib

import pytest
import torch
from conftest import DEVICE
from test_fp8_fused import fp8_projection, rows_with_specials, step, tiny_fp8_llama
from test_fp8_kernels import assert_same_quantisation

from leantune import ops
from leantune.ops import fp8, fp8_group, glu, glu_fp8

api = importlib.import_module("leantune.ops.lora.api")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def multipliers(width, seed=0):
    """Per-channel multipliers over six binades, one of them zero (its codes must be 0)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(width, generator=g) * torch.logspace(-4, 2, width)
    m[width // 3] = 0.0
    return m.to(DEVICE)


def reference(dh, gate, up, activation, m_gate, m_up):
    d_gate, d_up = glu.glu_backward(dh, gate, up, activation)
    width = gate.shape[-1]
    g = torch.cat([d_gate.reshape(-1, width).float() * m_gate, d_up.reshape(-1, width).float() * m_up], dim=1)
    return d_gate, d_up, fp8._quantize_rows_torch(g)


def assert_same_values(got, ref):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())


@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:overflow encountered")
@pytest.mark.parametrize("activation", glu.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 37), (2, 3, 130), (4, 1)])
def test_codes_are_the_separate_quantisation_of_the_stored_halves(backend, activation, dtype, shape):
    rows = int(torch.tensor(shape[:-1]).prod())
    width = shape[-1]
    dh = rows_with_specials((rows, width), dtype).view(shape)
    gate = rows_with_specials((rows, width), dtype, specials=False).view(shape)
    up = rows_with_specials((rows, width), dtype, specials=False).view(shape)
    m_gate, m_up = multipliers(width), multipliers(width, seed=1)
    d_gate_ref, d_up_ref, quantized_ref = reference(dh, gate, up, activation, m_gate, m_up)
    d_gate, d_up, quantized = glu_fp8.glu_backward_fp8(dh, gate, up, activation, m_gate, m_up)
    assert_same_values(d_gate, d_gate_ref)
    assert_same_values(d_up, d_up_ref)
    assert_same_quantisation(quantized, quantized_ref, f"{backend} {activation} {dtype} {shape}")


@pytest.mark.parametrize("width", [37, 300])
def test_dequantised_codes_are_the_float64_gradient_within_the_e4m3_bound(backend, width, monkeypatch):
    """Against the formulas in float64 (swiglu: d_up = dh g s, d_gate = dh u s (1 + g (1 - s)), s = sigmoid(g)),
    g = [d_gate m_gate, d_up m_up] per row: codes x scale within e4m3's rounding, half an ulp of a 3-bit mantissa
    (2^-4 relative) for normals, half the subnormal spacing (2^-10 of the scale) below; fp32 inputs. With 64-column
    limits the 300-wide rows take the column-block path on the Triton backend."""
    monkeypatch.setattr(glu_fp8, "ONE_BLOCK_COLS", 64)
    monkeypatch.setattr(glu_fp8, "LOOP_BLOCK", 64)
    dh, gate, up = (torch.randn(9, width).to(DEVICE) for _ in range(3))
    m_gate, m_up = multipliers(width), multipliers(width, seed=3)
    _, _, (codes, scales) = glu_fp8.glu_backward_fp8(dh, gate, up, "swiglu", m_gate, m_up)
    g64, u64, dh64 = gate.double(), up.double(), dh.double()
    s = torch.sigmoid(g64)
    exact = torch.cat([dh64 * u64 * s * (1 + g64 * (1 - s)) * m_gate.double(), dh64 * g64 * s * m_up.double()], 1)
    got = codes.double() * scales.double()[:, None]
    bound = 2.0 ** -4 * exact.abs() + 2.0 ** -10 * scales.double()[:, None] + 1e-6 * exact.abs()  # + fp32 terms
    assert (got - exact).abs().le(bound).all(), ((got - exact).abs() / bound).max()
    assert torch.allclose(scales.double(), exact.abs().amax(1) / 448, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:overflow encountered")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_column_blocks_with_a_partial_last_one(dtype, inplace, monkeypatch):
    """Rows wider than the block (the I = 14336 case on the card, here 64-wide blocks and 300 columns): d_gate and
    d_up stored with the running absmax, then read back for the codes; in place over gate and up."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    dh = rows_with_specials((5, 300), dtype)
    gate = rows_with_specials((5, 300), dtype, specials=False)
    up = rows_with_specials((5, 300), dtype, specials=False)
    m_gate, m_up = multipliers(300), multipliers(300, seed=2)
    d_gate_ref, d_up_ref, quantized_ref = reference(dh, gate, up, "swiglu", m_gate, m_up)
    gate_in, up_in = gate.clone(), up.clone()
    d_gate, d_up, codes, scales = glu_fp8._backward_fp8_triton(dh, gate_in, up_in, "swiglu", m_gate, m_up, inplace,
                                                               block=64)
    assert_same_values(d_gate, d_gate_ref)
    assert_same_values(d_up, d_up_ref)
    assert_same_quantisation((codes, scales), quantized_ref, f"{dtype} inplace={inplace}")
    if inplace:
        assert d_gate.data_ptr() == gate_in.data_ptr() and d_up.data_ptr() == up_in.data_ptr()
    else:
        assert torch.equal(gate_in, gate) and torch.equal(up_in, up)


def test_in_place_writes_over_gate_and_up(backend):
    dh, gate, up = (torch.randn(7, 40).to(DEVICE) for _ in range(3))
    m = multipliers(40)
    d_gate_ref, d_up_ref, quantized_ref = reference(dh, gate, up, "geglu_tanh", m, m)
    gate_in, up_in = gate.clone(), up.clone()
    d_gate, d_up, quantized = glu_fp8.glu_backward_fp8(dh, gate_in, up_in, "geglu_tanh", m, m, inplace=True)
    assert d_gate.data_ptr() == gate_in.data_ptr() and d_up.data_ptr() == up_in.data_ptr()
    assert torch.equal(gate_in, d_gate_ref) and torch.equal(up_in, d_up_ref)
    assert_same_quantisation(quantized, quantized_ref, backend)


def test_no_rows(backend):
    empty = torch.empty(0, 8, device=DEVICE)
    d_gate, d_up, (codes, scales) = glu_fp8.glu_backward_fp8(empty, empty, empty.clone(), "swiglu",
                                                             multipliers(8), multipliers(8))
    assert d_gate.shape == d_up.shape == (0, 8) and codes.shape == (0, 16) and scales.shape == (0,)


def test_no_columns(backend):
    """I = 0: empty halves and [rows, 0] codes, scales at the floor (as quantize_rows of an empty row)."""
    empty = torch.empty(2, 3, 0, device=DEVICE)
    none = torch.empty(0, device=DEVICE)
    d_gate, d_up, (codes, scales) = glu_fp8.glu_backward_fp8(empty, empty, empty.clone(), "swiglu", none, none)
    assert d_gate.shape == d_up.shape == (2, 3, 0) and codes.shape == (6, 0)
    assert torch.equal(scales, fp8._quantize_rows_torch(torch.empty(6, 0))[1].to(DEVICE))


@pytest.mark.parametrize("bad,match", [
    (lambda m: m.double(), "m_gate must be a float32 tensor of shape \\(8,\\)"),
    (lambda m: m[:7], "m_gate must be a float32 tensor of shape \\(8,\\)"),
    (lambda m: m.tolist(), "m_gate must be a float32 tensor .* got list"),
])
def test_bad_multipliers_raise_before_any_kernel(bad, match, monkeypatch):
    monkeypatch.setattr(glu_fp8, "_glu_backward_fp8_kernel", None)  # a launch would raise TypeError
    dh, gate, up = (torch.randn(3, 8).to(DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match=match):
        glu_fp8.glu_backward_fp8(dh, gate, up, "swiglu", bad(multipliers(8)), multipliers(8))


def test_in_place_needs_contiguous_halves_that_do_not_overlap():
    dh = torch.randn(3, 8).to(DEVICE)
    gate_up = torch.randn(3, 16).to(DEVICE)
    with pytest.raises(ValueError, match="gate must be contiguous"):
        glu_fp8.glu_backward_fp8(dh, gate_up[:, :8], gate_up[:, 8:], "swiglu", multipliers(8), multipliers(8),
                                 inplace=True)
    gate = torch.randn(3, 8).to(DEVICE)
    with pytest.raises(ValueError, match="must not overlap"):
        glu_fp8.glu_backward_fp8(dh, gate, gate, "swiglu", multipliers(8), multipliers(8), inplace=True)


def count_group_quantisations(monkeypatch):
    """Shapes of the dY quantisations inside the grouped FP8 dX (``fp8_group.quantize_grad_outputs``)."""
    calls = []
    original = fp8_group.quantize_grad_outputs

    def counted(dys, ws):
        calls.append(sum(dy.shape[1] for dy in dys))
        return original(dys, ws)

    monkeypatch.setattr(fp8_group, "quantize_grad_outputs", counted)
    return calls


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_lora_mlp_takes_the_codes_from_the_glu_pass(backend, dtype, monkeypatch):
    """dX and every LoRA gradient bit for bit those of the separate quantisation pass; that pass no longer runs."""
    torch.manual_seed(0)
    gate, up, down = fp8_projection(40, 24, dtype), fp8_projection(40, 24, dtype), fp8_projection(24, 40, dtype)
    x = torch.randn(2, 5, 24).to(dtype).to(DEVICE).requires_grad_()
    params = [x, *(t for p in (gate, up, down) for t in (p.lora_A, p.lora_B))]
    calls = count_group_quantisations(monkeypatch)

    def run(fused):
        monkeypatch.setattr(api, "FUSED_GLU_GRAD_OUTPUT", fused)
        calls.clear()
        y = ops.lora_mlp(x, gate, up, down)
        return torch.autograd.grad((y.float() ** 2).sum(), params), list(calls)

    grads_ref, calls_ref = run(False)
    grads, calls_fused = run(True)
    assert calls_ref == [80] and calls_fused == [], (calls_ref, calls_fused)
    assert all(torch.equal(g, r) for g, r in zip(grads, grads_ref))


@pytest.mark.parametrize("quant_type", ["fp8", "nf4-fp8"])
def test_patched_fp8_llama_quantises_gate_up_dy_in_the_glu_pass(backend, quant_type, monkeypatch):
    """A patched FP8 (and NF4-storage, FP8-compute) Llama: the grouped dX quantisations left are q/k/v's; loss and
    LoRA gradients bit for bit those with the separate gate/up pass."""
    model, copy = tiny_fp8_llama(quant_type)
    model.train()
    ids = torch.randint(0, 96, (2, 11), device=DEVICE)
    reference_model = copy.deepcopy(model)
    calls = count_group_quantisations(monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(api, "FUSED_GLU_GRAD_OUTPUT", False)
        loss_ref, grads_ref = step(reference_model, ids)
    config = model.base_model.model.config
    qkv = config.hidden_size + 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    # per layer gate/up's; q/k/v's from the second layer on (the first one's input, the embeddings, needs no dX)
    assert sorted(calls) == sorted([qkv] + [2 * config.intermediate_size] * 2), calls
    calls.clear()
    loss, grads = step(model, ids)
    assert calls == [qkv], calls
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys() and all(torch.equal(grads[n], grads_ref[n]) for n in grads)
