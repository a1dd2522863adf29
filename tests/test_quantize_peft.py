"""leantune.quantize's layers with what PEFT and transformers do around them: DoRA through PEFT's dequantisation
probe, merges refused until leantune.dequantize, save_pretrained and float state dicts refused, argument checks."""

import copy

import pytest
import test_fp8
import torch
from reference import rel_err

import leantune
from leantune.quantize import FP8Linear, NF4Linear

QUANT_TYPES = ("fp8", "nf4")
tiny_llama = test_fp8.tiny_llama  # the fixture: a random 2-layer Llama, hidden 64
VOCAB, peft, transformers = test_fp8.VOCAB, test_fp8.peft, test_fp8.transformers


def _lora(model, dora=False):
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", use_dora=dora,
                                                      init_lora_weights=False))


def _quantized(base, quant_type):
    model = copy.deepcopy(base)
    leantune.quantize(model, quant_type)
    return model


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("order", ["peft first", "quantize first"])
def test_dora_over_quantized_layers_reads_their_dense_weight(tiny_llama, quant_type, order):
    """PEFT's DoRA norm reads the layer's dequantised weight (its W_q / dequantize() probe), not the codes: the
    same outputs as DoRA over an nn.Linear holding that weight (NF4: exactly; FP8: the base GEMM also quantises
    its input per token, the e4m3 error of plain LoRA over it)."""
    if order == "peft first":
        model = _lora(copy.deepcopy(tiny_llama), dora=True)
        leantune.quantize(model, quant_type)
    else:
        model = _lora(_quantized(tiny_llama, quant_type), dora=True)
    with torch.no_grad():  # away from DoRA's start, where magnitude = ||W + BA|| hides the norm
        for name, p in model.named_parameters():
            if "lora_magnitude" in name:
                p.mul_(1 + 0.3 * torch.rand_like(p))
    dense = _quantized(tiny_llama, quant_type)
    assert leantune.dequantize(dense) == {"layers": 14, "experts": 0}
    reference = _lora(dense, dora=True)
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    ids = torch.randint(0, VOCAB, (2, 12))
    loss, ref_loss = (m(input_ids=ids, labels=ids).loss for m in (model, reference))
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    ref_q = reference.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(5, 64)
    if quant_type == "nf4":
        assert torch.equal(loss, ref_loss) and torch.equal(q_proj(x), ref_q(x))
    else:
        # (without the probe PEFT reads the e4m3 codes, up to 448, as the weight: a norm off by orders)
        assert rel_err(q_proj(x), ref_q(x)) <= 2 ** -4 and rel_err(loss, ref_loss) <= 1e-3


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("dora", [False, True])
def test_merges_are_refused_until_dequantize(tiny_llama, quant_type, dora):
    """PEFT's merge writes a float matrix into the base weight: over codes it raises and changes nothing (safe or
    not); after leantune.dequantize the merge gives the adapter's outputs, and save_pretrained works."""
    model = _lora(_quantized(tiny_llama, quant_type), dora=dora)
    ids = torch.randint(0, VOCAB, (2, 12))
    before = model(input_ids=ids).logits
    codes = {n: b.clone() for n, b in model.named_buffers()}
    for safe in (False, True):  # one clear error, whatever PEFT's merge path (its first step on the codes)
        with pytest.raises(ValueError, match=r"quantised weight codes .* leantune.dequantize\(model\) first"):
            model.merge_adapter(safe_merge=safe)
        assert all(torch.equal(b, codes[n]) for n, b in model.named_buffers())
    for module in model.modules():  # a failed merge leaves no layer marked merged
        assert not getattr(module, "merged_adapters", [])
    assert torch.equal(model(input_ids=ids).logits, before)
    done = leantune.dequantize(model)
    assert done["layers"] == 14 and not any(isinstance(m, (FP8Linear, NF4Linear)) for m in model.modules())
    unmerged = model(input_ids=ids).logits
    merged = model.merge_and_unload()
    assert rel_err(merged(input_ids=ids).logits, unmerged) <= 1e-5
    if quant_type == "nf4":  # NF4Linear computes with exactly the dequantised weight
        assert torch.equal(unmerged, before)


