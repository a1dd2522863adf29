"""FP8 activation quantisation fused into the kernels that make GEMM inputs (issue #26): the e4m3 side outputs of
``ops.rms_norm(..., fp8_out=True)`` and of the GLU (plain and LoRA-fused), bit for bit ``quantize_rows`` of the
stored output (``fp8._quantize_rows_torch``, the reference checked in tests/test_fp8.py), on both backends (the
Triton one through the interpreter); the LoRA ops taking an already-quantised input; a patched FP8 Llama whose
loss and LoRA gradients are those of the separate-pass path while no separate pass runs for q/k/v, gate/up, down.
Outputs come from the NaN-poisoning allocator (conftest), so an unwritten code or scale shows up."""

import importlib

import pytest
import torch
from conftest import DEVICE
from test_fp8_kernels import assert_same_quantisation

from leantune import ops
from leantune.ops import fp8, glu
from leantune.ops.lora import glu_lowrank

rms_norm_module = importlib.import_module("leantune.ops.rms_norm")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rows_with_specials(shape, dtype, specials=True):
    """Rows of very different magnitudes; with ``specials`` an all-zero row, a NaN row and an inf row."""
    t = torch.randn(shape) * torch.logspace(-3, 3, shape[0])[:, None]
    if specials and shape[0] >= 4:
        t[0] = 0.0
        t[1, min(2, shape[1] - 1)] = float("nan")
        t[2, shape[1] // 2] = float("inf")
    return t.to(dtype).to(DEVICE)


# ------------------------------------------------------------------------------------------------------ RMSNorm
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy's inf / inf in the interpreter
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                             (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", [(7, 37), (2, 3, 100), (5, 1)])
def test_rms_norm_side_output_is_quantize_rows_of_the_stored_y(backend, casting, offset, x_dtype, w_dtype, shape):
    x = rows_with_specials((int(torch.tensor(shape[:-1]).prod()), shape[-1]), x_dtype).view(shape)
    w = (torch.randn(shape[-1]) * 2).to(w_dtype).to(DEVICE)
    y_plain = ops.rms_norm(x, w, 1e-5, offset=offset, casting=casting)
    y, quantized = ops.rms_norm(x, w, 1e-5, offset=offset, casting=casting, fp8_out=True)
    assert torch.equal(y.isnan(), y_plain.isnan())
    assert torch.equal(y.nan_to_num(), y_plain.nan_to_num())  # the side output changes nothing of y
    assert_same_quantisation(quantized, fp8._quantize_rows_torch(y.reshape(-1, shape[-1])),
                             f"{backend} {casting} {x_dtype} {w_dtype} {shape}")


def test_rms_norm_side_output_carries_no_gradient_and_leaves_backward_unchanged(backend):
    x = torch.randn(6, 40, device=DEVICE, requires_grad=True)
    w = torch.randn(40, device=DEVICE, requires_grad=True)
    dy = torch.randn(6, 40, device=DEVICE)
    y, (codes, scales) = ops.rms_norm(x, w, 1e-6, fp8_out=True)
    assert not codes.requires_grad and not scales.requires_grad
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dx_ref, dw_ref = torch.autograd.grad(ops.rms_norm(x, w, 1e-6), (x, w), dy)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (22, 48)), (torch.bfloat16, (37, 4096)),
                                         (torch.float16, (19, 1000))])
def test_rms_norm_side_output_leaves_y_and_rstd_bit_for_bit(backend, dtype, shape):
    """Plain random rows at the tiny FP8 Llama's shape (22 x 48, where a constexpr switch gave the card's FP8 variant
    its own reduction order: y 1 ulp apart) and at model widths: y, and dx (which reads the saved rstd), identical."""
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    w = (1 + torch.randn(shape[-1], device=DEVICE) / 4).to(dtype)
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    y, _ = ops.rms_norm(x, w, 1e-6, fp8_out=True)
    y_plain = ops.rms_norm(x, w, 1e-6)
    assert torch.equal(y, y_plain)
    (dx,) = torch.autograd.grad(y, x, dy)
    (dx_plain,) = torch.autograd.grad(y_plain, x, dy)
    assert torch.equal(dx, dx_plain)


