"""leantune.patch as an API: instance scope, unpatch, idempotence, fallbacks, HF loss conventions, memory, Trainer,
and the real SmolLM2-135M from leantune.assets."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from conftest import DEVICE
from reference import rel_err
from test_patch_families import assert_grads_close, batch, lora_config, loss_and_grads, tiny_model, tiny_peft_model

import leantune
from leantune import assets, ops
from leantune.patch import FAMILIES, is_patched

pytestmark = pytest.mark.usefixtures("torch_backend")


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")


def _instance_forwards(model):
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


def test_unpatched_model_keeps_exact_hf_behaviour(monkeypatch):
    """While a patched model exists (RoPE dispatcher installed), an unpatched one calls no leantune op and gives
    HF's loss and gradients bit for bit."""
    calls = collections.Counter()
    for name in ("rms_norm", "rope", "lora_qkv", "lora_mlp", "lora_linear", "linear_cross_entropy"):
        original = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, __o=original, __n=name, **k: calls.update([__n]) or __o(*a, **k))
    plain = tiny_peft_model("llama")
    patched = copy.deepcopy(plain)
    input_ids, labels = batch()
    ref_loss, _, ref_grads = loss_and_grads(plain, input_ids, labels)
    leantune.patch(patched)
    loss_and_grads(patched, input_ids, labels)
    assert calls["rope"] > 0 and calls["rms_norm"] > 0
    calls.clear()
    loss, _, grads = loss_and_grads(plain, input_ids, labels)
    assert not calls, f"unpatched model called leantune ops: {dict(calls)}"
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    leantune.unpatch(patched)


def test_unpatch_restores_twice_is_harmless_state_dict_unchanged():
    model = tiny_peft_model("qwen2")  # q/k/v bias
    keys = list(model.state_dict().keys())
    input_ids, labels = batch()
    ref_loss, _, ref_grads = loss_and_grads(model, input_ids, labels)
    leantune.patch(model)
    first = copy.deepcopy(model.leantune_summary)
    forwards_once = _instance_forwards(model)
    leantune.patch(model)
    assert model.leantune_summary == first and _instance_forwards(model) == forwards_once
    # 5 norms + 2 attention + 2 MLP + the causal LM
    assert len(forwards_once) == 10 and is_patched(model)
    assert list(model.state_dict().keys()) == keys
    loss, _, grads = loss_and_grads(model, input_ids, labels)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads)
    leantune.unpatch(model)
    leantune.unpatch(model)
    assert _instance_forwards(model) == [] and not is_patched(model)
    assert not any("_leantune" in m.__dict__ for m in model.modules())
    loss, _, grads = loss_and_grads(model, input_ids, labels)
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_every_peft_level_reaches_the_same_model():
    """PeftModel, its LoraModel and the transformers model inside all patch (and unpatch) the same model."""
    peft_model = tiny_peft_model("mistral")
    hf = peft_model.get_base_model()
    for wrapper in (peft_model, peft_model.base_model, hf):
        assert leantune.patch(wrapper) is wrapper
        assert is_patched(hf) and hf.leantune_summary["counts"]["lora"] == 14
        assert "forward" in hf.__dict__ and "forward" not in peft_model.base_model.__dict__
        leantune.unpatch(wrapper)
        assert not is_patched(hf) and _instance_forwards(peft_model) == []


def test_unsupported_model_type_names_it():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16))
    with pytest.raises(ValueError, match=r"'gpt2'.*supported: .*gemma2.*llama.*mistral.*qwen3"):
        leantune.patch(model, strict=True)
    with pytest.warns(UserWarning, match=r"'gpt2' not covered: no row .*GPT2Attention.*supported: .*llama"):
        leantune.patch(model)  # not strict: a warning, and the model stays on HF's forwards
    assert not is_patched(model) and model.leantune_summary["family"] is None
    with pytest.raises(ValueError, match="transformers causal LM"):
        leantune.patch(torch.nn.Linear(2, 2))
    for switch in ("strict", "rope", "offload_checkpoints"):  # a truthy string is not a switch
        with pytest.raises(ValueError, match=f"{switch} must be True or False, got 'yes'"):
            leantune.patch(model, **{switch: "yes"})


