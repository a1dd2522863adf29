"""leantune.patch on every supported family: patched vs unpatched loss, LoRA gradients, logits, generate, checkpointing.

Each family is a tiny random model (2 layers, hidden 96, 6/2 heads, head_dim 16, vocab 1000) with its norms perturbed
away from their init and PEFT LoRA on all 7 projections with non-zero B, so every fused path and every LoRA gradient
is non-trivial. The unpatched model is the reference: loss rel <= 1e-5, LoRA gradients rel <= 1e-4 (fp32).

The models and batches live on ``conftest.DEVICE`` (the CPU here, the Triton backend through the interpreter; the card
on CUDA), where every test of this module runs with TF32 off for cuBLAS (the fp32 reference keeps full fp32 products).
"""

from __future__ import annotations

import collections
import copy
import gc

import pytest
import torch
from conftest import DEVICE
from peft import LoraConfig, get_peft_model
from reference import fp32_products, rel_err
from transformers import AutoConfig, AutoModelForCausalLM

import leantune
from leantune import ops
from leantune.patch import forwards

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 1000
OPS = ["rms_norm", "rope", "swiglu", "geglu", "lora_linear", "lora_qkv", "lora_mlp", "linear_cross_entropy",
       "cross_entropy"]


def tiny_config(family: str, layers: int = 2):
    extra = {}
    if family in ("gemma2", "gemma3_text"):
        # A small final softcap so it changes the loss; sliding windows shorter than the test sequences.
        extra = {"query_pre_attn_scalar": 16, "final_logit_softcapping": 2.0, "sliding_window": 6}
        if family == "gemma2":
            extra["attn_logit_softcapping"] = 3.0
    elif family == "mistral":
        extra = {"sliding_window": 6}
    elif family == "qwen2":
        extra = {"use_sliding_window": False}
    config = AutoConfig.for_model(
        family, num_hidden_layers=layers, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        vocab_size=VOCAB, intermediate_size=160, max_position_embeddings=64, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra,
    )
    config._attn_implementation = "eager"
    return config


def tiny_model(family: str, layers: int = 2, device: str | None = None):
    """A random tiny causal LM of ``family`` with every RMSNorm weight perturbed (Llama init 1, Gemma init 0), fp32, on
    ``device`` (None: the CPU, where from_config builds it)."""
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model.float().to(device or "cpu")


def lora_config(**kwargs):
    options = {"r": 4, "lora_alpha": 8, "target_modules": PROJECTIONS, "lora_dropout": 0.0, "init_lora_weights": False}
    options.update(kwargs)
    return LoraConfig(**options)


def tiny_peft_model(family: str, device: str | None = None, **lora_kwargs):
    """:func:`tiny_model` on ``device`` with PEFT LoRA (:func:`lora_config`) on every projection."""
    return get_peft_model(tiny_model(family, device=device), lora_config(**lora_kwargs))


def batch(rows: int = 2, seq: int = 11, pad_last: int = 3, device: str | None = None):
    """input_ids [rows, seq] (int64, on ``device``; None: the CPU) and labels with the last ``pad_last`` positions of
    row 0 ignored."""
    input_ids = torch.randint(3, VOCAB, (rows, seq), device=device)
    labels = input_ids.clone()
    if pad_last:
        labels[0, -pad_last:] = -100
    return input_ids, labels