def test_rms_norm_triton_kernel_writes_the_codes_in_its_own_pass(monkeypatch):
    """On the Triton path the codes come from the norm kernel, not from a quantisation launch."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    monkeypatch.setattr(fp8, "_quantize_rows_kernel", None)  # a launch would raise TypeError
    monkeypatch.setattr(rms_norm_module, "_quantize_rows_torch", None)
    x = torch.randn(9, 300, dtype=torch.bfloat16, device=DEVICE)
    _, (codes, scales) = ops.rms_norm(x, None, 1e-6, fp8_out=True)
    assert codes.shape == (9, 300) and scales.shape == (9,)


def test_rms_norm_fp8_out_must_be_a_bool():
    with pytest.raises(ValueError, match="fp8_out"):
        ops.rms_norm(torch.randn(2, 4), None, fp8_out=1)


# ---------------------------------------------------------------------------------------------------------- GLU
@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:overflow encountered")
@pytest.mark.parametrize("activation", glu.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 37), (2, 3, 130), (4, 1)])
def test_glu_side_output_is_quantize_rows_of_the_stored_h(backend, activation, dtype, shape):
    rows = int(torch.tensor(shape[:-1]).prod())
    gate = rows_with_specials((rows, shape[-1]), dtype).view(shape)
    up = rows_with_specials((rows, shape[-1]), dtype, specials=False).view(shape)
    h, quantized = glu.glu_forward(gate, up, activation, fp8_out=True)
    h_plain = glu.glu_forward(gate, up, activation)
    assert torch.equal(h.isnan(), h_plain.isnan()) and torch.equal(h.nan_to_num(), h_plain.nan_to_num())
    assert_same_quantisation(quantized, fp8._quantize_rows_torch(h.reshape(rows, shape[-1])),
                             f"{backend} {activation} {dtype} {shape}")


@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:overflow encountered")
@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_side_output_over_column_blocks_with_a_partial_last_one(dtype, monkeypatch):
    """Rows wider than the block (the I = 28672 case, here 64-wide blocks and 300 columns): h and its absmax block
    by block, then h read back for the codes; strided gate/up (two halves of a fused gate_up output)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    gate_up = rows_with_specials((5, 600), dtype)
    gate, up = gate_up[:, :300], gate_up[:, 300:]
    h, quantized = glu._forward_triton(gate, up, "swiglu", dtype, True, block=64)
    assert torch.equal(h.nan_to_num(), glu.glu_forward(gate, up, "swiglu").nan_to_num())
    assert_same_quantisation(quantized, fp8._quantize_rows_torch(h), str(dtype))


def test_glu_side_output_of_no_rows(backend):
    h, (codes, scales) = glu.glu_forward(torch.empty(0, 8, device=DEVICE), torch.empty(0, 8, device=DEVICE),
                                         "swiglu", fp8_out=True)
    assert h.shape == codes.shape == (0, 8) and scales.shape == (0,)


def test_glu_side_outputs_of_no_columns(backend):
    """I = 0: empty h, [rows, 0] codes; the LoRA GLU pass too."""
    h, (codes, scales) = glu.glu_forward(torch.empty(2, 5, 0, device=DEVICE), torch.empty(2, 5, 0, device=DEVICE),
                                         "swiglu", fp8_out=True)
    assert h.shape == (2, 5, 0) and codes.shape == (10, 0) and scales.shape == (10,)
    gate, up, xa = torch.empty(5, 0, device=DEVICE), torch.empty(5, 0, device=DEVICE), torch.randn(5, 2).to(DEVICE)
    b = torch.empty(0, 2, device=DEVICE)
    h, (codes, scales) = glu_lowrank.glu_forward_lowrank(gate, up, xa, b, 1.0, xa, b, 1.0, "swiglu", fp8_out=True)
    assert h.shape == codes.shape == (5, 0) and scales.shape == (5,)


@pytest.mark.parametrize("bad", [None, "0.5", [0.5], torch.ones(2), float("nan"), float("inf"), True])
def test_lora_glu_scalings_are_checked_before_any_work(backend, bad):
    """A scaling that is not a finite real number: ValueError naming it, gate and up untouched (both are written in
    place by the pass)."""
    gate, up = torch.randn(4, 8).to(DEVICE), torch.randn(4, 8).to(DEVICE)
    kept = gate.clone(), up.clone()
    xa, b = torch.randn(4, 2).to(DEVICE), torch.randn(8, 2).to(DEVICE)
    with pytest.raises(ValueError, match="s_u must be"):
        glu_lowrank.glu_forward_lowrank(gate, up, xa, b, 2.0, xa, b, bad, "swiglu", fp8_out=True)
    with pytest.raises(ValueError, match="s_g must be"):
        glu_lowrank.glu_forward_lowrank(gate, up, xa, b, bad, xa, b, 2.0, "swiglu")
    assert torch.equal(gate, kept[0]) and torch.equal(up, kept[1])