@pytest.mark.parametrize("case", ["two_adapters", "merged", "disabled"])
def test_peft_forward_kept_where_fused_ops_cannot_serve(case):
    """Several active adapters and merged adapters keep PEFT's forward (and the summary says so); a disabled
    adapter gives the base model. The loss stays HF's either way. (DoRA is fused: tests/test_dora.py, which also
    has the DoRA case that keeps PEFT's forward.)"""
    model = tiny_peft_model("llama")
    if case == "two_adapters":
        model.add_adapter("second", lora_config())
        model.base_model.set_adapter(["default", "second"])
    input_ids, labels = batch()
    if case == "merged":
        model.merge_adapter()
    if case == "disabled":
        with model.disable_adapter():
            ref_loss = model(input_ids=input_ids, labels=labels).loss.detach()
            leantune.patch(model)
            loss = model(input_ids=input_ids, labels=labels).loss.detach()
            with torch.no_grad():
                disabled_logits = model(input_ids=input_ids).logits
        assert rel_err(loss, ref_loss) <= 1e-5
        assert model.leantune_summary["counts"]["lora"] == 0
        assert all("adapters disabled" in why for why in model.leantune_summary["unpatched"].values())
        with torch.no_grad():
            enabled_logits = model(input_ids=input_ids).logits
        # logits, not the scalar loss: the adapters' effect on the mean loss can be 5e-4 for some draws (seed
        # 2063096002); on the logits it is ~1 relative (0.94-1.11 over 21 draws)
        assert rel_err(enabled_logits, disabled_logits) > 1e-3, "re-enabled adapters must count again"
        return
    if case == "merged":
        with torch.no_grad():
            ref_loss = model(input_ids=input_ids, labels=labels).loss
        leantune.patch(model)
        with torch.no_grad():
            loss = model(input_ids=input_ids, labels=labels).loss
        assert rel_err(loss, ref_loss) <= 1e-5
        reason = "merged adapter"
    else:
        ref_loss, _, ref_grads = loss_and_grads(model, input_ids, labels)
        leantune.patch(model)
        loss, _, grads = loss_and_grads(model, input_ids, labels)
        assert rel_err(loss, ref_loss) <= 1e-5
        assert_grads_close(grads, ref_grads)
        reason = "2 active adapters"
    summary = model.leantune_summary
    assert summary["counts"]["lora"] == 0 and len(summary["unpatched"]) == 14
    assert all(reason in why for why in summary["unpatched"].values()), summary["unpatched"]
    assert summary["counts"]["rms_norm"] == 5 and summary["counts"]["loss"] == 1


def test_hf_loss_conventions_num_items_shift_labels_return_dict():
    """num_items_in_batch divides the summed loss (as HF); a given shift_labels replaces the shift, and alone (no
    labels) gives no loss, as in HF; return_dict=False keeps HF's positions (logits slot None, cache after it)."""
    model = tiny_peft_model("gemma2")
    input_ids, labels = batch()
    num_items = torch.tensor(7)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    other = torch.randint(0, model.config.vocab_size, labels.shape)  # labels ignored when shift_labels is given
    with torch.no_grad():
        ref_sum = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
        ref_mean = model(input_ids=input_ids, labels=labels).loss
        ref_only_shift = model(input_ids=input_ids, shift_labels=shifted)
        ref_tuple = model(input_ids=input_ids, labels=labels, return_dict=False, use_cache=True)
    leantune.patch(model)
    with torch.no_grad():
        loss_sum = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
        loss_shift = model(input_ids=input_ids, labels=other, shift_labels=shifted).loss
        only_shift = model(input_ids=input_ids, shift_labels=shifted)
        as_tuple = model(input_ids=input_ids, labels=labels, return_dict=False, use_cache=True)
    assert rel_err(loss_sum, ref_sum) <= 1e-5
    assert rel_err(loss_shift, ref_mean) <= 1e-5
    assert ref_only_shift.loss is None and only_shift.loss is None and only_shift.logits is not None
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(ref_tuple) and as_tuple[1] is None
    assert rel_err(as_tuple[0], ref_mean) <= 1e-5 and type(as_tuple[2]) is type(ref_tuple[2])


