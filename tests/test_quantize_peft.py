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
    for safe in (False, True):
        with pytest.raises((RuntimeError, NotImplementedError, ValueError)):
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
    for strict in (True, False):  # a float weight: refused by name, this layer's codes untouched
        with pytest.raises(RuntimeError, match="cannot be loaded into leantune's"):
            model.load_state_dict(tiny_llama.state_dict(), strict=strict)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items() if "layers" in k and "proj" in k)
    assert torch.equal(model(input_ids=ids, labels=ids).loss, loss)
    model.load_state_dict(state)  # its own state dict still loads
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
    assert leantune.patch(_lora(copy.deepcopy(tiny_llama))).base_model.model.leantune_summary["quantized"] == {}