def test_nf4_merge_cannot_replace_the_codes(tiny_llama):
    layer = _quantized(tiny_llama, "nf4").model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="leantune.dequantize"):
        layer.weight.data = torch.zeros(64, 64, dtype=torch.uint8)
    assert layer.codes.shape == (64 * 64 // 2,)


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_save_pretrained_and_float_state_dicts_are_refused(tiny_llama, quant_type, tmp_path):
    model = _quantized(tiny_llama, quant_type)
    with pytest.raises(ValueError, match="leantune.dequantize"):
        model.save_pretrained(tmp_path / "q")
    assert not (tmp_path / "q").exists()
    peft_model = _lora(copy.deepcopy(model))
    peft_model.save_pretrained(tmp_path / "adapter")  # the adapter alone: PEFT's own save
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    ids = torch.randint(0, VOCAB, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    state = {k: v.clone() for k, v in model.state_dict().items()}
    other = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    for strict in (True, False):  # a float weight: refused by name before anything is copied (embeddings too)
        with pytest.raises(RuntimeError, match=r"q_proj.weight: .* cannot be loaded into leantune's.*nothing was"):
            model.load_state_dict(other.state_dict(), strict=strict)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(model(input_ids=ids, labels=ids).loss, loss)
    model.load_state_dict(state)  # its own state dict still loads
    # another quantised model's state dict carries its codes (and NF4's offsets): they load, with its outputs
    moved = _quantized(other, quant_type)
    moved.load_state_dict(state)
    assert torch.equal(moved(input_ids=ids, labels=ids).loss, loss)
    leantune.dequantize(model)
    model.save_pretrained(tmp_path / "dense")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert torch.equal(reloaded(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss)


def test_quantize_argument_errors(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    with pytest.raises(ValueError, match="dtype must be None or one of"):
        leantune.quantize(model, "fp8", dtype=torch.int8)
    with pytest.raises(ValueError, match=r"\(lower case\)"):
        leantune.quantize(model, "FP8")
    assert leantune.quantize(model, "fp8")["layers"] == 14
    with pytest.raises(ValueError, match="already quantised with compute dtype torch.float32"):
        leantune.quantize(model, "fp8", dtype=torch.bfloat16)
    assert leantune.quantize(model, "fp8")["layers"] == 0  # nothing left: a no-op
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="no nn.Linear layer in its decoder blocks"):
        leantune.quantize(gpt2, "fp8")
    with pytest.raises(ValueError, match="float64 model cannot run them"):
        model.model.layers[0].self_attn.q_proj(torch.randn(2, 64, dtype=torch.float64))


@pytest.mark.parametrize("quant_type", ["fp8", "nf4", "nf4-fp8"])
def test_summary_names_the_quantized_layers(tiny_llama, quant_type):
    model = leantune.patch(_lora(_quantized(tiny_llama, quant_type)))
    summary = model.base_model.model.leantune_summary
    assert summary["quantized"] == {quant_type: 14}
    assert any(part.startswith("frozen weights of leantune.quantize") and f"{quant_type} 14" in part
               for part in summary["fused"])
    leantune.unpatch(model)
    assert model.base_model.model.leantune_summary["quantized"] == {quant_type: 14}
    patched_first = leantune.patch(_lora(copy.deepcopy(tiny_llama)))
    summary = patched_first.base_model.model.leantune_summary
    assert summary["quantized"] == {} and not any("leantune.quantize" in part for part in summary["fused"])
    leantune.quantize(patched_first, quant_type)  # after patch: the summary reads it
    assert summary["quantized"] == {quant_type: 14} and f"{quant_type} 14" in summary["fused"][-1]
    leantune.dequantize(patched_first)
    assert summary["quantized"] == {} and dict(summary.items())["quantized"] == {}


@pytest.mark.parametrize("quant_type", ["fp8", "nf4", "nf4-fp8"])
def test_quantized_layer_and_dequantize_argument_errors(tiny_llama, quant_type):
    """A quantised layer names itself for a wrong input dtype or width; dequantize refuses a non-float dtype before
    any layer changes (an int8 cast of the FP8 values zeroed every weight)."""
    model = _quantized(tiny_llama, quant_type)
    q_proj = model.model.layers[0].self_attn.q_proj
    for x, message in ((torch.randn(2, 63), r"last dimension must be in_features = 64, got shape \(2, 63\)"),
                       (torch.ones(2, 64, dtype=torch.int64), "takes float32, float16 or bfloat16 inputs, got "
                                                               "torch.int64"),
                       (torch.randn(2, 64, dtype=torch.float64), "float64 model cannot run them")):
        with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj: .*" + message):
            q_proj(x)
    for dtype in (torch.int8, torch.float64, torch.bool, "bf16"):
        with pytest.raises(ValueError, match="dtype must be None or one of"):
            leantune.dequantize(model, dtype=dtype)
        assert sum(isinstance(m, (FP8Linear, NF4Linear)) for m in model.modules()) == 14
    with pytest.raises(ValueError, match="quantised weight codes"):  # arithmetic on the view, not on a copy
        q_proj.weight + 1
    assert q_proj.weight.to(torch.float32).sum().isfinite()


def test_nf4_refuses_block_maxima_whose_mean_overflows():
    from leantune.ops import quantize_nf4

    with pytest.raises(ValueError, match=r"down: its 64-blocks' absolute maxima \(up to 1e\+37\) are too large"):
        quantize_nf4(torch.full((128, 64), 1e37), name="down")
    weight = torch.randn(128, 64)
    weight[0] = 1e38  # one huge block: the mean stays finite, NF4 holds it
    assert quantize_nf4(weight).codes.numel() == 128 * 32


@pytest.mark.parametrize("quant_type", ["fp8", "nf4"])
def test_run_checkpoints_leave_the_frozen_quantised_base_out(tiny_llama, quant_type):
    """The adapter state a run's checkpoint gathers holds the trainable tensors only: the quantised codes are
    buffers, which torch.distributed.checkpoint's ignore_frozen_params keeps, so they are hidden while it runs."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from leantune.quantize import quantized_storage_hidden
    from leantune.train.checkpoint import _FULL, adapter_state

    model = _lora(_quantized(tiny_llama, quant_type))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    gathered = set(get_model_state_dict(model, options=_FULL))
    assert gathered > trainable and any("layers.0.self_attn.q_proj.base_layer" in k for k in gathered)  # the codes
    with quantized_storage_hidden(model):
        gathered = set(get_model_state_dict(model, options=_FULL))
    assert not [k for k in gathered - trainable if "layers" in k]  # no frozen quantised storage gathered
    state = adapter_state(model)
    assert len(state) == len(trainable) == 2 * 7 * 2
    assert any(k.endswith("weight_scale" if quant_type == "fp8" else "codes") for k in model.state_dict())
