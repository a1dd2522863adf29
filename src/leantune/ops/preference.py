r"""RL and preference losses on per-token log-probs from :func:`leantune.ops.linear_log_probs`.

Every loss here is elementwise over tokens or sequences once the log-probs exist, so it is plain torch on top of the
fused head: the [N, V] logits never exist, and autograd carries dL/dlogp back into the head's chunked backward.
Sequence log-probs come from :func:`sequence_log_probs` (sum, or mean over valid tokens, of the head's rows).

Notation: lp = policy log-probs, old = log-probs at sampling time, ref = reference model's, A = advantages, m = the
completion mask, sigma = the logistic sigmoid, and for pairs d = (lp_c - ref_c) - (lp_r - ref_r) (chosen, rejected).

GRPO (Shao et al. 2024, DeepSeekMath; loss types, clipping and k3 KL as TRL 1.16's GRPOTrainer._compute_loss):
    w = lp - old per token ("token"), or the masked mean of lp - old per sequence ("sequence", GSPO); rho = exp(w)
    rho_clip = clamp(rho, 1 - eps_low, 1 + eps_high); rho = min(rho, delta) with ``delta`` (two-sided clipping)
    l_t = -min(rho A, rho_clip A) s_t + beta kl_t,  kl_t = exp(ref - lp) - (ref - lp) - 1  (k3; Schulman 2020)
    s_t: the sampler's importance weights (vLLM correction), 1 without
    grpo:    mean_b [sum_t m l / max(1, sum_t m)]       bnpo: sum m l / max(1, sum m)
    dr_grpo: sum m l / (B L_max) (Liu et al. 2025)      dapo: sum m l / max(1, num_items) (Yu et al. 2025)
    (four of TRL 1.16's eight: its cispo, sapo, luspo and vespo are not here; under TRL its own loss runs them on
    leantune's log-probs, :mod:`leantune.integrations.trl`)
DPO (Rafailov et al. 2023): sigmoid -log sigma(beta d) (1 - eps) - log sigma(-beta d) eps (eps: cDPO smoothing);
    hinge relu(1 - beta d) (SLiC); ipo (d - 1 / (2 beta))^2 (Azar et al. 2023), each log-ratio divided by its
    sequence's token count when lengths are given (TRL 1.16's normalisation).
ORPO (Hong et al. 2024): nll - beta mean log sigma(log odds), log odds = (c - r) - (log(1 - e^c) - log(1 - e^r)) on
    mean token log-probs c, r.
SimPO (Meng et al. 2024): -log sigma(beta (c - r) - gamma) (1 - eps) - log sigma(-(beta (c - r) - gamma)) eps on mean
    token log-probs (TRL's CPOTrainer, loss_type="simpo", gamma = simpo_gamma).
KTO (Ethayarajh et al. 2024): z = clamp(mean(lp_kl - ref_kl), 0) (no gradient); desirable
    1 - sigma(beta (c - ref_c - z)), undesirable 1 - sigma(beta (z - (r - ref_r))), weighted, mean over all examples.
Distillation between two lm_heads needs both heads' logits per row: :mod:`leantune.ops.distillation`.

All losses are fp32 (inputs are upcast) and return 0.0, not NaN, for a batch without a valid token or example.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _runtime
from .log_probs import linear_log_probs

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def sequence_log_probs(hidden, weight, tokens, bias=None, *, average=False, **options):
    """Per-sequence sum (``average``: mean over valid tokens) of :func:`linear_log_probs` over the last dim.

    Args:
        hidden: ``[B, T, H]``; weight ``[V, H]``; tokens ``[B, T]`` int64 (``ignore_index`` outside the completion);
        options: temperature, ignore_index, softcap, chunk_bytes as :func:`linear_log_probs`.

    Returns:
        ``[B]`` float32, differentiable w.r.t. hidden, weight and bias. A sequence without valid token gives 0.

    Raises:
        ValueError: ``entropy`` given (per-token entropies: :func:`linear_log_probs` with ``entropy=True``), hidden
            not 3-D, and as :func:`linear_log_probs`.
    """
    if "entropy" in options:
        raise ValueError("sequence_log_probs takes no entropy option: linear_log_probs(..., entropy=True) gives the "
                         "per-token entropies")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        got = f"shape {tuple(hidden.shape)}" if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must be [B, T, H] (one sequence a row), got {got}")
    log_probs = linear_log_probs(hidden, weight, tokens, bias, **options)
    total = log_probs.sum(-1)
    if not average:
        return total
    count = (tokens != options.get("ignore_index", -100)).sum(-1).clamp_min(1)
    return total / count


def _as_float(name, t, shape=None, device=None):
    """``t`` in fp32, checked: a tensor, of ``shape`` and on ``device`` when given (the first argument's)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004 (contract)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the first log-probs on {device}: all tensors must be on one "
                         "device")
    return t.float()


