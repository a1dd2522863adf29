r"""TRL's ORPOTrainer and CPOTrainer (``trl.experimental``) through leantune's loss head: the route
:func:`leantune.integrations.trl.patch_trainer` takes for them.

TRL's seam (read in trl 1.16, ``trl/experimental/orpo/orpo_trainer.py`` and ``cpo/cpo_trainer.py``): neither trainer
has a fused head. Their ``concatenated_forward(model, batch)`` stacks the chosen and rejected rows ([2B, S], chosen
first), calls ``model(input_ids, attention_mask=..., use_cache=False)`` for the full logits z [2B, S, V] and returns
``(chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll)``, with, for labels y (``concatenated_labels``:
the input ids, -100 on the prompt and padding) and per-token log-probs lp_t(y) = log softmax(z_t)[y_{t+1}]:

    logps_b  = sum_t m_bt lp_bt(y) / sum_t m_bt   (m = y_{t+1} != -100; ORPO, and CPO's ipo / simpo: the mean;
                                                   other CPO losses: the sum, no division)
    ORPO nll = mean over chosen rows and attended t of -lp_t(x), x = the input ids where attention_mask = 1
               (prompt included, Hong et al. 2024's SFT term)
    CPO  nll = mean over chosen rows and labelled t of -lp_t(y), or 0 when cpo_alpha = 0
    logits/chosen, logits/rejected (metrics) = mean of z over the chosen / rejected rows' positions 0 .. S-2
               (ORPO) or 0 .. S-1 (CPO), padding included

and ``get_batch_loss_metrics`` forms ORPO's ``nll - mean(beta log sigma(log odds))`` (``odds_ratio_loss``) or CPO's
``mean(cpo_loss) + cpo_alpha nll``, and logs rewards (beta logps), log-probs, mean logits, the NLL and (ORPO) the
log odds.

Here (:func:`take_pair_head`): :class:`~leantune.integrations.trl.FusedLMHead` goes on the transformers model (the
statistic ``mean_logits`` kept at every row, as these metrics average every position), and the trainer gets two
instance methods. ``concatenated_forward`` (:class:`PairForward`) calls the model as TRL does, through its wrappers
(PEFT, DDP), with ``fused_lm_head=True`` and one target per position, so one ``ops.linear_cross_entropy`` call
(no [2B S, V] logits) gives every log-prob above; it returns TRL's tuple with the ``[B, S']`` per-row mean logits in
place of the logits (every row has V entries, so their mean is the logits' mean). ``get_batch_loss_metrics``
(:func:`pair_batch_loss_metrics`) takes ORPO's loss from ``ops.preference.orpo_loss`` and CPO's from TRL's own
``cpo_loss`` (elementwise on [B]: all its loss types and AlphaPO), and logs TRL's metrics as 0-dim device tensors
(TRL reads each back with ``.item()``, a host sync per metric and step; TRL's ``log`` averages them at the logging
step all the same). CPO's targets are y everywhere (its NLL is over the labelled tokens).

One target per position: ORPO's chosen rows are scored on x (the NLL's targets), the rejected rows on y, and the
chosen log-prob means read x's log-probs at y's positions. That is exact when y_t = x_t wherever y_t != -100, which
TRL's ``tokenize_row`` and ``DPODataCollatorWithPadding`` always give (labels are copies of the input ids, the
prompt and padding set to -100, on attended tokens). A batch that breaks it (another collator) gets a NaN loss, and
the next logging step raises a ValueError that says why (checked on the device: no host sync in the step).

TRL's own code runs for an encoder-decoder model, MoE router logits (``output_router_logits``: the aux loss needs
the model's own forward) or a subclass that overrides a method this route stands in for (:data:`REPLACED`); the
route is then not taken and ``loss_runs`` says why. It also runs, counted in the
head's ``passed`` and so in ``loss_runs``, for each batch the head does not serve (the model unpatched by
``leantune.unpatch``, an ``lm_head`` that is not a plain ``nn.Linear``).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from ..ops import preference
from ..patch._model import hf_model
from ..patch.forwards import is_leantune_forward

IGNORE_INDEX = -100  # TRL's label padding in these trainers


# the methods this route stands in for (or, for cpo_loss, calls): a subclass that overrides one keeps TRL's code
REPLACED = {"orpo": ("concatenated_forward", "get_batch_loss_metrics", "get_batch_logps", "odds_ratio_loss"),
            "cpo": ("concatenated_forward", "get_batch_loss_metrics", "get_batch_logps")}


def _pair_class(trainer):
    """``("orpo" | "cpo", TRL's class)`` for an ORPOTrainer / CPOTrainer (``trl.experimental``), else None."""
    kinds = {"orpo": ("trl.experimental.orpo", "ORPOTrainer"), "cpo": ("trl.experimental.cpo", "CPOTrainer")}
    for kind, (module, name) in kinds.items():
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):  # a TRL without trl.experimental
            continue
        if isinstance(trainer, cls):
            return kind, cls
    return None


