"""ops.preference (GRPO, DPO, ORPO, SimPO, KTO) vs float64 references and vs TRL 1.16's own computation on the same
batch; through the fused log-prob head on both backends. Only the cases that compare with TRL skip without it (the
heads and the errors need none), and every tensor is on ``conftest.DEVICE``."""

import collections
import types

import pytest
import torch
from conftest import DEVICE
from reference import assert_close, dpo_ref, grads64, grpo_ref, kto_ref, log_probs_ref, orpo_ref, simpo_ref

from leantune import ops
from leantune.ops import preference

B, T = 4, 6


def _log_probs(*shape):
    """Plausible token log-probs (< 0) with a gradient."""
    return (-torch.rand(*shape, device=DEVICE) * 3 - 0.01).requires_grad_()


def _mask():
    mask = (torch.rand(B, T, device=DEVICE) > 0.25).float()
    mask[0] = 0.0  # a sequence without completion tokens
    mask[1, :2] = 1.0
    return mask


def _grad_check(name, out, ref, leaves, eager=None):
    """Value and gradient of each leaf, fp32 vs float64 (grads64 copies the leaves); ``eager``: (value, grads) of
    another fp32 implementation of the formula, whose own error joins the bar (reference.tolerance)."""
    assert_close(name, out, ref[0], torch.float32, eager=None if eager is None else eager[0])
    grads = torch.autograd.grad(out, leaves)
    for i, (g, r) in enumerate(zip(grads, ref[1])):
        assert_close(f"{name} grad {i}", g, r, torch.float32, eager=None if eager is None else eager[1][i])


def _fake_accelerator():
    return types.SimpleNamespace(device=torch.device(DEVICE), num_processes=1, gather=lambda x: x,
                                 gather_for_metrics=lambda x: x, reduce=lambda x, reduction="sum": x)


GRPO_CASES = [("grpo", 0.0, "token", None, False), ("bnpo", 0.04, "token", 1.5, True),
              ("dr_grpo", 0.04, "sequence", None, False), ("dapo", 0.1, "token", None, True),
              ("dapo", 0.0, "sequence", 1.2, False)]