@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:overflow encountered")
@pytest.mark.parametrize("dtype,lora_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("n_rows,n_cols", [(19, 150), (3, 7), (5, 2100)])
def test_lora_glu_side_output_is_quantize_rows_of_the_stored_h(backend, dtype, lora_dtype, n_rows, n_cols):
    """The LoRA MLP's fused gate/up low-rank GLU pass: h, the in-place gate/up, and the codes of h as stored (19
    rows over 64-row tiles, 150 columns over two 128-column tiles whose row absmaxes the quantiser reduces; 2100
    columns: 17 tiles, and the quantiser's 2048-column blocks with a partial last one)."""
    gate = rows_with_specials((n_rows, n_cols), dtype)
    up = rows_with_specials((n_rows, n_cols), dtype, specials=False)
    xa_g, xa_u = (torch.randn(n_rows, r).to(lora_dtype).to(DEVICE) for r in (4, 3))
    b_g, b_u = (torch.randn(n_cols, r).to(lora_dtype).to(DEVICE) for r in (4, 3))
    gate2, up2 = gate.clone(), up.clone()
    h_plain = glu_lowrank.glu_forward_lowrank(gate2, up2, xa_g, b_g, 0.5, xa_u, b_u, 2.0, "swiglu")
    h, quantized = glu_lowrank.glu_forward_lowrank(gate, up, xa_g, b_g, 0.5, xa_u, b_u, 2.0, "swiglu", fp8_out=True)
    for got, ref in ((h, h_plain), (gate, gate2), (up, up2)):
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())
    assert_same_quantisation(quantized, fp8._quantize_rows_torch(h), f"{backend} {dtype} {lora_dtype}")


# ---------------------------------------------------------------------------------------------- the LoRA ops
def fp8_projection(out_features, in_features, dtype, rank=3):
    w = ops.quantize_fp8(torch.randn(out_features, in_features).to(DEVICE), dtype=dtype)
    lora_a = (torch.randn(rank, in_features) * 0.3).to(DEVICE).requires_grad_()
    lora_b = (torch.randn(out_features, rank) * 0.3).to(DEVICE).requires_grad_()
    return ops.LoraWeights(w, lora_a, lora_b, 0.75)


def count_separate_passes(monkeypatch):
    """Counts the separate activation quantisation passes of the LoRA passes (``passes.quantize_rows``)."""
    passes = importlib.import_module("leantune.ops.lora.passes")
    calls = []
    original = passes.quantize_rows

    def counted(t, **kwargs):
        calls.append(tuple(t.shape))
        return original(t, **kwargs)

    monkeypatch.setattr(passes, "quantize_rows", counted)
    return calls


def separate_glu_quantisation(monkeypatch):
    """The old path: lora_mlp's GLU without its side output, h's codes from a separate quantize_rows pass."""
    api = importlib.import_module("leantune.ops.lora.api")
    passes = importlib.import_module("leantune.ops.lora.passes")
    for name in ("glu_forward", "glu_forward_lowrank"):
        original = getattr(api, name)

        def separate(*args, fp8_out=False, _original=original, **kwargs):
            h = _original(*args, **kwargs)
            return (h, passes.quantize_rows(h)) if fp8_out else h

        monkeypatch.setattr(api, name, separate)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_lora_ops_take_the_quantised_input_and_skip_their_own_pass(backend, dtype, monkeypatch):
    """lora_qkv / lora_linear / lora_mlp with ``x_quantized``: outputs and gradients bit for bit those of the
    separate pass, with no quantize_rows call in forward (lora_mlp's down reads the GLU's codes)."""
    calls = count_separate_passes(monkeypatch)
    x = (torch.randn(2, 5, 24) * 3).to(dtype).to(DEVICE).requires_grad_()
    q, k, v = (fp8_projection(n, 24, dtype) for n in (16, 8, 8))
    gate, up, down = fp8_projection(40, 24, dtype), fp8_projection(40, 24, dtype), fp8_projection(24, 40, dtype)
    dy = torch.randn(2, 5, 24).to(dtype).to(DEVICE)

    def run(x_quantized):
        calls.clear()
        outs = (*ops.lora_qkv(x, q, k, v, x_quantized=x_quantized),
                ops.lora_linear(x, *q, x_quantized=x_quantized),
                ops.lora_mlp(x, gate, up, down, x_quantized=x_quantized))
        forward_calls = list(calls)
        loss = sum((o.float() * o.float()).sum() for o in outs[:4]) + (outs[4].float() * dy.float()).sum()
        params = [x, *(t for p in (q, gate, up, down) for t in (p.lora_A, p.lora_B))]
        return outs, torch.autograd.grad(loss, params), forward_calls

    with monkeypatch.context() as m:
        separate_glu_quantisation(m)
        outs_ref, grads_ref, calls_ref = run(None)
    assert len(calls_ref) == 4  # the separate passes: qkv's x, lora_linear's x, the MLP's x and h
    outs, grads, calls_fused = run(fp8.quantize_rows(x.detach().reshape(10, 24)))
    assert calls_fused == [], calls_fused
    for got, ref in zip((*outs, *grads), (*outs_ref, *grads_ref)):
        assert torch.equal(got, ref)