def _sequences(name, t, device=None):
    """A ``[B]`` tensor of per-sequence values, on ``device`` when given (the first argument's)."""
    t = _as_float(name, t, device=device)
    if t.dim() != 1:
        raise ValueError(f"{name} must be [B] (one value per sequence), got shape {tuple(t.shape)}")
    return t


def _per_row(name, t, shape, device=None):
    """``t`` as fp32 ``[B, T]`` or ``[B, 1]`` (a ``[B]`` tensor gets the column): per-token or per-sequence values."""
    t = _as_float(name, t, device=device)
    if t.shape == shape[:1]:
        return t[:, None]
    if t.dim() == 2 and t.shape[0] == shape[0] and t.shape[1] in (1, shape[1]):
        return t
    raise ValueError(f"{name} must be [B], [B, 1] or [B, T] = {tuple(shape)}, got {tuple(t.shape)}")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def grpo_loss(log_probs, mask, advantages, old_log_probs=None, ref_log_probs=None, *, loss_type="dapo", beta=0.0,
              epsilon_low=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
              max_completion_length=None, num_items=None, bias_correction_kl=False, importance_sampling_ratio=None):
    """GRPO's clipped surrogate with four of TRL's loss types (module docstring), from policy log-probs ``[B, T]``.

    Args:
        log_probs: ``[B, T]`` policy log-probs of the completion tokens (differentiable; e.g. from
            :func:`linear_log_probs`).
        mask: ``[B, T]`` completion mask (bool or 0/1).
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        old_log_probs: ``[B, T]`` log-probs at sampling time (no gradient: detached here, as TRL computes them
            without); None: ``log_probs.detach()`` (one update per generation: ratio 1, the gradient is A's policy
            gradient).
        ref_log_probs: ``[B, T]`` reference log-probs (detached here); required when ``beta != 0``.
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"`` or ``"dapo"`` (TRL 1.16's default).
        beta: KL coefficient (k3 estimator); epsilon_low / epsilon_high: clip range [1 - low, 1 + high] (high
            defaults to low); delta: upper clamp of the unclipped ratio (two-sided clipping) or None.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO: one ratio per sequence).
        max_completion_length: L_max for ``"dr_grpo"``, a positive int (default T).
        num_items: ``"dapo"``'s divisor, a positive int or a 0-dim tensor (TRL passes the valid tokens of one
            accumulation window; a tensor's value is not read on the host: below 1 it counts as 1); default
            ``sum(mask)``.
        bias_correction_kl: multiply kl_t by the importance ratio (TRL's ``use_bias_correction_kl``).
        importance_sampling_ratio: ``[B, T]``, ``[B, 1]`` or ``[B]`` weights (no gradient) of the clipped surrogate
            before the KL term: TRL's correction for completions sampled by another engine (vLLM), pi_train /
            pi_sampler.

    Returns:
        ``(loss, metrics)``: 0-dim float32 loss, and detached masked means ``{"kl", "clip_ratio/low_mean",
        "clip_ratio/high_mean", "clip_ratio/region_mean"}`` ("kl" only with beta != 0), as TRL logs them.
        Gradient accumulation is the caller's (TRL divides grpo/bnpo/dr_grpo by the accumulation steps).

    Raises:
        ValueError: an unknown loss_type or importance_sampling_level, shapes or devices that differ from
            log_probs', ``ref_log_probs`` missing with beta != 0, negative epsilons, delta not > 0, a non-finite
            option, ``num_items`` or ``max_completion_length`` not a positive int (a tensor ``num_items`` not
            0-dim). ``num_items`` and ``max_completion_length`` are batch facts TRL hands every loss type (only
            dapo and dr_grpo read them), ``ref_log_probs`` and ``bias_correction_kl`` are read with beta != 0 only,
            as in TRL: accepted for every type and beta, so one call site serves all.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    lp = _as_float("log_probs", log_probs)
    if lp.dim() != 2:
        raise ValueError(f"log_probs must be [B, T], got shape {tuple(lp.shape)}")
    device = lp.device
    m = _as_float("mask", mask, lp.shape, device)
    adv = _per_row("advantages", advantages, lp.shape, device)
    beta = _runtime.check_real("beta", beta)
    epsilon_low = _runtime.check_real("epsilon_low", epsilon_low, low=0.0)
    epsilon_high = epsilon_low if epsilon_high is None else _runtime.check_real("epsilon_high", epsilon_high, low=0.0)
    old = lp.detach() if old_log_probs is None else _as_float("old_log_probs", old_log_probs, lp.shape,
                                                               device).detach()
    if delta is not None:
        delta = _runtime.check_real("delta", delta, low=0.0, low_open=True)
    if max_completion_length is not None:
        max_completion_length = _positive_int("max_completion_length", max_completion_length)
    if num_items is not None and not isinstance(num_items, torch.Tensor):
        num_items = _positive_int("num_items", num_items)
    elif isinstance(num_items, torch.Tensor) and num_items.dim() != 0:
        raise ValueError(f"num_items must be a positive int or a 0-dim tensor, got shape {tuple(num_items.shape)}")
    elif isinstance(num_items, torch.Tensor) and num_items.device != device:
        raise ValueError(f"num_items is on {num_items.device}, log_probs on {device}: all tensors must be on one "
                         "device")
    log_ratio = lp - old
    if importance_sampling_level == "token":
        log_weight = log_ratio
    else:
        log_weight = ((log_ratio * m).sum(-1) / m.sum(-1).clamp_min(1.0))[:, None]
    ratio = torch.exp(log_weight)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token = -torch.min(unclipped * adv, clipped * adv)
    if importance_sampling_ratio is not None:
        per_token = per_token * _per_row("importance_sampling_ratio", importance_sampling_ratio, lp.shape,
                                         device).detach()
    metrics = {}
    if beta != 0.0:
        if ref_log_probs is None:
            raise ValueError("ref_log_probs is required when beta != 0 (the KL term to the reference)")
        diff = _as_float("ref_log_probs", ref_log_probs, lp.shape, device).detach() - lp
        kl = torch.exp(diff) - diff - 1.0
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), m)
    per_token = per_token * m
    if loss_type == "grpo":
        loss = (per_token.sum(-1) / m.sum(-1).clamp_min(1.0)).mean() if lp.shape[0] else per_token.sum()
    elif loss_type == "bnpo":
        loss = per_token.sum() / m.sum().clamp_min(1.0)
    elif loss_type == "dr_grpo":
        length = lp.shape[1] if max_completion_length is None else max_completion_length
        loss = per_token.sum() / max(lp.shape[0] * length, 1)
    else:
        divisor = m.sum() if num_items is None else torch.as_tensor(num_items, dtype=torch.float32,
                                                                      device=lp.device)
        loss = per_token.sum() / divisor.clamp_min(1.0)
    ratio = unclipped.detach()  # after the delta cap, as TRL counts its clipped tokens
    low = ((ratio < 1.0 - epsilon_low) & (adv < 0)).float()
    high = ((ratio > 1.0 + epsilon_high) & (adv > 0)).float()
    shape_mask = m if low.shape == m.shape else torch.ones_like(low)
    for name, value in (("low", low), ("high", high), ("region", torch.maximum(low, high))):
        metrics[f"clip_ratio/{name}_mean"] = _masked_mean(value.expand_as(shape_mask), shape_mask)
    return loss, metrics


def _smoothed_logsigmoid_loss(x, label_smoothing):
    eps = _runtime.check_real("label_smoothing", label_smoothing, low=0.0, high=0.5, high_open=True)
    loss = -F.logsigmoid(x)
    return loss if eps == 0.0 else loss * (1.0 - eps) - F.logsigmoid(-x) * eps


def _mean(x):
    return x.mean() if x.numel() else x.sum()


def dpo_loss(chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, *, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0, chosen_lengths=None, rejected_lengths=None):
    """DPO and its sigmoid / hinge / ipo variants (module docstring) on sequence log-probs ``[B]``.

    ``chosen_lengths`` / ``rejected_lengths`` (``[B]`` token counts, ipo only): divide each log-ratio by its length
    first, as TRL 1.16 does (a length below 1 counts as 1: the values stay on the device, unchecked).
    ``label_smoothing`` in [0, 0.5), sigmoid only: the conservative (cDPO, Mitchell 2023) sigmoid loss. TRL
    1.16's ``sigmoid`` has no smoothing (its ``label_smoothing`` serves its robust, EXO and AOT losses): with 0 (the
    default) the two are the same loss.

    Returns:
        ``(loss, chosen_rewards, rejected_rewards)``: 0-dim mean loss; ``beta * (lp - ref)`` per pair, detached.

    Raises:
        ValueError: an unknown loss_type, beta not > 0, shapes other than ``[B]``, and an option the loss type does
            not read (label_smoothing other than 0 with hinge or ipo, lengths with sigmoid or hinge).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    beta = _runtime.check_real("beta", beta, low=0.0, low_open=True)
    if loss_type != "sigmoid" and label_smoothing != 0.0:
        raise ValueError(f"label_smoothing is the sigmoid loss's (cDPO); loss_type {loss_type!r} takes none, got "
                         f"{label_smoothing!r}")
    if loss_type != "ipo" and (chosen_lengths is not None or rejected_lengths is not None):
        raise ValueError(f"chosen_lengths / rejected_lengths normalise the ipo loss; loss_type {loss_type!r} takes "
                         "none")
    chosen = _sequences("chosen_log_probs", chosen_log_probs)
    rows, device = chosen.shape, chosen.device
    rejected = _as_float("rejected_log_probs", rejected_log_probs, rows, device)
    chosen_ratio = chosen - _as_float("ref_chosen_log_probs", ref_chosen_log_probs, rows, device)
    rejected_ratio = rejected - _as_float("ref_rejected_log_probs", ref_rejected_log_probs, rows, device)
    if loss_type == "sigmoid":
        losses = _smoothed_logsigmoid_loss(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * (chosen_ratio - rejected_ratio))
    else:
        c, r = chosen_ratio, rejected_ratio
        if chosen_lengths is not None:
            c = c / _as_float("chosen_lengths", chosen_lengths, rows, device).clamp_min(1.0)
        if rejected_lengths is not None:
            r = r / _as_float("rejected_lengths", rejected_lengths, rows, device).clamp_min(1.0)
        losses = (c - r - 1.0 / (2.0 * beta)) ** 2
    return _mean(losses), beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def _log1mexp(x):
    """log(1 - e^x) for x < 0 without cancellation (Maechler 2012: branch at -log 2). Each branch reads a safe input
    where the other is taken (torch.where's gradient is 0 * the untaken branch's, NaN if that is infinite), and x is
    clamped to at most -tiny: a mean log-prob of exactly 0 (every token at probability 1 in fp32, or a row without
    a valid token) gives a large finite log odds and a finite gradient instead of inf and NaN."""
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    far = x < -math.log(2.0)
    return torch.where(far, torch.log1p(-torch.exp(torch.where(far, x, -1.0))),
                       torch.log(-torch.expm1(torch.where(far, -0.5, x))))