@pytest.mark.parametrize("loss_type,beta,level,delta,sampler", GRPO_CASES)
def test_grpo_matches_reference_and_trl(loss_type, beta, level, delta, sampler):
    """Loss, dL/dlogp and logged KL / clip ratios against float64 and against TRL's GRPOTrainer._compute_loss run on
    the same log-probs (its model call replaced by them); ``sampler``: vLLM's importance-sampling correction."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer

    lp, mask = _log_probs(B, T), _mask()
    old = (lp.detach() + 0.3 * torch.randn(B, T, device=DEVICE))  # ratios on both sides of the clip range
    ref = lp.detach() + 0.2 * torch.randn(B, T, device=DEVICE)
    adv = torch.randn(B, device=DEVICE)
    weights = torch.rand(B, T, device=DEVICE) + 0.5 if sampler else None
    options = {"loss_type": loss_type, "beta": beta, "epsilon_low": 0.2, "epsilon_high": 0.28, "delta": delta,
               "importance_sampling_level": level, "max_completion_length": T + 2,
               "importance_sampling_ratio": weights}
    loss, metrics = preference.grpo_loss(lp, mask, adv, old, ref, **options)
    expected = grads64(lambda x: grpo_ref(x, mask, adv, old, ref, loss_type, beta, 0.2, 0.28, level, T + 2, delta,
                                          weights), [lp], torch.tensor(1.0))

    trl_lp = lp.detach().clone().requires_grad_()
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (trl_lp, torch.zeros_like(trl_lp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        use_vllm=sampler, vllm_importance_sampling_correction=sampler, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        accelerator=_fake_accelerator(), max_completion_length=T + 2, _entropy_bonus_enabled=False,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1),
        _metrics={"train": collections.defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long, device=DEVICE),
              "prompt_mask": torch.ones(B, 2, dtype=torch.long, device=DEVICE),
              "completion_ids": torch.zeros(B, T, dtype=torch.long, device=DEVICE), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum(), "importance_sampling_ratio": weights}
    trl_loss = GRPOTrainer._compute_loss(fake, None, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, [trl_lp])
    # against float64 within TRL's own fp32 error + 1e-5: with advantages of both signs the loss can cancel (seed
    # 20261203, dr_grpo: leantune's fp32 value 9.3e-5 off float64)
    _grad_check("grpo", loss, expected, [lp], eager=(trl_loss.detach(), [trl_grad]))
    (grad,) = torch.autograd.grad(preference.grpo_loss(lp, mask, adv, old, ref, **options)[0], [lp])
    assert_close("loss vs TRL", loss, trl_loss, torch.float32)
    assert_close("grad vs TRL", grad, trl_grad, torch.float32)
    logged = fake._metrics["train"]
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"] + (["kl"] if beta else [])
    for name in names:
        assert abs(metrics[name].item() - logged[name][-1]) <= 1e-6, name


def test_grpo_through_the_head(backend):
    """hidden -> linear_log_probs (temperature) -> grpo_loss: gradients for hidden and lm_head vs float64."""
    h = torch.randn(2, 5, 16, device=DEVICE, requires_grad=True)
    w = (torch.randn(140, 16, device=DEVICE) * 0.5).requires_grad_()
    tokens = torch.randint(0, 140, (2, 5), device=DEVICE)
    mask = torch.ones(2, 5, device=DEVICE)
    mask[1, 3:] = 0
    tokens[mask == 0] = -100
    adv = torch.randn(2, device=DEVICE)
    with torch.no_grad():
        old = ops.linear_log_probs(h, w, tokens, temperature=0.9) + 0.2 * torch.randn(2, 5, device=DEVICE)
    lp = ops.linear_log_probs(h, w, tokens, temperature=0.9, chunk_bytes=4 * 140 * 4)
    loss, _ = preference.grpo_loss(lp, mask, adv, old, old, beta=0.05, loss_type="grpo")
    expected = grads64(lambda a, c: grpo_ref(log_probs_ref(a, c, tokens, temperature=0.9)[0], mask, adv, old, old,
                                             "grpo", 0.05, 0.2, 0.2), [h, w], torch.tensor(1.0))
    _grad_check("grpo through head", loss, expected, [h, w])


def _dpo_trl(loss_type, beta, c, r, rc, rr, completion_mask):
    """TRL 1.16's DPOTrainer._compute_loss with the model's fused head replaced by the given token log-probs."""
    from trl import DPOTrainer

    per_token = torch.cat([c, r]).detach().clone().requires_grad_()
    outputs = types.SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                                    mean_logits=torch.zeros_like(per_token),
                                    is_top1=torch.zeros_like(per_token, dtype=torch.bool))
    fake = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_fake_accelerator(), aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False, _tp_size=1, _total_train_tokens=0,
        _metrics={"train": collections.defaultdict(list)})
    inputs = {"input_ids": torch.zeros_like(completion_mask), "completion_mask": completion_mask,
              "attention_mask": torch.ones_like(completion_mask), "ref_chosen_logps": rc, "ref_rejected_logps": rr}
    loss = DPOTrainer._compute_loss(fake, lambda **kwargs: outputs, inputs, return_outputs=False)
    return loss, per_token


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_dpo_matches_reference_and_trl(loss_type):
    """Token log-probs [2B, T-1] of chosen then rejected, summed per sequence: loss and dL/dlogp against float64
    and against TRL's DPOTrainer._compute_loss on the same tokens."""
    pytest.importorskip("trl")
    completion_mask = (torch.rand(2 * B, T, device=DEVICE) > 0.3).long()
    completion_mask[:, -1] = 1
    shifted = completion_mask[:, 1:].float()
    per_token = (_log_probs(2 * B, T - 1).detach() * shifted).requires_grad_()
    rc, rr = -torch.rand(B, device=DEVICE) * 8, -torch.rand(B, device=DEVICE) * 8
    lengths = completion_mask.sum(1).float()  # TRL's ipo divides by the unshifted completion length
    beta = 0.1 if loss_type != "hinge" else 0.05

    def ours(x):
        seq = x.sum(1)
        lengths_of = dict(chosen_lengths=lengths[:B], rejected_lengths=lengths[B:]) if loss_type == "ipo" else {}
        return preference.dpo_loss(seq[:B], seq[B:], rc, rr, beta=beta, loss_type=loss_type, **lengths_of)[0]

    loss = ours(per_token)
    expected = grads64(lambda x: dpo_ref(x.sum(1)[:B], x.sum(1)[B:], rc, rr, beta, loss_type, 0.0, lengths[:B],
                                         lengths[B:]), [per_token], torch.tensor(1.0))
    _grad_check("dpo", loss, expected, [per_token])
    trl_loss, trl_leaf = _dpo_trl(loss_type, beta, per_token[:B], per_token[B:], rc, rr, completion_mask)
    assert_close("dpo vs TRL", loss, trl_loss, torch.float32)
    assert_close("dpo grad vs TRL", torch.autograd.grad(ours(per_token), [per_token])[0],
                 torch.autograd.grad(trl_loss, [trl_leaf])[0], torch.float32)