@pytest.mark.parametrize("num_items, to_op", [
    (torch.tensor([[7]]), ("tensor", 7)), (7.0, 7), (7, 7), (torch.tensor(7.0, dtype=torch.float64), ("tensor", 7)),
    (2.5, None), (torch.tensor(0), ("tensor", 0)), (0, 0), (torch.tensor([3, 4]), None), (10**400, None),
], ids=["1x1 tensor", "float", "int", "f64 tensor", "fraction", "zero tensor", "zero", "2 elements", "huge"])
def test_num_items_in_batch_divides_as_hf_does(num_items, to_op, monkeypatch):
    """HF's Trainer passes num_items_in_batch as a [1, 1] tensor under DataParallel and can
    pass 0; HF divides the summed loss by whatever it gets, and so does the patch (same value, dtype, shape and
    gradient; a 0 that divides valid tokens gives HF's inf, not an error that ends the run). A whole count goes to
    the op, and a one-element tensor goes as a 0-dim tensor (never read back: no host sync)."""
    model = tiny_peft_model("llama")
    input_ids, labels = batch()
    try:
        ref = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
    except Exception as exc:  # HF's own failure for this input (e.g. an int too large for a float): the same type
        leantune.patch(model)
        with pytest.raises(type(exc)):
            model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items)
        return
    ref_grads = torch.autograd.grad(ref.sum(), [p for p in model.parameters() if p.requires_grad])
    leantune.patch(model)
    seen = []
    original = ops.linear_cross_entropy
    monkeypatch.setattr(ops, "linear_cross_entropy",
                        lambda *a, **k: seen.append(k.get("num_items")) or original(*a, **k))
    loss = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
    assert [("tensor", t.item()) if torch.is_tensor(t) else t for t in seen] == [to_op]
    assert all(t.dim() == 0 for t in seen if torch.is_tensor(t))
    grads = torch.autograd.grad(loss.sum(), [p for p in model.parameters() if p.requires_grad])
    assert loss.shape == ref.shape and loss.dtype == ref.dtype
    assert not loss._is_view()  # FSDP2 warns about a view returned by the root module (and its hook could be lost)
    if torch.isfinite(ref).all():
        assert rel_err(loss, ref) <= 1e-5
        assert max(rel_err(g, r) for g, r in zip(grads, ref_grads)) <= 1e-4
    else:  # the zero count: the same non-finite loss as HF
        assert torch.equal(loss.isinf(), ref.isinf()) and torch.equal(loss.isnan(), ref.isnan())


def _largest_saved(model, input_ids, labels) -> int:
    """numel of the largest non-parameter tensor saved for backward during one forward."""
    params = {p.data_ptr() for p in model.parameters()}
    sizes = [0]

    def pack(t):
        if t.data_ptr() not in params:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=input_ids, labels=labels)
    return max(sizes)


def test_no_logits_sized_tensor_saved_with_labels():
    model = tiny_peft_model("llama").train()
    input_ids, labels = batch()
    logits_numel = input_ids.numel() * model.config.vocab_size
    assert _largest_saved(model, input_ids, labels) >= logits_numel, "the probe must see HF's saved logits"
    leantune.patch(model)
    largest = _largest_saved(model, input_ids, labels)
    assert largest < logits_numel // 4, f"a tensor of {largest} elements (logits: {logits_numel}) was saved"


def test_one_hf_trainer_step(tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments

    seen = []
    original = ops.linear_cross_entropy
    monkeypatch.setattr(ops, "linear_cross_entropy",
                        lambda *a, **k: seen.append(k.get("num_items")) or original(*a, **k))
    model = leantune.patch(tiny_peft_model("llama"))
    rows = []
    for _ in range(4):
        input_ids, labels = batch(rows=1, seq=9, pad_last=2)
        rows.append({"input_ids": input_ids[0], "labels": labels[0], "attention_mask": torch.ones(9, dtype=torch.long)})
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, learning_rate=1e-2, use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=1, remove_unused_columns=False, disable_tqdm=True,
    )
    result = Trainer(model=model, args=args, train_dataset=rows).train()
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.training_loss))
    assert seen and all(n is not None for n in seen), "the fused loss must get the Trainer's num_items_in_batch"
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert len(changed) == len(before), "every LoRA matrix must have moved"


# ------------------------------------------------------------------------------------------- real SmolLM2-135M
@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = assets.load_smollm2()
    return model.eval(), tokenizer