def orpo_loss(chosen_log_probs, rejected_log_probs, *, beta=0.1, nll=None):
    """ORPO (module docstring) on mean token log-probs ``[B]`` (:func:`sequence_log_probs` with average=True).

    ``nll``: the chosen responses' token-mean NLL (0-dim; e.g. minus the mean of their token log-probs), added to
    the odds-ratio term; None leaves it out. ``beta`` >= 0 (ORPO's lambda).

    Returns:
        ``(loss, log_odds)``: 0-dim loss and the per-pair log odds ratio (detached).

    Raises:
        ValueError: beta negative or not finite, log-probs not ``[B]`` of one shape, ``nll`` not 0-dim.
    """
    beta = _runtime.check_real("beta", beta, low=0.0)
    c = _sequences("chosen_log_probs", chosen_log_probs)
    r = _as_float("rejected_log_probs", rejected_log_probs, c.shape, c.device)
    if nll is not None:
        nll = _as_float("nll", nll, (), c.device)
    log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
    loss = -beta * _mean(F.logsigmoid(log_odds))
    if nll is not None:
        loss = loss + nll
    return loss, log_odds.detach()


def simpo_loss(chosen_log_probs, rejected_log_probs, *, beta=2.0, gamma=0.5, label_smoothing=0.0):
    """SimPO (module docstring) on mean token log-probs ``[B]``; ``gamma`` is the target reward margin (TRL's
    ``simpo_gamma``). Returns ``(loss, chosen_rewards, rejected_rewards)`` with rewards ``beta * logp`` detached.

    Raises:
        ValueError: beta not > 0, gamma or label_smoothing out of range, log-probs not ``[B]`` of one shape and
            device."""
    beta = _runtime.check_real("beta", beta, low=0.0, low_open=True)
    gamma = _runtime.check_real("gamma", gamma)
    c = _sequences("chosen_log_probs", chosen_log_probs)
    r = _as_float("rejected_log_probs", rejected_log_probs, c.shape, c.device)
    losses = _smoothed_logsigmoid_loss(beta * (c - r) - gamma, label_smoothing)
    return _mean(losses), beta * c.detach(), beta * r.detach()