def loss_and_grads(model, input_ids, labels, **kwargs):
    """(loss, logits, {name: grad}) of every trainable parameter after one backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return out.loss.detach(), out.logits, grads


NOISE_FLOOR = 1e-2  # of the largest gradient norm: see assert_grads_close


def assert_grads_close(grads, ref_grads, tol=1e-4):
    """||g - ref|| <= tol * max(||ref||, NOISE_FLOOR * the largest reference norm), per parameter. The floor: in a
    short row a saturated softmax leaves q/k gradients ~1e-7 of the model's largest, made of fp32 rounding on both
    sides (seen at 5 tokens, granite, one draw in ~30: errors 3e-7 against a largest norm of 2.7): those are compared
    at the floor (an error above 1e-6 of the largest norm still fails), every other one relatively."""
    assert grads.keys() == ref_grads.keys()
    floor = NOISE_FLOOR * max(float(ref.double().norm()) for ref in ref_grads.values())
    # LoRA B must be non-zero (else every lora_A gradient is 0); one projection's may still be exactly 0 where a
    # softmax saturates to one-hot in fp32 (granite, one draw: seed 1137074894): compared at the floor then
    assert any(ref.norm() > 0 for name, ref in ref_grads.items() if "lora_A" in name), "LoRA B must be non-zero"
    for name, ref in ref_grads.items():
        norm = float(ref.double().norm())
        err = float((grads[name].double() - ref.double()).norm()) / max(norm, floor)
        assert err <= tol, f"{name}: gradient error {err:.3g} (relative to max(||ref||, floor)) > {tol}"


@pytest.fixture(autouse=True)
def _fp32_products():
    """TF32 off for cuBLAS on CUDA in every test of this module (see the module docstring)."""
    with fp32_products():
        yield


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls of each leantune op made through ``leantune.ops`` (how the patch calls them)."""
    calls = collections.Counter()
    for name in OPS:
        original = getattr(ops, name)

        def spy(*args, __name=name, __original=original, **kwargs):
            calls[__name] += 1
            return __original(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    return calls


def expected_glu(family: str) -> str:
    return "geglu" if family.startswith("gemma") else "swiglu"


def check_parity(model, input_ids, labels, op_calls, family):
    """Unpatched reference, patch, compare loss/grads/logits/generate, then unpatch restores bit for bit."""
    model.train()
    ref_loss, ref_logits, ref_grads = loss_and_grads(model, input_ids, labels)
    assert ref_logits is not None
    with torch.no_grad():
        ref_infer = model(input_ids=input_ids).logits
    assert not op_calls, "the unpatched model must not call leantune ops"

    leantune.patch(model)
    summary = model.leantune_summary
    assert summary["counts"]["lora"] == 14 and summary["counts"]["lora_qkv"] == 2
    assert summary["counts"]["lora_mlp"] == 2 and summary["counts"]["loss"] == 1 and summary["unpatched"] == {}
    loss, logits, grads = loss_and_grads(model, input_ids, labels)
    assert logits is None, "no logits with labels"
    err = rel_err(loss, ref_loss)
    assert err <= 1e-5, f"loss {loss.item()} vs HF {ref_loss.item()}: rel {err:.3g}"
    assert_grads_close(grads, ref_grads)
    for name in ["rms_norm", "rope", expected_glu(family), "lora_qkv", "lora_mlp", "lora_linear",
                 "linear_cross_entropy"]:
        if name in ("swiglu", "geglu"):
            continue  # the fused LoRA MLP forms the activation itself (may or may not call the public glu)
        assert op_calls[name] > 0, f"ops.{name} was not called by the patched model"
    with torch.no_grad():
        infer = model(input_ids=input_ids).logits
    assert infer is not None and rel_err(infer, ref_infer) <= 1e-5, "logits without labels"

    leantune.unpatch(model)
    loss_back, _, grads_back = loss_and_grads(model, input_ids, labels)
    assert torch.equal(loss_back, ref_loss), "unpatch must restore HF's exact loss"
    assert all(torch.equal(grads_back[n], ref_grads[n]) for n in ref_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_matches_hf(family, op_calls, monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_peft_model(family, device=DEVICE)
    input_ids, labels = batch(device=DEVICE)
    check_parity(model, input_ids, labels, op_calls, family)

    # generate (no labels: HF's forward with the patched modules; greedy tokens as HF's). min_new_tokens keeps a
    # random draw that greedily picks the config's EOS from stopping early: every step is compared.
    model.eval()
    prompt = input_ids[:1, :5]
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    ref_tokens = model.generate(prompt, **settings)
    leantune.patch(model)
    tokens = model.generate(prompt, **settings)
    assert ref_tokens.shape == tokens.shape == (1, 9)
    assert torch.equal(tokens, ref_tokens)
    leantune.unpatch(model)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_patched_matches_hf_triton(family, op_calls, monkeypatch):
    """The same parity through the real Triton kernels (interpreter on the CPU, the card on CUDA): tiny sequence."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    model = tiny_peft_model(family, device=DEVICE)
    assert all(p.device.type == DEVICE for p in model.parameters())
    input_ids, labels = batch(rows=1, seq=6, pad_last=1, device=DEVICE)
    check_parity(model, input_ids, labels, op_calls, family)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_loss_only_keeps_logits_bit_exact(family, monkeypatch):
    """With only the loss kind on, logits are HF's bit for bit in eval mode, with labels too (the loss then comes
    from the fused op); in training with labels they are None (never formed)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_peft_model(family, device=DEVICE).eval()
    input_ids, labels = batch(device=DEVICE)
    with torch.no_grad():
        ref = model(input_ids=input_ids)
        ref_loss = model(input_ids=input_ids, labels=labels).loss
    leantune.patch(model, rms_norm=False, rope=False, mlp=False, lora=False)
    with torch.no_grad():
        out = model(input_ids=input_ids)
        with_labels = model(input_ids=input_ids, labels=labels)
    assert torch.equal(out.logits, ref.logits)
    assert torch.equal(with_labels.logits, ref.logits) and rel_err(with_labels.loss, ref_loss) <= 1e-5
    model.train()
    with torch.no_grad():
        training = model(input_ids=input_ids, labels=labels)
    assert training.logits is None and rel_err(training.loss, ref_loss) <= 1e-5


@pytest.mark.parametrize("family, dropout", [("llama", 0.0), ("llama", 0.1), ("gemma2", 0.0)])
def test_gradient_checkpointing_same_gradients(family, dropout, monkeypatch):
    """Non-reentrant checkpointing recomputes the patched forwards (RoPE context included): same gradients. Where
    the MLP's output goes straight to the residual (Llama), the recomputation skips forming it (lora_mlp
    output=False); Gemma 2's post-feedforward norm saves it, so there it is formed again."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_peft_model(family, device=DEVICE, lora_dropout=dropout).train()
    input_ids, labels = batch(device=DEVICE)
    if dropout:  # PEFT draws other masks: the reference is then the patched model without checkpointing
        leantune.patch(model)
    torch.manual_seed(7)
    ref_loss, _, ref_grads = loss_and_grads(model, input_ids, labels)
    leantune.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    assert model.get_base_model().model.gradient_checkpointing
    outputs = []
    lora_mlp = ops.lora_mlp
    monkeypatch.setattr(ops, "lora_mlp", lambda *a, **k: outputs.append(k["output"]) or lora_mlp(*a, **k))
    torch.manual_seed(7)  # the same dropout masks as the reference run
    loss, _, grads = loss_and_grads(model, input_ids, labels)
    assert outputs == [True, True] + ([False, False] if family == "llama" else [True, True])  # 2 layers
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads)


def test_recompute_without_early_stop_forms_the_mlp_output(monkeypatch):
    """With checkpoint early stop off the recomputation runs the whole layer, hooks included: the MLP output is
    formed again, and a decoder-layer hook sees in the recomputation what it saw in forward."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = leantune.patch(tiny_peft_model("llama", device=DEVICE)).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    seen = []
    layer = model.get_base_model().model.layers[0]
    layer.register_forward_hook(lambda module, args, out: seen.append((out[0] if isinstance(out, tuple)
                                                                      else out).detach().clone()))
    outputs = []
    lora_mlp = ops.lora_mlp
    monkeypatch.setattr(ops, "lora_mlp", lambda *a, **k: outputs.append(k["output"]) or lora_mlp(*a, **k))
    input_ids, labels = batch(device=DEVICE)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        loss_and_grads(model, input_ids, labels)
    assert outputs == [True, True, True, True]
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_patch_before_get_peft_model(family, op_calls, monkeypatch):
    """patch(hf_model) then get_peft_model: the LoRA layers PEFT inserts later are fused at forward time."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    base = tiny_model(family, device=DEVICE)
    reference = get_peft_model(copy.deepcopy(base), lora_config())
    patched = get_peft_model(leantune.patch(base), lora_config())
    patched.load_state_dict(reference.state_dict())
    input_ids, labels = batch(device=DEVICE)
    ref_loss, _, ref_grads = loss_and_grads(reference, input_ids, labels)
    op_calls.clear()
    loss, _, grads = loss_and_grads(patched, input_ids, labels)
    assert op_calls["lora_qkv"] == 2 and op_calls["lora_mlp"] == 2 and op_calls["lora_linear"] == 2
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads)
    leantune.patch(patched)  # re-patching refreshes the summary with the LoRA layers now present
    assert patched.leantune_summary["counts"]["lora"] == 14


def test_dropout_in_eval_and_train(monkeypatch):
    """LoRA dropout: off in eval (patched == HF exactly as without dropout); in train the fused ops drop (their
    own masks), so the loss differs from the no-dropout loss but gradients exist for every adapter."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_peft_model("llama", device=DEVICE, lora_dropout=0.3).eval()
    input_ids, labels = batch(device=DEVICE)
    ref_loss, _, ref_grads = loss_and_grads(model, input_ids, labels)
    leantune.patch(model)
    loss, _, grads = loss_and_grads(model, input_ids, labels)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads)
    model.train()
    train_loss, _, train_grads = loss_and_grads(model, input_ids, labels)
    assert torch.isfinite(train_loss) and rel_err(train_loss, ref_loss) > 1e-4, "dropout had no effect in train"
    assert all(g.norm() > 0 for g in train_grads.values())


def test_rope_dispatcher_is_scoped(monkeypatch):
    """The module-level RoPE swap exists only while a patched model of the family exists."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    from transformers.models.llama import modeling_llama

    from leantune.patch.families import FAMILIES as TABLE

    gc.collect()  # patched models of earlier tests, never unpatched, count out when collected
    for leftover in list(forwards._rope_users.get(TABLE["llama"].modeling_module, ())):
        leantune.unpatch(leftover)  # a model another test still holds (e.g. through a cached traceback)
    original = modeling_llama.apply_rotary_pos_emb
    assert not forwards.rope_installed(TABLE["llama"])
    a, b = tiny_model("llama", layers=1), tiny_model("llama", layers=1)
    leantune.patch(a)
    leantune.patch(b)
    leantune.patch(b)  # twice: still one registration
    assert forwards.rope_installed(TABLE["llama"])
    leantune.unpatch(a)
    assert forwards.rope_installed(TABLE["llama"]), "b still uses it"
    leantune.unpatch(b)
    assert modeling_llama.apply_rotary_pos_emb is original
    leantune.patch(a, rope=False)
    assert not forwards.rope_installed(TABLE["llama"]), "rope=False must not touch the module"
    leantune.unpatch(a)
    leantune.patch(b)
    assert forwards.rope_installed(TABLE["llama"])
    del b  # dropped while patched: the dispatcher leaves with it
    gc.collect()
    assert modeling_llama.apply_rotary_pos_emb is original