def test_real_smollm2_same_loss_patched(smollm2, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    text = "The quick brown fox jumps over the lazy dog, and then it runs back into the forest to sleep."
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    assert input_ids.shape[1] > 10
    with torch.no_grad():
        ref = model(input_ids=input_ids, labels=input_ids).loss
    assert 0.5 < ref.item() < 8.0, f"implausible loss {ref.item()} for a real model on English"
    leantune.patch(model)
    try:
        summary = model.leantune_summary
        assert summary["counts"]["rms_norm"] == 61 and summary["counts"]["rope"] == 30
        with torch.no_grad():
            loss = model(input_ids=input_ids, labels=input_ids).loss
    finally:
        leantune.unpatch(model)
    assert rel_err(loss, ref) <= 1e-5, f"patched {loss.item()} vs HF {ref.item()}"


def test_trainable_base_bias_keeps_peft_forward():
    """PEFT bias="all" makes the q/k/v biases trainable: those projections are not fused, and their gradients
    still match HF's (the rest of the model stays patched)."""
    model = tiny_peft_model("qwen2", bias="all")
    input_ids, labels = batch()
    ref_loss, _, ref_grads = loss_and_grads(model, input_ids, labels)
    assert any(name.endswith("bias") for name in ref_grads)
    leantune.patch(model)
    unpatched = model.leantune_summary["unpatched"]
    assert len(unpatched) == 6 and all("not a frozen" in why for why in unpatched.values())
    loss, _, grads = loss_and_grads(model, input_ids, labels)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads)


# ---------------------------------------------------------------------------------------- copies, odd LoRA settings
def _rope_calls(monkeypatch):
    calls = collections.Counter()
    original = ops.rope
    monkeypatch.setattr(ops, "rope", lambda *a, **k: calls.update(["rope"]) or original(*a, **k))
    return calls


def test_pickled_and_deep_copied_models_come_back_patched(monkeypatch):
    """torch.save / pickle used to fail on load (a bound method pickles as getattr(module, 'attention_forward'));
    a deep copy lost the fused RoPE once the original was unpatched (the copy held no share of the dispatcher)."""
    import io
    import pickle

    from leantune.patch import forwards

    model = tiny_peft_model("llama")
    input_ids, labels = batch()
    leantune.patch(model)
    ref_loss, _, ref_grads = loss_and_grads(model, input_ids, labels)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = {"pickle": pickle.loads(pickle.dumps(model)), "torch.save": torch.load(buffer, weights_only=False),
              "deepcopy": copy.deepcopy(model)}
    leantune.unpatch(model)  # the copies must keep working on their own
    calls = _rope_calls(monkeypatch)
    for how, clone in copies.items():
        assert leantune.is_patched(clone), how
        calls.clear()
        loss, _, grads = loss_and_grads(clone, input_ids, labels)
        assert rel_err(loss, ref_loss) <= 1e-5, how
        assert_grads_close(grads, ref_grads)
        assert calls["rope"] == 2, f"{how}: the copy's attention must still run ops.rope"
    assert forwards.rope_installed(FAMILIES["llama"])  # held by the copies alone now
    for clone in copies.values():
        leantune.unpatch(clone)
        assert not _instance_forwards(clone) and not leantune.is_patched(clone)


def test_forward_signature_is_the_models(monkeypatch):
    """HF's generate and Trainer read inspect.signature(model.forward): it must list HF's arguments, not *args."""
    import inspect

    model = tiny_peft_model("llama")
    leantune.patch(model)
    hf = model.base_model.model
    params = inspect.signature(hf.forward).parameters
    assert "input_ids" in params and "labels" in params and "self" not in params
    attention = hf.model.layers[0].self_attn
    assert "hidden_states" in inspect.signature(attention.forward).parameters


def test_dropout_one_keeps_peft_forward():
    """lora_dropout=1.0 zeroes the branch in training (PEFT accepts it); the fused ops take p < 1: PEFT's forward is
    kept for those projections and the summary says why."""
    model = tiny_peft_model("llama", lora_dropout=1.0).train()
    input_ids, labels = batch()
    ref_loss = model(input_ids=input_ids, labels=labels).loss.detach()
    leantune.patch(model)
    loss = model(input_ids=input_ids, labels=labels).loss.detach()
    assert rel_err(loss, ref_loss) <= 1e-5
    summary = model.leantune_summary
    assert summary["counts"]["lora"] == 0 and all("lora_dropout p = 1.0 >= 1" in why
                                                   for why in summary["unpatched"].values())


def test_mlp_off_counts_no_fused_lora_mlp():
    model = tiny_peft_model("llama")
    leantune.patch(model, mlp=False)
    counts = model.leantune_summary["counts"]
    assert counts["mlp"] == 0 and counts["lora_mlp"] == 0 and counts["lora"] == 14