def kto_loss(chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs,
             kl_log_probs=None, ref_kl_log_probs=None, *, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0):
    """KTO (module docstring) on sequence log-probs: ``[Bc]`` desirable and ``[Br]`` undesirable examples (either may
    be empty), and the KL batch's ``[Bk]`` (mismatched prompt/completion pairs); without them the KL baseline is 0.

    Returns:
        ``(loss, kl)``: 0-dim mean over all Bc + Br weighted losses (0.0 when both are empty) and the clamped KL
        baseline z (detached; 0 for an empty KL batch).

    Raises:
        ValueError: beta not > 0, a weight negative or not finite, log-probs not 1-D, mismatched shapes or
            devices, one of the KL pair missing.
    """
    beta = _runtime.check_real("beta", beta, low=0.0, low_open=True)
    desirable_weight = _runtime.check_real("desirable_weight", desirable_weight, low=0.0)
    undesirable_weight = _runtime.check_real("undesirable_weight", undesirable_weight, low=0.0)
    c = _sequences("chosen_log_probs", chosen_log_probs)
    device = c.device
    r = _sequences("rejected_log_probs", rejected_log_probs, device)
    c_ratio = c - _as_float("ref_chosen_log_probs", ref_chosen_log_probs, c.shape, device)
    r_ratio = r - _as_float("ref_rejected_log_probs", ref_rejected_log_probs, r.shape, device)
    if (kl_log_probs is None) != (ref_kl_log_probs is None):
        raise ValueError("kl_log_probs and ref_kl_log_probs must be given together")
    kl = torch.zeros((), dtype=torch.float32, device=c.device)
    if kl_log_probs is not None:  # an empty KL batch keeps the baseline 0 (the mean of nothing is NaN)
        kl_policy = _sequences("kl_log_probs", kl_log_probs, device)
        kl_ref = _as_float("ref_kl_log_probs", ref_kl_log_probs, kl_policy.shape, device)
        if kl_policy.numel():
            kl = (kl_policy - kl_ref).mean().detach().clamp_min(0.0)
    losses = torch.cat([desirable_weight * (1.0 - torch.sigmoid(beta * (c_ratio - kl))),
                        undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - r_ratio)))])
    return _mean(losses), kl