def pair_trainer_kind(trainer) -> str | None:
    """``"orpo"`` or ``"cpo"`` for TRL's ORPOTrainer / CPOTrainer (``trl.experimental``, or a subclass), else None."""
    found = _pair_class(trainer)
    return None if found is None else found[0]


def take_pair_head(trainer, kind: str, metrics: bool, head_type) -> str:
    """Install ``head_type`` (:class:`~leantune.integrations.trl.FusedLMHead`) on the trainer's transformers model
    and the trainer's instance methods (module docstring); returns ``"leantune"`` or why TRL's code is kept."""
    name = type(trainer).__name__
    base = _pair_class(trainer)[1]
    overridden = [m for m in REPLACED[kind] if getattr(type(trainer), m) is not getattr(base, m)]
    if overridden:
        return f"TRL's concatenated_forward kept: {name} overrides {', '.join(overridden)}"
    if getattr(trainer, "is_encoder_decoder", False):
        return f"TRL's concatenated_forward kept: {name} of an encoder-decoder model (leantune patches causal LMs)"
    if getattr(trainer, "aux_loss_enabled", False):
        return f"TRL's concatenated_forward kept: {name} with output_router_logits (the aux loss is the model's own)"
    hf = hf_model(trainer.model)
    forward = hf.__dict__.get("forward")
    if forward is not None and not is_leantune_forward(forward):
        return f"TRL's concatenated_forward kept: {type(hf).__name__} has an instance forward {forward!r}"
    previous = forward if forward is not None else types.MethodType(type(hf).forward, hf)
    head = head_type(hf, previous, ("log_probs", "mean_logits"), metrics)
    head.masked_statistics = False
    head.fallback = "TRL's own full-logits concatenated_forward"
    loss = "ops.preference.orpo_loss" if kind == "orpo" else "TRL's cpo_loss"
    head.leantune_loss = (f"ops.linear_cross_entropy per token ({name}'s concatenated_forward: its log-probs and NLL "
                          f"from one call) + {loss}, leantune.integrations.trl")
    hf.forward = head
    trainer.concatenated_forward = PairForward(trainer, kind, head)
    trainer.get_batch_loss_metrics = types.MethodType(pair_batch_loss_metrics, trainer)
    return "leantune"


class PairForward:
    """The instance ``concatenated_forward`` of an ORPOTrainer or CPOTrainer (module docstring): TRL's return tuple
    from leantune's head, or TRL's own method where the head does not serve.

    Attributes: trainer; kind (``"orpo"`` or ``"cpo"``); head (the model's FusedLMHead)."""

    def __init__(self, trainer, kind: str, head):
        self.trainer, self.kind, self.head = trainer, kind, head

    def serves(self) -> bool:
        """Whether leantune's head computes this batch (else TRL's method runs)."""
        return self.head._serves() and not getattr(self.trainer, "aux_loss_enabled", False)

    def __call__(self, model, batch):
        trainer = self.trainer
        if not self.serves():
            self.head.passed += 1
            return type(trainer).concatenated_forward(trainer, model, batch)
        joined = trainer.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=self._padding_value(),
                                             device=trainer.accelerator.device)
        input_ids, attention = joined["concatenated_input_ids"], joined["concatenated_attention_mask"]
        labels = joined["concatenated_labels"]
        n_chosen = batch["chosen_labels"].shape[0]
        targets = _next(labels)  # [2B, S]: position t scores token t + 1, nothing at the last
        labelled = targets != IGNORE_INDEX
        chosen = torch.arange(targets.shape[0], device=targets.device)[:, None] < n_chosen
        if self.kind == "orpo":  # the chosen rows on the NLL's targets: every attended next token
            sequence = _next(torch.where(attention == 1, input_ids, IGNORE_INDEX))
            self._check_labels(targets, sequence, labelled & chosen)
            targets = torch.where(chosen, sequence, targets)
        out = model(input_ids, attention_mask=attention, use_cache=False, shift_labels=targets, fused_lm_head=True)
        log_probs = out.log_probs  # [2B, S] fp32, 0 at ignored positions
        # TRL's get_batch_logps: mean or sum over the labelled tokens (a row without one: 0 / 0, NaN, as TRL's)
        logps = (log_probs * labelled).sum(-1)
        if self.kind == "orpo" or trainer.loss_type in ("ipo", "simpo"):
            logps = logps / labelled.sum(-1)
        nll = self._nll(log_probs[:n_chosen], out.label_mask[:n_chosen] if self.kind == "orpo"
                        else labelled[:n_chosen])
        mean_logits = out.mean_logits if self.kind == "cpo" else out.mean_logits[:, :-1]  # ORPO drops position S-1
        if self.head.label_mismatch is not None:
            logps = logps + torch.where(self.head.label_mismatch, float("nan"), 0.0)
        return logps[:n_chosen], logps[n_chosen:], mean_logits[:n_chosen], mean_logits[n_chosen:], nll

    def _padding_value(self):
        trainer = self.trainer
        return trainer.padding_value if self.kind == "orpo" else trainer.pad_token_id

    def _nll(self, log_probs, mask):
        """TRL's nn.CrossEntropyLoss() mean over ``mask`` (no valid token: 0 / 0, NaN, as torch's)."""
        if self.kind == "cpo" and self.trainer.cpo_alpha == 0:
            # TRL's torch.tensor(0.0).to(device) waits on the device's queue (a host copy): the same 0.0 made there
            return torch.zeros((), device=self.trainer.accelerator.device)
        return -(log_probs * mask).sum() / mask.sum()

    def _check_labels(self, labels, sequence, where):
        """Record on the device whether a labelled chosen token differs from its input id (module docstring)."""
        bad = (where & (labels != sequence)).any()
        flag = self.head.label_mismatch
        self.head.label_mismatch = bad if flag is None else flag | bad

    def raise_if_mismatched(self) -> None:
        """ValueError when a batch since the last call broke the one-target assumption (a host read: call it
        where the host waits anyway, at logging)."""
        flag = self.head.label_mismatch
        if flag is not None and bool(flag):
            self.head.label_mismatch = None
            raise ValueError(f"{type(self.trainer).__name__} batch: a labelled token (chosen_labels != -100) is not "
                             "the attended input id at its position; leantune's ORPO head scores one target per "
                             "position, which TRL's tokenize_row and DPODataCollatorWithPadding guarantee. Use that "
                             "collator, or leantune.patch(trainer.model) alone (TRL's full-logits loss)")