def test_x_quantized_is_ignored_where_the_gemm_input_is_a_cast_of_x(backend, monkeypatch):
    """An fp32 x under a bf16 base: the GEMM reads x cast to bf16, not x, so the given codes are not used."""
    calls = count_separate_passes(monkeypatch)
    x = torch.randn(4, 24, device=DEVICE)
    q = fp8_projection(16, 24, torch.bfloat16)
    ref = ops.lora_linear(x, *q)
    wrong = (torch.zeros(4, 24, dtype=fp8.E4M3, device=DEVICE), torch.ones(4, device=DEVICE))
    calls.clear()
    assert torch.equal(ops.lora_linear(x, *q, x_quantized=wrong), ref) and calls == [(4, 24)]


def test_bad_x_quantized_raises_before_any_kernel():
    x = torch.randn(3, 8)
    q = fp8_projection(4, 8, torch.float32)
    codes, scales = fp8.quantize_rows(x)
    for bad in ((codes,), (codes.float(), scales), (codes[:2], scales), (codes, scales[:2].double()),
                (codes.t(), scales), "codes"):
        with pytest.raises(ValueError, match="x_quantized"):
            ops.lora_linear(x, *q, x_quantized=bad)
    with pytest.raises(ValueError, match="x_quantized"):
        ops.lora_mlp(x, q, q, fp8_projection(8, 4, torch.float32), x_quantized=(codes, scales[:1]))


# ------------------------------------------------------------------------------------------ the patched model
def tiny_fp8_llama(quant_type="fp8"):
    import copy

    import peft
    import transformers

    import leantune

    torch.manual_seed(0)
    hidden, inter = (48, 136) if quant_type == "fp8" else (64, 192)  # NF4 rows: whole 64-blocks
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)  # quantised where the backend runs
    leantune.quantize(model, quant_type)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                       init_lora_weights=False))
    leantune.patch(model)
    return model, copy


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing,quant_type", [(False, "fp8"), (True, "fp8"), (True, "nf4-fp8")])
def test_patched_fp8_llama_fuses_every_norm_and_glu_quantisation_and_changes_nothing(backend, checkpointing,
                                                                                      quant_type, monkeypatch):
    """Loss and LoRA gradients bit for bit those of the separate-pass path; from the second step on the separate
    pass runs for o_proj's input only (SDPA's output: 2 layers x 1 in forward, again in a checkpointed recompute,
    which forms no down output and so quantises no down input).
    The same with NF4 storage and FP8 compute ("nf4-fp8")."""
    model, copy = tiny_fp8_llama(quant_type)
    if checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 96, (2, 11), device=DEVICE)
    model.to(DEVICE)
    reference = copy.deepcopy(model)
    calls = count_separate_passes(monkeypatch)
    with monkeypatch.context() as m:  # the old path: every GEMM input quantised in a separate pass
        separate_glu_quantisation(m)
        fp8_inputs = importlib.import_module("leantune.patch.fp8_inputs")
        m.setattr(fp8_inputs, "wanted", lambda norm: False)
        loss_ref, grads_ref = step(reference, ids)
    forwards = 2 if checkpointing else 1
    # per layer: the inputs of q/k/v, o_proj, gate/up and down; the recompute skips down's (its output is not formed)
    assert len(calls) == 2 * 4 + (2 * 3 if checkpointing else 0), calls
    step(model, ids)  # the first step teaches the norms that FP8 groups read their outputs
    calls.clear()
    loss, grads = step(model, ids)
    hidden = model.base_model.model.config.hidden_size
    assert calls == [(22, hidden)] * (forwards * 2), calls  # o_proj's input (heads x head_dim), per layer
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys() and all(torch.equal(grads[n], grads_ref[n]) for n in grads)
