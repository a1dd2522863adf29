"""leantune.patch on the families described by structure (patch/families.py rows beyond the six of
test_patch_families.py): patched vs unpatched PEFT model, loss and every LoRA gradient, both backends; the
warning path for a model type without a row.

Each family is a tiny random model built from its transformers config class (2 layers, hidden 64, 4/2 heads,
head_dim 16, vocab 128) with its structural switches set so that they matter: partial rotary (Phi-3, GLM), layers
without RoPE (SmolLM3, EXAONE 4), sliding windows shorter than the sequence, Granite's multipliers away from 1,
residual dropout on (the RNG reseeded before each forward, so both sides draw the same masks). Norms are perturbed
away from their init and LoRA sits on every projection with non-zero B. The unpatched model is the reference (fp32):
loss rel <= 1e-5, LoRA gradients rel <= 1e-4.

The parity checks build on ``conftest.DEVICE`` (the CPU here, the Triton backend through the interpreter; the card on
CUDA) and run with TF32 off for cuBLAS on CUDA (the fp32 reference keeps full fp32 products). The warning-path tests
stay on the CPU: nothing of leantune's runs there.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import DEVICE
from peft import LoraConfig, get_peft_model
from reference import fp32_products, rel_err
from test_patch_families import OPS, assert_grads_close, op_calls  # noqa: F401  (op_calls: a fixture)
from transformers import AutoConfig, AutoModelForCausalLM

import leantune
from leantune.patch import FAMILIES

VOCAB = 128
SLIDING = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
EXTRA = {
    "gemma": {},
    "ministral": SLIDING,
    "olmo2": {},
    "olmo3": SLIDING,
    "smollm3": {"no_rope_layers": [1, 0]},
    "phi3": {"partial_rotary_factor": 0.5, "sliding_window": 5},
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                "logits_scaling": 4.0},
    "granite_swa": {"logits_scaling": 4.0, "attention_multiplier": 0.2, **SLIDING},
    "hyperclovax": {"logits_scaling": 0.5, "embedding_multiplier": 2.0, "residual_multiplier": 0.5},
    "cwm": SLIDING,
    "glm": {"partial_rotary_factor": 0.5},
    "glm4": {},
    "helium": {},
    "exaone4": SLIDING,
    "seed_oss": {"residual_dropout": 0.2},
    "arcee": {},
    "apertus": {},
    "hunyuan_v1_dense": {},
    "ernie4_5": {"use_bias": True},
    "starcoder2": {"residual_dropout": 0.2, "sliding_window": 5},
}
STRUCTURES = list(EXTRA)
GENERATE = ["phi3", "olmo2", "smollm3", "exaone4", "hunyuan_v1_dense"]  # fused qkv, width / after-RoPE QK-norm, no-RoPE
TRITON = ["phi3", "olmo2", "granite", "smollm3"]  # fused qkv/gate_up + partial rotary, width QK-norm, divisor, no-RoPE


def tiny_model(model_type: str, device: str | None = None):
    """The tiny fp32 model of ``model_type`` (module docstring) on ``device`` (None: the CPU)."""
    return model_from_config(
        model_type, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=VOCAB, intermediate_size=96, max_position_embeddings=64, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, device=device, **EXTRA[model_type],
    )


def model_from_config(model_type: str, *, device: str | None = None, **config_fields):
    """A random fp32 model of ``model_type`` with eager attention and its norms perturbed away from their init, on
    ``device`` (None: the CPU, where from_config builds it)."""
    config = AutoConfig.for_model(model_type, **config_fields)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model.float().to(device or "cpu")


def tiny_peft_model(model_type: str, device: str | None = None):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(FAMILIES[model_type].projections), lora_dropout=0.0,
                      init_lora_weights=False)
    return get_peft_model(tiny_model(model_type, device), lora)


def loss_and_grads(model, input_ids, labels):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # residual dropout: the same masks on both sides (seeds CUDA's generator too)
    out = model(input_ids=input_ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return out.loss.detach(), grads


def check_structure_parity(model_type, op_calls, rows=2, seq=9, generate=False):  # noqa: F811
    with fp32_products():
        _check_structure_parity(model_type, op_calls, rows, seq, generate)


def _check_structure_parity(model_type, op_calls, rows, seq, generate):  # noqa: F811
    family = FAMILIES[model_type]
    model = tiny_peft_model(model_type, DEVICE).train()
    assert all(p.device.type == DEVICE for p in model.parameters())
    input_ids = torch.randint(3, VOCAB, (rows, seq), device=DEVICE)
    labels = input_ids.clone()
    labels[0, -2:] = -100
    ref_loss, ref_grads = loss_and_grads(model, input_ids, labels)
    with torch.no_grad():
        ref_eval = model.eval()(input_ids=input_ids, labels=labels)
    model.train()
    assert not op_calls, "the unpatched model must not call leantune ops"

    leantune.patch(model)
    summary = model.leantune_summary
    assert summary["family"] == model_type and summary["unpatched"] == {}
    assert summary["counts"]["lora"] == 2 * len(family.projections) and summary["counts"]["loss"] == 1
    assert summary["counts"]["lora_qkv"] == 2
    assert summary["counts"]["lora_mlp"] == (0 if family.mlp == "plain" else 2)
    assert summary["counts"]["rope"] == (2 if family.rope == "half" else 0)
    assert summary["kept"] == family.kept() and summary["fused"]
    loss, grads = loss_and_grads(model, input_ids, labels)
    err = rel_err(loss, ref_loss)
    assert err <= 1e-5, f"{model_type}: loss {loss.item()} vs HF {ref_loss.item()}: rel {err:.3g}"
    assert_grads_close(grads, ref_grads)
    expected = ["lora_linear", "linear_cross_entropy"]
    expected += ["rms_norm"] if family.norm else []
    expected += ["rope"] if family.rope == "half" else []
    expected += ["lora_qkv"] if family.qkv == "separate" else []
    expected += [] if family.mlp == "plain" else ["lora_mlp"]
    for name in expected:
        assert op_calls[name] > 0, f"{model_type}: ops.{name} was not called by the patched model"
    if family.rope != "half":
        assert op_calls["rope"] == 0, f"{model_type}: interleaved RoPE must keep HF's function"
    with torch.no_grad():  # eval mode with labels: HF's logits (logits scale, softcap) beside the fused loss
        out = model.eval()(input_ids=input_ids, labels=labels)
    assert rel_err(out.logits, ref_eval.logits) <= 1e-5 and rel_err(out.loss, ref_eval.loss) <= 1e-5
    if generate:  # the KV-cache path through leantune's attention (greedy tokens as HF's)
        settings = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
        tokens = model.generate(input_ids[:1, :4], **settings)
        leantune.unpatch(model)
        assert torch.equal(tokens, model.generate(input_ids[:1, :4], **settings))
    model.train()
    leantune.unpatch(model)
    loss_back, grads_back = loss_and_grads(model, input_ids, labels)
    assert torch.equal(loss_back, ref_loss), "unpatch must restore HF's exact loss"
    assert all(torch.equal(grads_back[n], ref_grads[n]) for n in ref_grads)


def test_at_least_twenty_model_types():
    assert len(FAMILIES) >= 20
    from test_patch_moe import MOE  # the mixture-of-experts rows: tests/test_patch_moe.py

    assert set(STRUCTURES) | set(MOE) | {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"} \
        == set(FAMILIES)


@pytest.mark.parametrize("model_type", STRUCTURES)
def test_structure_matches_hf(model_type, op_calls, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    check_structure_parity(model_type, op_calls, generate=model_type in GENERATE)


@pytest.mark.parametrize("model_type", TRITON)
def test_structure_matches_hf_triton(model_type, op_calls, monkeypatch):  # noqa: F811
    """The same parity through the real Triton kernels (interpreter on the CPU, the card on CUDA): one row of 5
    tokens."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    check_structure_parity(model_type, op_calls, rows=1, seq=5)