def _next(tokens):
    """``tokens [R, S]`` shifted left by one, -100 at the last position: the target each position scores."""
    return F.pad(tokens[:, 1:], (0, 1), value=IGNORE_INDEX)


def pair_batch_loss_metrics(self, model, batch, train_eval="train"):
    """ORPOTrainer's / CPOTrainer's ``get_batch_loss_metrics`` on :class:`PairForward`'s output, with TRL's metrics
    as detached 0-dim tensors (no ``.item()``); TRL's method where leantune's head does not serve.

    ORPO's loss is ``ops.preference.orpo_loss`` (Hong et al. 2024, eqs. 4-7: ``nll - beta mean log sigma(log
    odds)``), CPO's TRL's ``mean(cpo_loss) + cpo_alpha nll`` (Xu et al. 2024; SimPO, AlphaPO as TRL's)."""
    forward = self.concatenated_forward
    if not isinstance(forward, PairForward) or not forward.serves():
        return type(self).get_batch_loss_metrics(self, model, batch, train_eval)
    chosen, rejected, chosen_logits, rejected_logits, nll = forward(model, batch)
    if forward.kind == "orpo":
        loss, log_odds = preference.orpo_loss(chosen, rejected, beta=self.beta, nll=nll)
        chosen_rewards, rejected_rewards = self.beta * chosen.float().detach(), self.beta * rejected.float().detach()
    else:
        losses, chosen_rewards, rejected_rewards = self.cpo_loss(chosen, rejected)
        loss = losses.mean() + self.cpo_alpha * nll
    gather = self.accelerator.gather_for_metrics
    metrics = {
        "rewards/chosen": gather(chosen_rewards).mean(),
        "rewards/rejected": gather(rejected_rewards).mean(),
        "rewards/accuracies": gather((chosen_rewards > rejected_rewards).float()).mean(),
        "rewards/margins": gather(chosen_rewards - rejected_rewards).mean(),
        "logps/rejected": gather(rejected).detach().mean(),
        "logps/chosen": gather(chosen).detach().mean(),
        # metrics=False: zeros from the head, left out of the logs by patch_trainer (TRL's prediction_step reads them)
        "logits/rejected": gather(rejected_logits.mean()).mean(),
        "logits/chosen": gather(chosen_logits.mean()).mean(),
        "nll_loss": gather(nll).detach().mean(),
    }
    if forward.kind == "orpo":
        metrics["log_odds_ratio"] = gather(F.logsigmoid(log_odds).mean()).mean()
        metrics["log_odds_chosen"] = gather(log_odds.mean()).mean()
    prefix = "eval_" if train_eval == "eval" else ""
    return loss, {prefix + key: value.detach() for key, value in metrics.items()}


__all__ = ["PairForward", "pair_batch_loss_metrics", "pair_trainer_kind", "take_pair_head"]
