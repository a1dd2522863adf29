"""TRL's trainers with leantune: patched (``patch_trainer``) against TRL's own loss head, step by step.

Every run trains a tiny random Llama (2 layers, hidden 64, byte tokenizer of test_train) with LoRA (all linear
projections, dropout 0) in fp32 on the CPU for a few steps; ``bf16=False`` is explicit because TRL's configs default
to bf16 autocast, also on the CPU. The optimiser is SGD: Adam's first steps are about lr * sign(g), so a gradient
element near zero turns a 1e-7 difference into a 2 lr parameter difference, which no loss head can match. Per step,
the logged loss and pre-clipping gradient norm of the patched run must be within fp32 tolerance (1e-5 relative) of the
unpatched run, and leantune's loss-head counter must show that every ``fused_lm_head`` call was leantune's.

Longer than 500 lines because every TRL trainer patch_trainer serves (SFT, DPO, KTO, GRPO, RLOO, ORPO, CPO) shares
this file's tiny-model, LoRA and plain-TRL-versus-patched fixtures; split by trainer they would be copied.
"""

from __future__ import annotations

import copy
import importlib
import random
import warnings

import pytest
import torch
from reference import assert_close, recording_sizes
from test_train import WORDS, write_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import leantune
from leantune.integrations.trl import loss_head_calls, patch_trainer
from leantune.patch.forwards import LOSS_CALLS_ATTR

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

STEPS = 3


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("trl") / "model").parent


@pytest.fixture(autouse=True)
def quiet():
    datasets.disable_progress_bars()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's deprecation and padding-free notices
        yield


def _phrase(rng, lo=2, hi=6):
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def _sft_rows(n=24):
    rng = random.Random(0)
    return [{"prompt": _phrase(rng), "completion": " " + _phrase(rng)} for _ in range(n)]


def _dpo_rows(n=16):
    rng = random.Random(1)
    return [{"prompt": _phrase(rng), "chosen": " " + _phrase(rng), "rejected": " " + _phrase(rng)} for _ in range(n)]