def test_dpo_label_smoothing_and_through_the_head(backend):
    """cDPO smoothing on sequence log-probs from sequence_log_probs (both heads: policy with grad, reference
    without), gradients into hidden and lm_head vs float64."""
    h = torch.randn(2 * 2, 4, 12, device=DEVICE, requires_grad=True)
    w = (torch.randn(130, 12, device=DEVICE) * 0.5).requires_grad_()
    tokens = torch.randint(0, 130, (4, 4), device=DEVICE)
    tokens[:, 0] = -100
    with torch.no_grad():
        ref_seq = preference.sequence_log_probs(h + 0.1, w, tokens)
    seq = preference.sequence_log_probs(h, w, tokens, chunk_bytes=3 * 130 * 4)
    loss, chosen_rewards, _ = preference.dpo_loss(seq[:2], seq[2:], ref_seq[:2], ref_seq[2:], beta=0.2,
                                                  label_smoothing=0.1)
    assert not chosen_rewards.requires_grad

    def composite(a, c):
        s = log_probs_ref(a, c, tokens)[0].sum(1)
        return dpo_ref(s[:2], s[2:], ref_seq[:2], ref_seq[2:], 0.2, "sigmoid", 0.1)

    _grad_check("cdpo through head", loss, grads64(composite, [h, w], torch.tensor(1.0)), [h, w])


def test_orpo_simpo_kto_match_reference_and_trl():
    """ORPO vs ORPOTrainer.odds_ratio_loss, SimPO vs CPOTrainer.cpo_loss, KTO vs KTOTrainer._compute_loss, all on
    the same log-probs, and each vs its float64 formula (values and gradients)."""
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    c, r = _log_probs(B), _log_probs(B)
    nll = torch.rand((), device=DEVICE) * 2
    loss, _ = preference.orpo_loss(c, r, beta=0.25, nll=nll)
    _grad_check("orpo", loss, grads64(lambda a, b: orpo_ref(a, b, 0.25, nll), [c, r], torch.tensor(1.0)), [c, r])
    fake = types.SimpleNamespace(beta=0.25, accelerator=_fake_accelerator())
    trl_losses, *_ = ORPOTrainer.odds_ratio_loss(fake, c, r)
    assert_close("orpo vs TRL", loss, nll - trl_losses.mean(), torch.float32)
    # the per-pair log odds (ORPOTrainer logs their mean as log_odds_chosen): log(p / (1 - p)) of each, in float64
    _, log_odds = preference.orpo_loss(c, r, beta=0.25)
    odds64 = torch.logit(c.detach().double().exp()) - torch.logit(r.detach().double().exp())
    assert_close("orpo log odds", log_odds, odds64, torch.float32)
    assert_close("orpo log odds vs TRL", log_odds.mean(), ORPOTrainer.odds_ratio_loss(fake, c, r)[4], torch.float32)

    loss, _, _ = preference.simpo_loss(c, r, beta=2.0, gamma=0.7, label_smoothing=0.1)
    _grad_check("simpo", loss, grads64(lambda a, b: simpo_ref(a, b, 2.0, 0.7, 0.1), [c, r], torch.tensor(1.0)),
                [c, r])
    fake = types.SimpleNamespace(alpha=0.0, beta=2.0, simpo_gamma=0.7, loss_type="simpo", label_smoothing=0.1,
                                 accelerator=_fake_accelerator())
    trl_losses, *_ = CPOTrainer.cpo_loss(fake, c, r)
    assert_close("simpo vs TRL", loss, trl_losses.mean(), torch.float32)

    _check_kto()