def _hf_then_patched(model, input_ids):
    """(loss, grads) of ``model`` as HF runs it, then after ``leantune.patch`` (full fp32 products on CUDA)."""
    with fp32_products():
        ref = loss_and_grads(model, input_ids, input_ids)
        leantune.patch(model)
        return ref, loss_and_grads(model, input_ids, input_ids)


def test_gate_up_with_dropout_in_training_stays_exact(monkeypatch):
    """PEFT drops a fused gate_up_proj's input once; ops.lora_mlp would draw a mask per projection, so with LoRA
    dropout in training the MLP runs per projection (one ops.lora_linear on gate_up_proj): in eval the result is
    HF's, in training every adapter still gets a gradient."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_up_proj", "down_proj"], lora_dropout=0.3,
                      init_lora_weights=False)
    model = get_peft_model(tiny_model("phi3", DEVICE), lora).eval()
    input_ids = torch.randint(3, VOCAB, (2, 7), device=DEVICE)
    (ref_loss, ref_grads), (loss, grads) = _hf_then_patched(model, input_ids)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads)
    model.train()
    train_loss, train_grads = loss_and_grads(model, input_ids, input_ids)
    assert torch.isfinite(train_loss) and all(g.norm() > 0 for g in train_grads.values())


UNCOVERED = {  # tiny configs of types that take the warning path: (config fields, what is missing, a layer part)
    "olmo": ({}, "LayerNorm without weights", "OlmoLayerNorm"),
}


@pytest.mark.parametrize("model_type", list(UNCOVERED))
def test_uncovered_model_type_warns_and_runs_unpatched(model_type):
    """A model type without a row keeps HF's forwards (bit for bit) with a warning naming what is missing and the
    layer's parts; strict=True raises."""
    extra, missing, block = UNCOVERED[model_type]
    config = AutoConfig.for_model(
        model_type, num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        vocab_size=VOCAB, intermediate_size=48, **extra,
    )
    model = AutoModelForCausalLM.from_config(config).float()
    input_ids = torch.randint(3, VOCAB, (1, 6))
    ref = model(input_ids=input_ids, labels=input_ids).loss
    with pytest.warns(UserWarning, match=rf"'{model_type}' not covered: {missing}.*{block}"):
        assert leantune.patch(model) is model
    assert model.leantune_summary["family"] is None and not leantune.is_patched(model)
    assert "forward" not in model.__dict__ and not any("_leantune" in m.__dict__ for m in model.modules())
    assert torch.equal(model(input_ids=input_ids, labels=input_ids).loss, ref)
    leantune.unpatch(model)  # harmless
    with pytest.raises(ValueError, match=rf"'{model_type}'.*{missing}.*supported: .*gpt_oss.*llama"):
        leantune.patch(model, strict=True)


def test_covered_model_type_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        leantune.patch(tiny_model("glm"))


def test_fused_gate_up_without_lora_runs_the_glu_op(op_calls, monkeypatch):  # noqa: F811
    """LoRA on attention only: Phi-3's MLP chunks gate_up_proj's output and runs ops.swiglu on the two halves
    (strided views); loss and LoRA gradients as HF's."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj"], init_lora_weights=False)
    model = get_peft_model(tiny_model("phi3", DEVICE), lora).train()
    input_ids = torch.randint(3, VOCAB, (2, 7), device=DEVICE)
    (ref_loss, ref_grads), (loss, grads) = _hf_then_patched(model, input_ids)
    assert op_calls["swiglu"] == 2 and op_calls["lora_mlp"] == 0 and model.leantune_summary["counts"]["mlp"] == 2
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads)