def test_summary_fused_lists_what_runs():
    """``fused`` follows the switches and the model: a kind switched off, no PEFT, no dense MLP leave out its part."""
    def fused(model, **switches):
        leantune.patch(model, **switches)
        return " | ".join(model.leantune_summary["fused"])

    full = fused(tiny_peft_model("llama"))
    for part in ("RMSNorm", "ops.rope", "ops.lora_qkv", "ops.lora_mlp", "loss: ops.linear_cross_entropy"):
        assert part in full, (part, full)
    no_loss = fused(tiny_peft_model("llama"), loss=False)
    assert "loss:" not in no_loss and "ops.lora_qkv" in no_loss
    plain = fused(tiny_model("llama"))  # no PEFT: the GLU alone, no LoRA op
    assert "LoRA" not in plain and "ops.lora_mlp" not in plain and "MLP activation: ops.swiglu" in plain
    assert fused(tiny_peft_model("llama"), rms_norm=False, rope=False, mlp=False, loss=False, lora=False) == ""


def test_float64_and_meta_models_run_hf_forwards(monkeypatch):
    """The ops take fp32/fp16/bf16 on a real device. A float64 model (gradient checks) and a model on the meta
    device (shape tracing) run HF's forwards instead: float64 failed in every forward, meta failed with labels."""
    from test_patch_families import tiny_config
    from transformers import AutoModelForCausalLM

    model = tiny_peft_model("gemma2").double()  # RMSNorm offset, softcaps: every patched kind has a fallback
    input_ids, labels = batch()
    ref_loss, _, ref_grads = loss_and_grads(model, input_ids, labels)
    leantune.patch(model)
    loss, _, grads = loss_and_grads(model, input_ids, labels)
    assert loss.dtype == ref_loss.dtype and torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    model.float()  # the same patched model serves fp32 through the ops again
    calls = _rope_calls(monkeypatch)
    assert torch.isfinite(model(input_ids=input_ids, labels=labels).loss) and calls["rope"] > 0

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("llama"))
    leantune.patch(meta)
    ids = torch.zeros(1, 5, dtype=torch.long, device="meta")
    out = meta(input_ids=ids, labels=ids)
    assert out.loss.device.type == "meta" and out.loss.shape == ()
    assert meta(input_ids=ids).logits.shape == (1, 5, meta.config.vocab_size)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: the final-logit softcap on the returned logits
def test_eval_mode_returns_logits_with_labels(family):
    """In eval mode a patched model given labels returns HF's logits (lm_head, then the family's softcap) beside the
    fused loss, so metrics that read them work; both equal the unpatched model's within fp32 tolerance, and the
    return_dict=False tuple carries them in HF's slot. ``skip_logits`` overrides the mode's default."""
    model = tiny_peft_model(family).eval()
    input_ids, labels = batch()
    with torch.no_grad():
        ref = model(input_ids=input_ids, labels=labels)
        leantune.patch(model)
        out = model(input_ids=input_ids, labels=labels)
        as_tuple = model(input_ids=input_ids, labels=labels, return_dict=False)
    assert out.logits is not None and out.logits.shape == ref.logits.shape
    assert rel_err(out.logits, ref.logits) <= 1e-5 and rel_err(out.loss, ref.loss) <= 1e-5
    assert torch.equal(as_tuple[1], out.logits) and torch.equal(as_tuple[0], out.loss)
    with torch.no_grad():  # asked explicitly: none in eval (a loss-only evaluation), HF's in training
        skipped = model(input_ids=input_ids, labels=labels, skip_logits=True)
        trained = model.train()(input_ids=input_ids, labels=labels, skip_logits=False)
    assert skipped.logits is None and torch.equal(skipped.loss, out.loss)
    assert rel_err(trained.logits, ref.logits) <= 1e-5