def _check_kto():
    from trl import KTOTrainer

    labels = torch.tensor([True, False, True, True, False], device=DEVICE)
    seq = _log_probs(5) * 4
    ref = seq.detach() + 0.5 * torch.randn(5, device=DEVICE)
    kl_lp, ref_kl = -torch.rand(5, device=DEVICE) * 4, -torch.rand(5, device=DEVICE) * 4 - 0.5
    c, r = seq[labels], seq[~labels]
    loss, kl = preference.kto_loss(c, r, ref[labels], ref[~labels], kl_lp, ref_kl, beta=0.3, desirable_weight=1.2,
                                   undesirable_weight=0.8)
    expected = grads64(lambda x: kto_ref(x[labels], x[~labels], ref[labels], ref[~labels], kl_lp, ref_kl, 0.3, 1.2,
                                         0.8), [seq], torch.tensor(1.0))
    _grad_check("kto", loss, expected, [seq])
    per_token = torch.stack([seq.detach(), torch.zeros(5, device=DEVICE)], 1).requires_grad_()  # [5, 2] tokens
    outputs = types.SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                                    mean_logits=torch.zeros_like(per_token))
    fake = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_fake_accelerator(), aux_loss_enabled=False,
        precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=0.3, desirable_weight=1.2,
        undesirable_weight=0.8, _tp_size=1, _total_train_tokens=0, _metrics={"train": collections.defaultdict(list)},
        _compute_kl_logps=lambda model, batch: kl_lp)
    batch = {"label": labels, "input_ids": torch.zeros(5, 3, dtype=torch.long, device=DEVICE),
             "completion_mask": torch.ones(5, 3, dtype=torch.long, device=DEVICE),
             "attention_mask": torch.ones(5, 3, device=DEVICE),
             "ref_logps": ref, "ref_KL_logps": ref_kl}
    trl_loss = KTOTrainer._compute_loss(fake, lambda **kwargs: outputs, batch, return_outputs=False)
    # TRL orders the losses desirable first; the mean is the same
    assert_close("kto vs TRL", loss, trl_loss, torch.float32)
    (trl_grad,) = torch.autograd.grad(trl_loss, [per_token])
    again, _ = preference.kto_loss(seq[labels], seq[~labels], ref[labels], ref[~labels], kl_lp, ref_kl, beta=0.3,
                                   desirable_weight=1.2, undesirable_weight=0.8)
    (grad,) = torch.autograd.grad(again, [seq])
    assert_close("kto grad vs TRL", grad, trl_grad[:, 0], torch.float32)
    assert abs(kl.item() - fake._metrics["train"]["kl"][-1]) <= 1e-6


def test_empty_batches_give_zero():
    lp = _log_probs(2, 3)
    loss, _ = preference.grpo_loss(lp, torch.zeros(2, 3, device=DEVICE), torch.ones(2, device=DEVICE), loss_type="grpo")
    assert loss.item() == 0.0 and (torch.autograd.grad(loss, [lp])[0] == 0).all()
    empty = _log_probs(0)
    loss, kl = preference.kto_loss(empty, empty, empty.detach(), empty.detach())
    assert loss.item() == 0.0 and kl.item() == 0.0


