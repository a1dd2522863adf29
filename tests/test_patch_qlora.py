"""leantune.patch on a model loaded in 4-bit by transformers / bitsandbytes (QLoRA: NF4, double quantisation) with
PEFT LoRA: the fused LoRA ops run on the NF4 codes and give the loss and LoRA gradients of a float64 model built from
the dequantised weights (fp32 tolerance), on both backends; a 4-bit layer the fused ops cannot reproduce keeps PEFT's
forward and the summary says why.

PEFT + bitsandbytes itself is no fp32 reference on the CPU: bitsandbytes' CPU 4-bit matmul of this version is off
from the dequantised weight by about 2e-3 (a bf16-level rounding), so it is compared within a loose bound only.

The models (the float64 twins too) and inputs live on ``conftest.DEVICE``: the CPU here (the Triton backend through
the interpreter), the card on CUDA (bitsandbytes' CUDA 4-bit layout; TF32 off for cuBLAS there, the fp32 products
must stay fp32 for the 1e-5 bar)."""

import pytest
import torch
from conftest import DEVICE
from reference import assert_close, fp32_products, loss_and_grads

import leantune

bnb = pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 160


@pytest.fixture(autouse=True)
def _fp32_products():
    with fp32_products():
        yield


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("qlora") / "tiny"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def qlora(folder, compute_dtype=torch.float32):
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map=DEVICE,
                                                              dtype=torch.float32)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, lora)


def dequantised_twin(folder, quantised):
    """The same model in float64 on DEVICE with every 4-bit weight replaced by its dequantised value and the same
    adapters."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).to(DEVICE)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(model, lora)
    dense = dict(model.named_modules())
    with torch.no_grad():
        for name, module in quantised.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
                dense[name].weight.copy_(weight.double())
        for name, p in quantised.named_parameters():
            if p.requires_grad:
                dict(model.named_parameters())[name].copy_(p.double())
    return model


def test_patched_qlora_model_matches_the_dequantised_model_in_float64(saved_model, backend):
    ids = torch.randint(0, VOCAB, (2, 24), device=DEVICE)
    model = qlora(saved_model)
    twin = dequantised_twin(saved_model, model)  # before anything runs: bitsandbytes' CPU path may repack weights
    ref_loss, ref_grads = loss_and_grads(twin, ids)
    peft_loss, _ = loss_and_grads(qlora(saved_model), ids)
    leantune.patch(model)
    summary = model.base_model.model.leantune_summary
    assert summary["counts"]["lora"] == 2 * 7 and summary["counts"]["lora_mlp"] == 2, summary
    loss, grads = loss_and_grads(model, ids)
    assert_close("loss", loss, ref_loss, torch.float32)
    assert grads.keys() == ref_grads.keys() and grads
    for name, ref in ref_grads.items():
        assert_close(name, grads[name], ref, torch.float32)
    assert abs(loss - peft_loss) < 1e-2 * abs(peft_loss)  # PEFT + bitsandbytes (on the CPU: bf16-level)


def test_a_4bit_layer_computing_in_another_dtype_keeps_pefts_forward(saved_model, monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = qlora(saved_model, compute_dtype=torch.bfloat16)
    leantune.patch(model)
    summary = model.base_model.model.leantune_summary
    assert summary["counts"]["lora"] == 0
    assert any("compute dtype torch.bfloat16 differs" in why for why in summary["unpatched"].values()), summary
    ids = torch.randint(0, VOCAB, (1, 16), device=DEVICE)
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_leantune_quantize_after_peft_patches_and_matches_the_dequantised_model(saved_model, backend):
    """leantune.quantize on a PEFT model (QLoRA without bitsandbytes at run time): base layers become NF4Linear, the
    adapters stay; patched, the loss and LoRA gradients are those of the float64 model with the dequantised weights."""
    from leantune.quantize import NF4Linear

    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32).to(DEVICE)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                       init_lora_weights=False))
    done = leantune.quantize(model, "nf4")
    assert done["layers"] == 2 * 7 and done["bytes_after"] < done["bytes_before"] / 3
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.base_layer, NF4Linear)
    assert type(layer.self_attn.q_proj.lora_A.default) is torch.nn.Linear  # adapters untouched
    twin = transformers.AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float64).to(DEVICE)
    twin = peft.get_peft_model(twin, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                     init_lora_weights=False))
    dense = dict(twin.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, NF4Linear):
                dense[name].weight.copy_(leantune.ops.dequantize_nf4(module.weight_nf4, dtype=torch.float32))
        params = dict(twin.named_parameters())
        for name, p in model.named_parameters():
            if p.requires_grad:
                params[name].copy_(p.double())
    ids = torch.randint(0, VOCAB, (2, 24), device=DEVICE)
    ref_loss, ref_grads = loss_and_grads(twin, ids)
    peft_loss, _ = loss_and_grads(model, ids)  # PEFT's forward over NF4Linear: the same model, unfused
    leantune.patch(model)
    assert model.base_model.model.leantune_summary["counts"]["lora"] == 2 * 7
    loss, grads = loss_and_grads(model, ids)
    for name, value in (("loss", loss), ("PEFT loss", peft_loss)):
        assert_close(name, value, ref_loss, torch.float32)
    for name, ref in ref_grads.items():
        assert_close(name, grads[name], ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_leantune_quantize_before_peft_is_the_documented_order(saved_model, dtype):
    """leantune.quantize before get_peft_model (the order bitsandbytes users know): PEFT selects the NF4 layers
    ("all-linear", named targets, its per-model default) and wraps them in its lora.Linear; adapters, loss and LoRA
    gradients are bit-identical to quantising after PEFT (a bf16 base rounds the adapters' initial values through
    bf16 in both orders), and leantune.patch fuses every layer."""
    from leantune.quantize import NF4Linear

    ids = torch.randint(0, VOCAB, (2, 24), device=DEVICE)
    for targets in (["q_proj", "down_proj"], None, "all-linear"):  # all-linear last: the models patched below
        results = []
        for order in ("after", "before"):
            model = transformers.AutoModelForCausalLM.from_pretrained(saved_model, dtype=dtype).to(DEVICE)
            if order == "before":
                assert leantune.quantize(model, "nf4")["layers"] == 2 * 7
            torch.manual_seed(1)
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                               init_lora_weights=False))
            if order == "after":
                leantune.quantize(model, "nf4")
            q_proj = model.base_model.model.model.layers[1].self_attn.q_proj
            assert type(q_proj) is peft.tuners.lora.Linear and isinstance(q_proj.base_layer, NF4Linear), order
            adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            results.append((model, adapters, *loss_and_grads(model, ids)))
        (after, adapters_after, loss_after, grads_after), (before, adapters, loss, grads) = results
        assert adapters.keys() == adapters_after.keys() and adapters, targets
        assert all(torch.equal(adapters[n], adapters_after[n]) for n in adapters), targets
        assert torch.equal(loss, loss_after), (targets, loss.item(), loss_after.item())
        assert all(torch.equal(grads[n], grads_after[n]) for n in grads_after), targets
    leantune.patch(before)
    leantune.patch(after)
    assert before.base_model.model.leantune_summary["counts"]["lora"] == 2 * 7
    patched, patched_after = loss_and_grads(before, ids), loss_and_grads(after, ids)
    assert torch.equal(patched[0], patched_after[0])
    assert all(torch.equal(patched[1][n], patched_after[1][n]) for n in patched_after[1])