def test_hf_trainer_evaluate_with_compute_metrics(tmp_path):
    """HF Trainer.evaluate with compute_metrics (it gathers the logits of every eval batch) on a patched model: the
    same metrics and eval loss as the unpatched model."""
    from transformers import Trainer, TrainingArguments

    rows = []
    for _ in range(3):
        input_ids, labels = batch(rows=1, seq=9, pad_last=2)
        rows.append({"input_ids": input_ids[0], "labels": labels[0], "attention_mask": torch.ones(9, dtype=torch.long)})

    def accuracy(prediction):
        predicted = prediction.predictions.argmax(-1)[:, :-1]
        target = prediction.label_ids[:, 1:]
        valid = target != -100
        return {"accuracy": float((predicted[valid] == target[valid]).mean())}

    def evaluate(model, out):
        args = TrainingArguments(output_dir=str(tmp_path / out), per_device_eval_batch_size=2, use_cpu=True,
                                 report_to="none", remove_unused_columns=False, disable_tqdm=True)
        return Trainer(model=model, args=args, eval_dataset=rows, compute_metrics=accuracy).evaluate()

    model = tiny_peft_model("llama")
    ref = evaluate(model, "ref")
    metrics = evaluate(leantune.patch(model), "patched")
    assert metrics["eval_accuracy"] == ref["eval_accuracy"]
    assert abs(metrics["eval_loss"] - ref["eval_loss"]) <= 1e-5 * abs(ref["eval_loss"])


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_num_items_zero_without_targets_gives_zero_loss(backend_name, monkeypatch):
    """A window without targets: HF Trainer passes num_items_in_batch = 0 (a tensor); the patched model's loss is 0.0
    and every gradient exactly 0 (HF's 0 / 0 is NaN), on both backends, as an int, a 0-dim or a [1, 1] tensor."""
    monkeypatch.setenv("LEANTUNE_BACKEND", backend_name)
    model = leantune.patch(tiny_peft_model("llama", device=DEVICE).train())  # the card on CUDA
    input_ids, labels = batch(rows=1, seq=5, pad_last=0, device=DEVICE)
    labels[:] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    counts = (torch.tensor(0, device=DEVICE), 0, torch.tensor([[0]], device=DEVICE))
    if DEVICE != "cpu":
        counts += (torch.tensor(0),)  # a CPU 0-dim beside CUDA logits (HF Trainer's num_items_in_batch may be one)
    for num_items in counts:
        loss = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
        assert loss.item() == 0.0
        for g in torch.autograd.grad(loss.sum(), params):
            assert torch.equal(g, torch.zeros_like(g))


FAKE_OLD_TRL_LOOP = '''
def compute_loss(model, inputs):
    outputs = model(**inputs)
    logits = outputs.logits[..., :-1, :]  # TRL <= 1.14's SFTTrainer: loss and metrics from the logits
    return logits.sum()
'''


def test_old_trl_reading_training_logits_gets_the_fix_named(monkeypatch):
    """TRL <= 1.14 (no fused LM head) reads outputs.logits in training: after a bare patch a caller from a ``trl.``
    module gets a stand-in whose use raises a TypeError naming patch_trainer and loss=False (it was None, and
    "'NoneType' object is not subscriptable"); other callers, and callers under a TRL with the fused head, get None."""
    from leantune.patch import missing_logits

    model = leantune.patch(tiny_peft_model("llama").train())
    input_ids, labels = batch()
    namespace = {"__name__": "trl.trainer.sft_trainer"}  # a fake trainer loop, as a TRL module
    exec(FAKE_OLD_TRL_LOOP, namespace)  # noqa: S102
    monkeypatch.setattr(missing_logits, "_lacks", [True])
    with pytest.raises(TypeError, match=r"patch_trainer\(trainer\).*loss=False"):
        namespace["compute_loss"](model, {"input_ids": input_ids, "labels": labels})
    out = model(input_ids=input_ids, labels=labels)
    assert out.logits is None and torch.isfinite(out.loss)
    with pytest.raises(TypeError, match="patch_trainer"):
        torch.log_softmax(missing_logits.MISSING, -1)
    assert not missing_logits.MISSING and copy.deepcopy(missing_logits.MISSING) is not None
    monkeypatch.setattr(missing_logits, "_lacks", [False])  # TRL >= 1.15: its calls never read them here
    with pytest.raises(TypeError, match="NoneType"):
        namespace["compute_loss"](model, {"input_ids": input_ids, "labels": labels})


def test_forward_with_labels_under_inference_mode():
    """An eval loop under torch.inference_mode: inference tensors carry no version counter, so the positions the
    causal-LM forward makes are not remembered (transformers' own check runs); the loss is HF's."""
    model = tiny_peft_model("llama").eval()
    input_ids, labels = batch()
    with torch.inference_mode():
        ref = model(input_ids=input_ids, labels=labels).loss
    leantune.patch(model)
    for mode in ("eval", "train"):
        getattr(model, mode)()
        with torch.inference_mode():
            loss = model(input_ids=input_ids, labels=labels).loss
        assert rel_err(loss, ref) <= 1e-5, mode