def test_error_cases():
    lp = _log_probs(2, 3)
    mask = torch.ones(2, 3, device=DEVICE)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        preference.grpo_loss(lp, mask, torch.ones(2, device=DEVICE), loss_type="ppo")
    with pytest.raises(ValueError, match="ref_log_probs is required"):
        preference.grpo_loss(lp, mask, torch.ones(2, device=DEVICE), beta=0.1)
    with pytest.raises(ValueError, match="advantages must be"):
        preference.grpo_loss(lp, mask, torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="mask must have shape"):
        preference.grpo_loss(lp, mask[:1], torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="importance_sampling_level"):
        preference.grpo_loss(lp, mask, torch.ones(2, device=DEVICE), importance_sampling_level="batch")
    c = _log_probs(2)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        preference.dpo_loss(c, c, c, c, loss_type="robust")
    with pytest.raises(ValueError, match="beta must be"):
        preference.dpo_loss(c, c, c, c, beta=0.0)
    with pytest.raises(ValueError, match="rejected_log_probs must have shape"):
        preference.dpo_loss(c, c[:1], c, c)
    with pytest.raises(ValueError, match="given together"):
        preference.kto_loss(c, c, c, c, kl_log_probs=c)


def test_orpo_gradient_finite_near_and_at_zero():
    """A chosen mean log-prob in (-6e-8, 0] (a confident model in fp32, or a row without valid token): the log1mexp
    branch not taken stays finite, so the gradient is the float64 one (at 0 exactly: finite, the log odds large)."""
    c = torch.tensor([-1e-8, -1.0, -3e-8], device=DEVICE, requires_grad=True)
    r = torch.tensor([-2.0, -2.0, -0.5], device=DEVICE)
    loss, _ = preference.orpo_loss(c, r, beta=0.1)
    expected = grads64(lambda a: orpo_ref(a, r, 0.1, torch.zeros(())), [c], torch.tensor(1.0))
    _grad_check("orpo near 0", loss, expected, [c])
    zero = torch.tensor([0.0, -1.0], device=DEVICE, requires_grad=True)
    loss, log_odds = preference.orpo_loss(zero, torch.tensor([-2.0, -2.0], device=DEVICE), beta=0.1)
    (grad,) = torch.autograd.grad(loss, [zero])
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(log_odds).all()
    assert log_odds[0] > 80  # log(p / (1 - p)) at p = 1 - 2^-126 and more


def test_kto_empty_kl_batch_gives_zero_baseline():
    c = _log_probs(3)
    empty = torch.zeros(0, device=DEVICE)
    loss, kl = preference.kto_loss(c, c[:0], c.detach() - 0.2, c[:0].detach(), empty, empty)
    expected, _ = preference.kto_loss(c, c[:0], c.detach() - 0.2, c[:0].detach())
    assert kl.item() == 0.0 and torch.isfinite(loss) and loss.item() == expected.item()


def test_grpo_inputs_as_trl_passes_them():
    """advantages [B, 1] as [B]; old and reference log-probs carry no gradient (TRL computes them without)."""
    lp, mask = _log_probs(B, T), _mask()
    adv = torch.randn(B, device=DEVICE)
    ref = lp.detach() - 0.1
    base = preference.grpo_loss(lp, mask, adv, ref_log_probs=ref, beta=0.04)[0]
    column = preference.grpo_loss(lp, mask, adv[:, None], ref_log_probs=ref, beta=0.04)[0]
    assert column.item() == base.item()
    (expected,) = torch.autograd.grad(base, [lp])
    with_graph = preference.grpo_loss(lp, mask, adv, old_log_probs=lp, ref_log_probs=lp * 1.0 - 0.1, beta=0.04)[0]
    (grad,) = torch.autograd.grad(with_graph, [lp])
    assert torch.equal(grad, expected)