def _lora_model(folder, seed):
    """A fresh model, config and tokenizer each time: a trainer edits the tokenizer and config it is given."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    # init_lora_weights=False: B is random too, so the adapters change the forward from the first step
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0,
                                             init_lora_weights=False))
    return model, AutoTokenizer.from_pretrained(folder)


def _common(tmp_path, **overrides):
    # SGD at lr 0.03: each update carries the heads' fp32 rounding differences (~1e-7) into the next step's numbers;
    # at lr 0.1 one draw in ~30 amplified a step's grad norm difference to 1.08e-5
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=4, optim="sgd",
                    learning_rate=0.03, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                    bf16=False, disable_tqdm=True)
    settings.update(overrides)
    return settings


def _sft_trainer(folder, tmp_path, seed, model=None, **overrides):
    built, tok = _lora_model(folder, seed)
    overrides.setdefault("max_length", 64)
    args = trl.SFTConfig(**_common(tmp_path, **overrides))
    return trl.SFTTrainer(model=built if model is None else model, args=args,
                          train_dataset=datasets.Dataset.from_list(_sft_rows()), processing_class=tok)


def _dpo_trainer(folder, tmp_path, seed, model=None, **overrides):
    built, tok = _lora_model(folder, seed)
    args = trl.DPOConfig(**_common(tmp_path, max_length=64, per_device_train_batch_size=2, **overrides))
    return trl.DPOTrainer(model=built if model is None else model, args=args,
                          train_dataset=datasets.Dataset.from_list(_dpo_rows()), processing_class=tok)


def _train(trainer, seed):
    torch.manual_seed(seed)  # the sampler's draw
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    assert len(logs) == STEPS
    return logs


def _compare(ref_logs, logs, keys):
    for step, (ref, out) in enumerate(zip(ref_logs, logs)):
        for key in keys:
            if key.startswith("logits/"):
                # a mean over signed logits of size ~0.1 can cancel to ~1e-5 (one draw: 4.2e-5): its fp32 rounding
                # is absolute, about eps times the logits' size, so it is compared absolutely
                assert abs(float(out[key]) - float(ref[key])) <= 1e-6, (step, key, out[key], ref[key])
                continue
            assert_close(f"step {step} {key}", torch.tensor(float(out[key])), torch.tensor(float(ref[key])),
                         torch.float32)


SFT_CASES = {
    "plain": {},
    "packing": {"packing": True},
    "padding_free": {"padding_free": True, "max_length": None},
    "grad_accum_2": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
    "checkpointing": {"gradient_checkpointing": True},
    "dft": {"loss_type": "dft"},
}


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_trainer_matches_trl_head_and_runs_leantune_loss(tiny_folder, tmp_path, fresh_seed, case):
    overrides = SFT_CASES[case]
    build = lambda seed: _sft_trainer(tiny_folder, tmp_path, seed, **overrides)  # noqa: E731
    ref_logs = _train(build(fresh_seed), fresh_seed)
    trainer = patch_trainer(build(fresh_seed))
    hf = trainer.model.get_base_model()
    assert "TRL's fused_lm_head calls" in hf.leantune_summary["loss_runs"]
    logs = _train(trainer, fresh_seed)
    _compare(ref_logs, logs, ("loss", "grad_norm", "entropy", "mean_token_accuracy"))
    micro_batches = STEPS * overrides.get("gradient_accumulation_steps", 1)
    assert loss_head_calls(trainer.model) == micro_batches


def _moe_sft_trainer(folder, tmp_path, seed):
    """A tiny Qwen3-MoE (LoRA on attention and the expert stacks) under SFTTrainer, which asks for router logits
    (router_aux_loss_coef > 0) and adds their load-balancing loss to the fused head's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=LlamaConfig.from_pretrained(folder).vocab_size, hidden_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                            router_aux_loss_coef=0.5, pad_token_id=tok.pad_token_id)
    model = get_peft_model(Qwen3MoeForCausalLM(config), LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0, init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    return trl.SFTTrainer(model=model, args=trl.SFTConfig(**_common(tmp_path, max_length=64)),
                          train_dataset=datasets.Dataset.from_list(_sft_rows()), processing_class=tok)


def test_moe_sft_trainer_runs_leantune_head_with_the_router_loss(tiny_folder, tmp_path, fresh_seed):
    """TRL's SFTTrainer asks a MoE for router logits at every step: leantune's head serves the calls and adds the
    load-balancing loss as TRL's head does (coefficient 0.5 here, so a missing term would show)."""
    ref_logs = _train(_moe_sft_trainer(tiny_folder, tmp_path, fresh_seed), fresh_seed)
    trainer = patch_trainer(_moe_sft_trainer(tiny_folder, tmp_path, fresh_seed))
    logs = _train(trainer, fresh_seed)
    _compare(ref_logs, logs, ("loss", "grad_norm", "entropy", "mean_token_accuracy"))
    assert loss_head_calls(trainer.model) == STEPS
    assert trainer.model.get_base_model().leantune_summary["loss_runs"].endswith("TRL's chunked head 0")


def test_dpo_trainer_matches_trl_head_and_runs_leantune_loss(tiny_folder, tmp_path, fresh_seed):
    ref_logs = _train(_dpo_trainer(tiny_folder, tmp_path, fresh_seed), fresh_seed)
    trainer = patch_trainer(_dpo_trainer(tiny_folder, tmp_path, fresh_seed))
    logs = _train(trainer, fresh_seed)
    # the rewards are beta (logp - ref logp), a difference of near-equal sums: compared through their terms
    _compare(ref_logs, logs, ("loss", "grad_norm", "logps/chosen", "logps/rejected", "entropy", "logits/chosen",
                              "logits/rejected"))
    # each step: the policy pass and the reference pass (the same model with the adapter disabled)
    assert loss_head_calls(trainer.model) == 2 * STEPS


def _labelled_loss(model, input_ids):
    model.train()
    return model(input_ids=input_ids, labels=input_ids).loss


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_unpatch_after_trainer_wraps_the_forward_then_patch_again(tiny_folder, tmp_path, fresh_seed, kind):
    build = _sft_trainer if kind == "sft" else _dpo_trainer
    reference_model, _ = _lora_model(tiny_folder, fresh_seed)
    model, _ = _lora_model(tiny_folder, fresh_seed)
    leantune.patch(model)
    trainer = build(tiny_folder, tmp_path, fresh_seed, model=model)  # TRL wraps the patched forward
    hf = model.get_base_model()
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 21))
    expected = _labelled_loss(reference_model, input_ids)

    leantune.unpatch(trainer.model)  # TRL's wrapper still holds leantune's forward: it must now be HF's
    assert not leantune.is_patched(trainer.model)
    assert_close("after unpatch", _labelled_loss(model, input_ids), expected, torch.float32)
    fused = hf(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert torch.isfinite(fused.loss)

    leantune.patch(trainer.model)
    assert leantune.is_patched(trainer.model)
    assert "around leantune's causal-LM forward" in hf.leantune_summary["loss_runs"]
    out = hf(input_ids=input_ids, labels=input_ids)
    assert out.logits is None  # leantune's forward again: no logits in training
    assert_close("patched again", out.loss, expected, torch.float32)


def test_unpatch_gives_trl_head_back_and_patch_takes_it_again(tiny_folder, tmp_path, fresh_seed):
    trainer = patch_trainer(_sft_trainer(tiny_folder, tmp_path, fresh_seed))
    hf = trainer.model.get_base_model()
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 17))
    hf.train()
    served = hf(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert loss_head_calls(hf) == 1
    leantune.unpatch(trainer.model)
    trl_head = hf(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert loss_head_calls(hf) == 1  # TRL's own head ran
    assert_close("log_probs", served.log_probs, trl_head.log_probs, torch.float32)
    assert "TRL" not in str(hf.__dict__.get("leantune_summary"))
    leantune.patch(trainer.model)
    assert "TRL's fused_lm_head calls" in hf.leantune_summary["loss_runs"]
    hf(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert loss_head_calls(hf) == 2


def test_fused_head_statistics_match_trl_head(tiny_folder, tmp_path, fresh_seed):
    """Entropy, log sum p^2, mean logit and top-1 agreement from leantune's loss op equal TRL's kernel's, with one
    lm_head product in the forward (the op's one logits chunk: no second pass for the statistics)."""
    trainer = _dpo_trainer(tiny_folder, tmp_path, fresh_seed, use_weighting=True)
    reference = copy.deepcopy(trainer.model)  # TRL's head (the deep copy rebinds its wrapper to the copy)
    patch_trainer(trainer)
    input_ids = torch.randint(0, 259, (3, 30))
    labels = input_ids.clone()
    labels[:, :7] = -100
    head_shape = tuple(trainer.model.get_base_model().get_output_embeddings().weight.shape)
    with _HeadProducts(head_shape) as products:
        ours = trainer.model.get_base_model()(input_ids=input_ids, labels=labels, fused_lm_head=True)
    assert products.count == 1
    outs = [reference.get_base_model()(input_ids=input_ids, labels=labels, fused_lm_head=True), ours]
    assert loss_head_calls(trainer.model) == 1 and loss_head_calls(reference) == 0
    for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert_close(name, getattr(outs[1], name), getattr(outs[0], name), torch.float32)
    assert torch.equal(outs[1].is_top1, outs[0].is_top1) and torch.equal(outs[1].label_mask, outs[0].label_mask)
    assert_close("loss", outs[1].loss, outs[0].loss, torch.float32)


class _HeadProducts(TorchDispatchMode):
    """Counts matrix products with an operand of the lm_head weight's shape [V, H] (or its transpose)."""

    def __init__(self, shape):
        super().__init__()
        self.shapes, self.count = {shape, shape[::-1]}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.linear):
            self.count += any(isinstance(a, torch.Tensor) and tuple(a.shape) in self.shapes for a in args)
        return func(*args, **(kwargs or {}))


def test_trainer_without_fused_head_gets_logits_in_training(tiny_folder, tmp_path, fresh_seed):
    """TRL <= 1.14 read outputs.logits in training: a trainer whose model has no fused head gets them."""
    trainer = _sft_trainer(tiny_folder, tmp_path, fresh_seed)
    hf = trainer.model.get_base_model()
    del hf.forward  # the model as TRL <= 1.14 leaves it: no fused LM head
    reference = copy.deepcopy(trainer.model)
    patch_trainer(trainer)
    runs = hf.leantune_summary["loss_runs"]
    assert "logits formed in training" in runs and "SFTTrainer makes no fused_lm_head calls" in runs
    assert "ran so far: 0 losses" in runs  # what ran: none yet
    input_ids = torch.randint(0, 259, (2, 19))
    out, ref = (m.train()(input_ids=input_ids, labels=input_ids) for m in (trainer.model, reference))
    assert out.logits is not None
    assert_close("logits", out.logits, ref.logits, torch.float32)
    assert_close("loss", out.loss, ref.loss, torch.float32)


def test_trainer_that_may_differentiate_statistics_keeps_trl_head(tiny_folder, tmp_path, fresh_seed):
    """leantune's statistics carry no gradient: a TRL trainer outside SFT/DPO/KTO/GRPO/RLOO keeps TRL's head."""
    trainer = object.__new__(trl.RewardTrainer)  # not built: only its class and model are read
    trainer.model = _sft_trainer(tiny_folder, tmp_path, fresh_seed).model  # carries TRL's fused head
    patch_trainer(trainer)
    hf = trainer.model.get_base_model()
    assert "RewardTrainer is not an SFTTrainer, DPOTrainer, KTOTrainer" in hf.leantune_summary["loss_runs"]
    input_ids = torch.randint(0, 259, (2, 15))
    out = hf.train()(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert loss_head_calls(hf) == 0 and torch.isfinite(out.loss)


def test_patch_trainer_freezes_the_heap_while_training(tiny_folder, tmp_path, fresh_seed):
    """Steps run with the objects alive at train()'s start frozen out of full collections (leantune.heap), thawed
    at its end, also when train() raises; one wrapper however often patch_trainer is called; freeze_heap=False
    takes it off."""
    import gc

    from transformers import TrainerCallback

    class FreezeCount(TrainerCallback):
        def __init__(self, fail_at=None):
            self.seen, self.fail_at = [], fail_at

        def on_step_end(self, args, state, control, **kwargs):
            self.seen.append(gc.get_freeze_count())
            if len(self.seen) == self.fail_at:
                raise RuntimeError("a step failed")

    trainer = patch_trainer(patch_trainer(_sft_trainer(tiny_folder, tmp_path, fresh_seed)))
    assert trainer.train.leantune_frozen_heap and not hasattr(trainer.train.__wrapped__, "leantune_frozen_heap")
    counter = FreezeCount()
    trainer.add_callback(counter)
    _train(trainer, fresh_seed)
    assert len(counter.seen) == STEPS and all(count > 1000 for count in counter.seen), counter.seen
    assert gc.get_freeze_count() == 0

    failing = patch_trainer(_sft_trainer(tiny_folder, tmp_path / "failing", fresh_seed))
    counter = FreezeCount(fail_at=1)
    failing.add_callback(counter)
    with pytest.raises(RuntimeError, match="a step failed"):
        failing.train()
    assert counter.seen[0] > 1000 and gc.get_freeze_count() == 0

    patch_trainer(failing, freeze_heap=False)
    assert "train" not in failing.__dict__
    counter = FreezeCount()
    failing.add_callback(counter)
    failing.train()
    assert counter.seen and set(counter.seen) == {0}


def _grpo_trainer(folder, tmp_path, seed, **overrides):
    model, tok = _lora_model(folder, seed)
    rng = random.Random(2)
    prompts = [{"prompt": _phrase(rng)} for _ in range(8)]
    settings = dict(max_completion_length=6, num_generations=4, per_device_train_batch_size=4, beta=0.1,
                    temperature=0.9, logging_steps=1)
    settings.update(overrides)
    args = trl.GRPOConfig(**_common(tmp_path, **settings))

    def reward(completions, **kwargs):  # longer completions with more "a" score higher: a spread of advantages
        return [float(len(c)) / 10 + c.count("a") for c in completions]

    return trl.GRPOTrainer(model=model, args=args, reward_funcs=reward, processing_class=tok,
                           train_dataset=datasets.Dataset.from_list(prompts))


def test_grpo_trainer_matches_trl_head_and_runs_leantune_log_probs(tiny_folder, tmp_path, fresh_seed):
    """GRPOTrainer (fp32, LoRA, beta > 0: the reference is the model with adapters disabled, temperature 0.9, an
    entropy bonus: the entropy's gradient too): per step the logged loss, KL, entropy, rewards and gradient norm
    equal plain TRL's, and every fused_lm_head call (policy with gradient, reference without) went to leantune's
    log-prob head."""
    ref_logs = _train(_grpo_trainer(tiny_folder, tmp_path, fresh_seed, entropy_coef=0.01), fresh_seed)
    trainer = patch_trainer(_grpo_trainer(tiny_folder, tmp_path, fresh_seed, entropy_coef=0.01))
    hf = trainer.model.get_base_model()
    assert trainer._entropy_bonus_enabled  # TRL's loss differentiates the entropy
    assert "ops.linear_log_probs at temperature 0.9" in hf.leantune_summary["loss_runs"]
    logs = _train(trainer, fresh_seed)
    _compare(ref_logs, logs, ("entropy", "reward", "reward_std"))
    for step, (ref, out) in enumerate(zip(ref_logs, logs)):
        # two fp32 computations of one norm (TRL's full logits, leantune's chunks), each within fp32's 1e-5 of the
        # float64 value: their difference is bounded by the sum (one draw in ~10: 1.47e-5). With equal rewards the
        # advantages are 0 and the gradient is beta KL's (exp(d) - 1) dlogp at d ~ 1e-3 plus the entropy bonus's
        # -p (log p + H): this random model is near uniform (H 5.54 of log 256 = 5.545), so log p + H is a
        # difference of near-equal terms whose fp32 rounding, eps H ~ 7e-7 on values ~1e-3, is ~1e-3 relative
        # (draws: 5.3e-5; 6.8e-4 at seed 831721542, every step with equal rewards)
        bar = 2e-5 if float(ref["reward_std"]) > 0 else 2e-3
        assert abs(float(out["grad_norm"]) - float(ref["grad_norm"])) <= bar * float(ref["grad_norm"]), (
            step, out["grad_norm"], ref["grad_norm"], ref["reward_std"])
    for step, (ref, out) in enumerate(zip(ref_logs, logs)):
        # both are differences that cancel in fp32, so their rounding is absolute: the surrogate sums
        # advantage-weighted ratios of 1 to ~0 (advantages centred per group), leaving beta KL ~1e-6; TRL's k3
        # exp(d) - d - 1 at d ~ 1e-3 is formed from terms ~1 (fp32 eps 1.2e-7 each)
        assert abs(float(out["loss"]) - float(ref["loss"])) <= 1e-6, (step, out["loss"], ref["loss"])
        assert abs(float(out["kl"]) - float(ref["kl"])) <= 5e-7, (step, out["kl"], ref["kl"])
    # per step: the reference pass and the policy pass (old log-probs are the policy's detached: one update each)
    assert loss_head_calls(trainer.model) == 2 * STEPS


def test_grpo_metrics_off_are_not_logged(tiny_folder, tmp_path, fresh_seed):
    """metrics=False without an entropy bonus or token mask: the entropy is neither computed nor logged (not 0)."""
    trainer = patch_trainer(_grpo_trainer(tiny_folder, tmp_path, fresh_seed, max_steps=1), metrics=False)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all("entropy" not in h for h in logged) and loss_head_calls(trainer.model) == 2


def test_patch_trainer_names_what_it_takes(tiny_folder, tmp_path, fresh_seed):
    from transformers import Trainer, TrainingArguments

    model, _ = _lora_model(tiny_folder, fresh_seed)
    with pytest.raises(ValueError, match=r"patch_trainer takes a built TRL trainer .*leantune\.patch\(model\)"):
        patch_trainer(model)
    with pytest.raises(ValueError, match=r"takes a built TRL trainer .*got torch\.nn\.modules\.linear\.Linear"):
        patch_trainer(torch.nn.Linear(2, 2))
    plain = Trainer(model=model, args=TrainingArguments(**_common(tmp_path)))
    with pytest.raises(ValueError, match=r"got transformers\.trainer\.Trainer.*leantune\.patch\(trainer\.model\)"):
        patch_trainer(plain)
    # a keyword it does not take, or a switch leantune.patch refuses: the trainer's head is left as it was
    trainer = _sft_trainer(tiny_folder, tmp_path, fresh_seed)
    hf = trainer.model.get_base_model()
    head = hf.__dict__.get("forward")
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['bogus'\]"):
        patch_trainer(trainer, bogus=1)
    with pytest.raises(ValueError, match="tile_mlp"):
        patch_trainer(trainer, tile_mlp=0)
    with pytest.raises(ValueError, match="metrics must be True or False, got 'no'"):  # "no" is truthy
        patch_trainer(trainer, metrics="no")
    with pytest.raises(ValueError, match="freeze_heap must be True or False, got 1"):
        patch_trainer(trainer, freeze_heap=1)
    assert hf.__dict__.get("forward") is head and "leantune_summary" not in dir(hf)


def test_head_counted_under_accelerate_mixed_precision(tiny_folder, tmp_path, fresh_seed):
    """bf16=True on a model without PEFT: Trainer.train wraps the instance forward (leantune's head) in accelerate's
    autocast and fp32-output wrappers; loss_head_calls and loss_runs still count the head's calls."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from leantune.integrations.trl import FusedLMHead, loss_head_calls

    torch.manual_seed(fresh_seed)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_folder))
    trainer = patch_trainer(_sft_trainer(tiny_folder, tmp_path, fresh_seed, model=model, bf16=True, max_steps=2))
    trainer.train()
    assert not isinstance(model.__dict__["forward"], FusedLMHead)  # wrapped by accelerate
    assert loss_head_calls(trainer.model) == 2
    assert "ran so far: leantune's head 2 fused_lm_head calls" in model.leantune_summary["loss_runs"]


def test_summary_after_unpatch_says_unpatched(tiny_folder, tmp_path, fresh_seed):
    trainer = patch_trainer(_sft_trainer(tiny_folder, tmp_path, fresh_seed))
    hf = trainer.model.get_base_model()
    leantune.unpatch(trainer.model)
    assert "unpatched" in hf.leantune_summary["loss_runs"] and hf.leantune_summary["counts"]["loss"] == 0


def test_sft_metrics_off_are_left_out_of_the_logs(tiny_folder, tmp_path, fresh_seed):
    trainer = patch_trainer(_sft_trainer(tiny_folder, tmp_path, fresh_seed), metrics=False)
    logs = _train(trainer, fresh_seed)
    assert all("entropy" not in h and "mean_token_accuracy" not in h for h in logs)
    patch_trainer(trainer)  # metrics on again: the wrapper is taken off
    assert "log" not in trainer.__dict__


def test_loss_runs_says_which_head_ran(tiny_folder, tmp_path, fresh_seed):
    """A bare leantune.patch before the trainer is built: TRL's wrapper comes after it and its chunked head serves
    the fused_lm_head calls; the summary says so from what ran (leantune's loss count 0), and patch_trainer's head
    reports its own calls."""
    model, _ = _lora_model(tiny_folder, fresh_seed)
    leantune.patch(model)
    hf = model.get_base_model()
    runs = hf.leantune_summary["loss_runs"]
    assert runs.startswith("ops.linear_cross_entropy (leantune's causal-LM forward); ran so far: 0 losses")
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 13))
    hf.train()(input_ids=input_ids)  # no labels: logits back, no loss of leantune's
    assert "ran so far: 0 losses" in hf.leantune_summary["loss_runs"]
    hf(input_ids=input_ids, labels=input_ids)
    assert "ran so far: 1 losses" in hf.leantune_summary["loss_runs"]
    hf.__dict__[LOSS_CALLS_ATTR] = 0
    trainer = _sft_trainer(tiny_folder, tmp_path, fresh_seed, model=model)
    hf.train()(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    runs = hf.leantune_summary["loss_runs"]
    assert "TRL's chunked head" in runs and "patch_trainer" in runs and runs.endswith(": 0 losses so far")
    assert dict(hf.leantune_summary.items())["loss_runs"] == runs == copy.deepcopy(hf.leantune_summary)["loss_runs"]
    hf(input_ids=input_ids, labels=input_ids)  # a plain labelled call reaches leantune's forward
    assert hf.leantune_summary["loss_runs"].endswith(": 1 losses so far")
    patch_trainer(trainer)
    hf(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert hf.leantune_summary["loss_runs"].endswith("leantune's head 1 fused_lm_head calls, TRL's chunked head 0")
    # router logits of a model whose config names no experts: TRL's head, and why (its head stubbed: Llama computes
    # no router logits; a MoE's are served: test_moe_sft_trainer_runs_leantune_head_with_the_router_loss)
    head = hf.__dict__["forward"]
    head.previous, trl_head = (lambda *args, **kwargs: None), head.previous
    hf(input_ids=input_ids, labels=input_ids, fused_lm_head=True, output_router_logits=True)
    head.previous = trl_head
    assert hf.leantune_summary["loss_runs"].endswith(
        "leantune's head 1 fused_lm_head calls, TRL's chunked head 1 (last one: MoE router logits asked for "
        "(output_router_logits: TRL turns it on for a router_aux_loss_coef above 0) of a model without num_experts "
        "and num_experts_per_tok in its config)")
    leantune.patch(model, loss=False)  # leantune's head steps aside: TRL's runs, and the count says so
    hf(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert hf.leantune_summary["loss_runs"].endswith(
        "leantune's head 1 fused_lm_head calls, TRL's chunked head 2 (last one: the model is not patched for its "
        "loss, or its lm_head is not a plain unhooked nn.Linear)")


def _rloo_trainer(folder, tmp_path, seed, **overrides):
    model, tok = _lora_model(folder, seed)
    rng = random.Random(3)
    prompts = [{"prompt": _phrase(rng)} for _ in range(8)]
    args = trl.RLOOConfig(**_common(tmp_path, max_completion_length=6, num_generations=4,
                                    per_device_train_batch_size=4, beta=0.1, temperature=0.8, **overrides))

    def reward(completions, **kwargs):
        return [float(len(c)) / 10 + c.count("e") for c in completions]

    return trl.RLOOTrainer(model=model, args=args, reward_funcs=reward, processing_class=tok,
                           train_dataset=datasets.Dataset.from_list(prompts))


def test_rloo_trainer_matches_trl_head_and_runs_leantune_log_probs(tiny_folder, tmp_path, fresh_seed):
    """RLOOTrainer (fp32, LoRA, beta > 0, temperature 0.8): the logged loss, KL, entropy, rewards and gradient norm
    equal plain TRL's per step, and its fused_lm_head calls (reference and policy) went to leantune's head."""
    ref_logs = _train(_rloo_trainer(tiny_folder, tmp_path, fresh_seed), fresh_seed)
    trainer = patch_trainer(_rloo_trainer(tiny_folder, tmp_path, fresh_seed))
    hf = trainer.model.get_base_model()
    assert "ops.linear_log_probs at temperature 0.8 per token (RLOOTrainer's" in hf.leantune_summary["loss_runs"]
    logs = _train(trainer, fresh_seed)
    _compare(ref_logs, logs, ("entropy", "reward", "reward_std"))
    for step, (ref, out) in enumerate(zip(ref_logs, logs)):
        # beta KL's gradient, (exp(d) - 1) dlogp for log-prob gaps d ~ 1e-3 to the reference, has an fp32 rounding
        # of eps / d ~ 1e-4 relative; it dominates where the advantages are zero (equal rewards: draws 5.6e-5,
        # 9.5e-6) or small (reward_std > 0: 2.64e-5 at LEANTUNE_TEST_SEED=1279630658, step 0)
        assert abs(float(out["grad_norm"]) - float(ref["grad_norm"])) <= 1e-4 * float(ref["grad_norm"]), (
            step, out, ref)
    for step, (ref, out) in enumerate(zip(ref_logs, logs)):  # differences that cancel in fp32 (GRPO's test)
        assert abs(float(out["loss"]) - float(ref["loss"])) <= 1e-6, (step, out["loss"], ref["loss"])
        assert abs(float(out["kl"]) - float(ref["kl"])) <= 5e-7, (step, out["kl"], ref["kl"])
    # per step: the old log-probs (no gradient), the reference pass and the policy pass; none passed on to TRL's head
    assert loss_head_calls(trainer.model) == 3 * STEPS and hf.forward.passed == 0


def _kto_rows(n=16):
    rng = random.Random(4)
    return [{"prompt": _phrase(rng), "completion": " " + _phrase(rng), "label": i % 2 == 0} for i in range(n)]


def _kto_trainer(folder, tmp_path, seed):
    model, tok = _lora_model(folder, seed)
    args = trl.KTOConfig(**_common(tmp_path, max_length=64, per_device_train_batch_size=4))
    return trl.KTOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(_kto_rows()),
                          processing_class=tok)


def test_kto_trainer_matches_trl_head_and_runs_leantune_loss(tiny_folder, tmp_path, fresh_seed):
    """KTOTrainer (fp32, LoRA; the reference is the model with adapters disabled): logged loss, gradient norm,
    log-probs, KL, entropy and mean logits equal plain TRL's per step; every fused_lm_head call was leantune's."""
    ref_logs = _train(_kto_trainer(tiny_folder, tmp_path, fresh_seed), fresh_seed)
    trainer = patch_trainer(_kto_trainer(tiny_folder, tmp_path, fresh_seed))
    hf = trainer.model.get_base_model()
    assert "TRL's fused_lm_head calls" in hf.leantune_summary["loss_runs"]
    logs = _train(trainer, fresh_seed)
    keys = [k for k in ("loss", "grad_norm", "entropy", "logits/chosen", "logits/rejected", "logps/chosen",
                        "logps/rejected") if k in ref_logs[0]]
    assert {"loss", "grad_norm", "entropy"} <= set(keys)
    _compare(ref_logs[:1], logs[:1], tuple(keys))  # step 0: same weights, same batch, the fp32 bar
    # later steps follow the SGD updates: KTO's KL baseline (a mean over mismatched pairs) feeds every row's weight,
    # and one draw in ~13 carried step 0's ~1e-7 rounding to 1.94e-5 in step 1's grad norm (seed 831721542)
    for step, (ref, out) in enumerate(zip(ref_logs[1:], logs[1:]), start=1):
        for key in (k for k in keys if not k.startswith("logits/")):  # signed means that can cancel: step 0 only
            assert abs(float(out[key]) - float(ref[key])) <= 1e-4 * abs(float(ref[key])), (step, key, out, ref)
    for step, (ref, out) in enumerate(zip(ref_logs, logs)):  # beta KL, a difference of near-equal sums: absolute
        assert abs(float(out["kl"]) - float(ref["kl"])) <= 1e-5, (step, out["kl"], ref["kl"])
    # per step: policy and reference, each on the batch and on its mismatched KL pairs
    assert loss_head_calls(trainer.model) == 4 * STEPS and hf.forward.passed == 0


def _pair_trainer(kind, folder, tmp_path, seed, **overrides):
    """TRL's ORPOTrainer or CPOTrainer (trl.experimental) on the DPO rows."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    config, trainer = (ORPOConfig, ORPOTrainer) if kind == "orpo" else (CPOConfig, CPOTrainer)
    model, tok = _lora_model(folder, seed)
    args = config(**_common(tmp_path, max_length=64, per_device_train_batch_size=2, remove_unused_columns=False,
                            **overrides))
    return trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(_dpo_rows()),
                   processing_class=tok)


def _compare_differences(ref_logs, logs, differences):
    """A logged difference of near-equal fp32 values (a reward margin, ORPO's log odds of sequence log-probs ~ -5
    apart by ~1e-3) rounds absolutely at the size of its terms: within 1e-5 of them (one draw: margins 7.9e-6
    relative to themselves, 3e-8 absolute)."""
    for step, (ref, out) in enumerate(zip(ref_logs, logs)):
        for key, terms in differences.items():
            scale = max(abs(float(ref[term])) for term in terms)
            assert abs(float(out[key]) - float(ref[key])) <= 1e-5 * scale, (step, key, out[key], ref[key])


PAIR_CASES = {"orpo": ("orpo", {}), "cpo_sigmoid": ("cpo", {}),
              "cpo_simpo": ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.5})}


@pytest.mark.parametrize("case", list(PAIR_CASES))
def test_orpo_cpo_trainers_match_trl_and_run_leantune_head(tiny_folder, tmp_path, fresh_seed, case):
    """ORPOTrainer and CPOTrainer (fp32, LoRA; CPO's sigmoid loss on summed log-probs, SimPO on means): per step the
    logged loss, gradient norm, NLL, rewards, log-probs, mean logits (and ORPO's log odds) equal plain TRL's, and
    every batch went through leantune's head (none through TRL's full-logits forward). rewards/accuracies counts
    pairs with chosen > rejected, a step function of the rewards: a pair within rounding of a tie may flip, so it
    is not compared."""
    kind, overrides = PAIR_CASES[case]
    ref_logs = _train(_pair_trainer(kind, tiny_folder, tmp_path, fresh_seed, **overrides), fresh_seed)
    trainer = patch_trainer(_pair_trainer(kind, tiny_folder, tmp_path, fresh_seed, **overrides))
    hf = trainer.model.get_base_model()
    loss = "ops.preference.orpo_loss" if kind == "orpo" else "TRL's cpo_loss"
    assert f"concatenated_forward: its log-probs and NLL from one call) + {loss}" in hf.leantune_summary["loss_runs"]
    logs = _train(trainer, fresh_seed)
    keys = ["loss", "grad_norm", "nll_loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected",
            "logits/chosen", "logits/rejected"] + (["log_odds_ratio"] if kind == "orpo" else [])
    _compare(ref_logs, logs, keys)
    differences = {"rewards/margins": ("rewards/chosen", "rewards/rejected")}
    if kind == "orpo":
        differences["log_odds_chosen"] = ("logps/chosen", "logps/rejected")
    _compare_differences(ref_logs, logs, differences)
    assert loss_head_calls(trainer.model) == STEPS and hf.forward.passed == 0
    assert hf.leantune_summary["loss_runs"].endswith(f"leantune's head {STEPS} fused_lm_head calls, TRL's own "
                                                     "full-logits concatenated_forward 0")


def _first_batch(trainer):
    trainer.model.train()
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def test_orpo_step_never_forms_logits_and_unpatch_gives_trl_back(tiny_folder, tmp_path, fresh_seed, monkeypatch):
    """One ORPO loss and backward: TRL's forms the [2B, S, V] logits; through patch_trainer no tensor reaches that
    size (the op's chunk budget cut to 8 rows), with the same loss. After leantune.unpatch, TRL's own forward runs
    again (counted as passed) and gives the same loss."""
    lce = importlib.import_module("leantune.ops.linear_cross_entropy")  # the module (ops exports the function)
    plain = _pair_trainer("orpo", tiny_folder, tmp_path, fresh_seed)
    trainer = patch_trainer(_pair_trainer("orpo", tiny_folder, tmp_path, fresh_seed))
    batch = _first_batch(trainer)
    vocab = trainer.model.get_base_model().config.vocab_size
    length = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    n_by_v = 2 * batch["chosen_input_ids"].shape[0] * length * vocab
    for memory in ("fast", "low"):  # the head's default ("fast", which statistics and reduction="none" take low)
        monkeypatch.setitem(lce.DEFAULT_CHUNK_BYTES, memory, 8 * vocab * 4)
    losses, peaks = [], []
    for t in (plain, trainer):
        with recording_sizes() as sizes:
            loss = t.compute_loss(t.model, batch)
            loss.backward()
        losses.append(loss.detach())
        peaks.append(max(sizes))
    assert peaks[0] >= n_by_v > peaks[1], (peaks, n_by_v)
    assert_close("loss", losses[1], losses[0], torch.float32)
    assert loss_head_calls(trainer.model) == 1
    leantune.unpatch(trainer.model)
    assert_close("loss unpatched", trainer.compute_loss(trainer.model, batch), losses[0], torch.float32)
    assert loss_head_calls(trainer.model) == 1 and trainer.model.get_base_model().forward.passed == 1


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_orpo_cpo_metrics_off_leave_mean_logits_out(tiny_folder, tmp_path, fresh_seed, kind):
    trainer = patch_trainer(_pair_trainer(kind, tiny_folder, tmp_path, fresh_seed, max_steps=1), metrics=False)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all("logits/chosen" not in h and "logits/rejected" not in h for h in logged)
    assert all("nll_loss" in h and "logps/chosen" in h for h in logged) and loss_head_calls(trainer.model) == 1


def test_orpo_labels_off_the_input_ids_poison_the_step_and_raise_at_logging(tiny_folder, tmp_path, fresh_seed):
    """ORPO's chosen rows are scored once per position on the input ids: a labelled token that is not its input id
    (another collator) makes the log-probs NaN and the next logging step raise, saying why; a TRL batch passes."""
    trainer = patch_trainer(_pair_trainer("orpo", tiny_folder, tmp_path, fresh_seed))
    batch = _first_batch(trainer)
    trainer.concatenated_forward(trainer.model, batch)
    trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, logs={})  # a TRL batch: no error
    labels = batch["chosen_labels"]
    position = (labels[0] != -100).nonzero()[0, 0]
    labels[0, position] = (labels[0, position] + 1) % trainer.model.get_base_model().config.vocab_size
    chosen, rejected, *_ = trainer.concatenated_forward(trainer.model, batch)
    assert torch.isnan(chosen).all() and torch.isnan(rejected).all()
    with pytest.raises(ValueError, match="is not the attended input id at its position"):
        trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, logs={})


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_orpo_cpo_step_reads_nothing_back(tiny_folder, tmp_path, fresh_seed, monkeypatch, kind):
    """A patched ORPO / CPO loss, backward and metrics make no host read from leantune's code (test_no_sync's
    watch): the metrics stay device tensors until TRL's log."""
    from test_no_sync import SyncCalls

    trainer = patch_trainer(_pair_trainer(kind, tiny_folder, tmp_path, fresh_seed, cpo_alpha=0.0) if kind == "cpo"
                            else _pair_trainer(kind, tiny_folder, tmp_path, fresh_seed))
    batch = _first_batch(trainer)
    watch = SyncCalls(monkeypatch)
    with watch:
        trainer.compute_loss(trainer.model, batch).backward()
    assert watch.calls == [], watch.calls
    stored = trainer._stored_metrics["train"]
    assert stored["nll_loss"] and all(isinstance(v, torch.Tensor) for values in stored.values() for v in values)
    assert loss_head_calls(trainer.model) == 1


def test_orpo_subclass_that_overrides_the_loss_keeps_trl_code(tiny_folder, tmp_path, fresh_seed):
    """A subclass's own odds_ratio_loss is what its user asked for: the route is not taken, and the summary says
    why; the batch then runs the subclass's code on full logits."""
    from trl.experimental.orpo import ORPOTrainer

    class ScaledORPO(ORPOTrainer):
        def odds_ratio_loss(self, chosen, rejected):
            losses, *rest = super().odds_ratio_loss(chosen, rejected)
            return (2 * losses, *rest)

    trainer = _pair_trainer("orpo", tiny_folder, tmp_path, fresh_seed)
    trainer.__class__ = ScaledORPO
    patch_trainer(trainer)
    hf = trainer.model.get_base_model()
    assert "ScaledORPO overrides odds_ratio_loss" in hf.leantune_summary["loss_runs"]
    assert "concatenated_forward" not in trainer.__dict__
    loss = trainer.compute_loss(trainer.model, _first_batch(trainer))
    assert torch.isfinite(loss) and loss_head_calls(trainer.model) == 0