def test_option_errors():
    lp, mask, adv = _log_probs(2, 3), torch.ones(2, 3, device=DEVICE), torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="importance_sampling_ratio must be"):
        preference.grpo_loss(lp, mask, adv, importance_sampling_ratio=torch.ones(3, device=DEVICE))
    for bad in (-5, 0, "x", 2.5, True):
        with pytest.raises(ValueError, match="num_items must be a positive int"):
            preference.grpo_loss(lp, mask, adv, num_items=bad)
        with pytest.raises(ValueError, match="max_completion_length must be a positive int"):
            preference.grpo_loss(lp, mask, adv, loss_type="dr_grpo", max_completion_length=bad)
    with pytest.raises(ValueError, match="num_items must be a positive int or a 0-dim tensor"):
        preference.grpo_loss(lp, mask, adv, num_items=torch.ones(2, device=DEVICE))
    c = _log_probs(2)
    with pytest.raises(ValueError, match="label_smoothing is the sigmoid loss's"):
        preference.dpo_loss(c, c, c, c, loss_type="hinge", label_smoothing=0.3)
    with pytest.raises(ValueError, match="normalise the ipo loss"):
        preference.dpo_loss(c, c, c, c, chosen_lengths=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="beta must be >= 0"):
        preference.orpo_loss(c, c, beta=-1.0)
    with pytest.raises(ValueError, match="nll must have shape"):
        preference.orpo_loss(c, c, nll=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="desirable_weight must be finite"):
        preference.kto_loss(c, c, c, c, desirable_weight=float("nan"))
    h, w, tokens = torch.randn(2, 3, 8, device=DEVICE), torch.randn(11, 8, device=DEVICE), torch.zeros(2, 3).long()
    with pytest.raises(ValueError, match="no entropy option"):
        preference.sequence_log_probs(h, w, tokens.to(DEVICE), entropy=True)
    with pytest.raises(ValueError, match=r"hidden must be \[B, T, H\] .*got shape \(3, 8\)"):
        preference.sequence_log_probs(h[0], w, tokens[0].to(DEVICE))


def test_shape_device_and_delta_errors_name_the_argument():
    """Per-sequence losses take ``[B]`` log-probs only; every tensor on the first one's device (meta stands in for
    another device on a CPU-only machine); GRPO's delta caps the ratio, so it must be > 0."""
    lp, mask, adv = _log_probs(2, 3), torch.ones(2, 3, device=DEVICE), torch.ones(2, device=DEVICE)
    for delta in (-1.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match="delta must be"):
            preference.grpo_loss(lp, mask, adv, delta=delta)
    assert torch.isfinite(preference.grpo_loss(lp, mask, adv, delta=0.5)[0])
    meta = torch.ones(2, 3, device="meta")
    for name, kwargs in (("mask", {"mask": meta}), ("advantages", {"advantages": meta[:, 0]}),
                         ("old_log_probs", {"old_log_probs": meta}),
                         ("ref_log_probs", {"ref_log_probs": meta, "beta": 0.1}),
                         ("importance_sampling_ratio", {"importance_sampling_ratio": meta}),
                         ("num_items", {"num_items": torch.tensor(3, device="meta")})):
        args = {"mask": mask, "advantages": adv, **kwargs}
        with pytest.raises(ValueError, match=f"{name} is on meta, .* all tensors must be on one device"):
            preference.grpo_loss(lp, **args)
    c, grid = _log_probs(2), torch.randn(2, 3, device=DEVICE)
    for loss in (lambda x: preference.simpo_loss(x, x), lambda x: preference.orpo_loss(x, x),
                 lambda x: preference.dpo_loss(x, x, x, x), lambda x: preference.kto_loss(x, c, x, c)):
        with pytest.raises(ValueError, match=r"chosen_log_probs must be \[B\] .*got shape \(2, 3\)"):
            loss(grid)
    with pytest.raises(ValueError, match=r"rejected_log_probs must be \[B\] .*got shape \(2, 3\)"):
        preference.kto_loss(c, grid, c, grid)
    off = torch.ones(2, device="meta")
    for name, call in (("rejected_log_probs", lambda: preference.simpo_loss(c, off)),
                       ("rejected_log_probs", lambda: preference.orpo_loss(c, off)),
                       ("ref_chosen_log_probs", lambda: preference.dpo_loss(c, c, off, c)),
                       ("rejected_log_probs", lambda: preference.kto_loss(c, off, c, off)),
                       ("kl_log_probs", lambda: preference.kto_loss(c, c, c, c, off, off))):
        with pytest.raises(ValueError, match=f"{name} is on meta, .* all tensors must be on one device"):
            call()

