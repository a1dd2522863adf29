"""TRL's SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer, ORPOTrainer and CPOTrainer with leantune's
loss head: ``patch_trainer(trainer)`` after building the trainer.

Design: docs/design.md, "TRL's trainers" (and "Patch seams" for the wrappers and ``unpatch``).

TRL's seam (read in trl 1.16, ``trl/trainer/utils.py``, ``add_fused_lm_head``): from 1.15 on, both trainers replace
the transformers model's instance ``forward`` with a wrapper. Called with ``fused_lm_head=True`` (every training and
evaluation loss of SFTTrainer and DPOTrainer, and DPO's reference pass), it runs the backbone and then TRL's own
chunked log-prob function on ``lm_head``, returning a ``FusedCausalLMOutput``: per next-token label (``-100``
ignored, zero there) ``log_probs`` with gradient, and the statistics the trainer asked for (``entropy``, ``is_top1``,
``mean_logits``, ``log_sum_sq_probs``), plus ``label_mask`` and ``loss``. Any other call goes to the forward it
replaced. So leantune's patched causal-LM forward is never called in training, and the loss is TRL's.

:func:`patch_trainer` puts :class:`FusedLMHead` in front of TRL's wrapper (on ``trainer.model`` and a separate
``trainer.ref_model``) and patches the model (:func:`leantune.patch`). While the model is patched with the loss kind
on, ``fused_lm_head=True`` calls run the backbone (leantune's layers) and then

    log_probs[t] = -loss_row[t] of ops.linear_cross_entropy(hidden, lm_head.weight, labels, lm_head.bias,
                                                             softcap=..., reduction="none", checks="deferred")

which is log softmax(z)[label] for z = softcap * tanh((h W^T + b) / softcap) (no softcap: z = h W^T + b), without
[tokens, vocab] logits kept for backward. TRL's trainers then reduce it as they do for their own head:
SFT ``loss_type="nll"``: sum(-log_probs) / num_items_in_batch (the label count when not given); ``loss_type="dft"``:
the same with each term weighted by exp(log_probs) detached, a per-token weight applied to these log-probs, so it
runs on leantune's head too; DPO: per-sequence sums of the chosen/rejected rows' log_probs. Packing, padding-free
rows (``position_ids`` restarting per document), completion-only masks and gradient accumulation reach this head
only as labels, positions and ``num_items_in_batch``, which it takes as TRL's head does.

The statistics (entropy, top-1 agreement, mean logit, log sum p^2) are for logging only (TRL detaches or never
differentiates them): the same op call returns them (``statistics=``), read from each logits chunk right after its
loss, one more pass over the chunk and no extra matmul. ``metrics=False`` skips that pass and leaves those metrics
out of the trainer's logs (not zeros); ``log_sum_sq_probs``, which DPO's ``use_weighting`` reads in its loss, is
computed either way.

GRPOTrainer (policy and a separate reference model): its ``fused_lm_head=True`` calls (TRL's
``_get_per_token_logps_and_entropies``, with and without gradient) are served by ``ops.linear_log_probs`` at TRL's
temperature: log softmax(z / T)[label] per target row, and the entropy of softmax(z / T), differentiable, for
TRL's entropy metric, high-entropy token mask and entropy bonus. RLOOTrainer makes the same calls (log-probs at
its temperature, the entropy for its metric) and gets the same head. KTOTrainer's calls (temperature 1: the
policy's and reference's per-sequence log-prob sums and its KL term; entropy, detached, and mean logits for its
metrics) are served as DPO's. ORPOTrainer and CPOTrainer (``trl.experimental``) have no fused head: their
``concatenated_forward`` reads the model's full logits; :mod:`.trl_preference` replaces it (and their
``get_batch_loss_metrics``) on the trainer with one that makes a ``fused_lm_head=True`` call to this head (ORPO's loss
from ``ops.preference.orpo_loss``).

TRL's head is kept (its calls pass through) where leantune's cannot give the same numbers: a trainer other than
SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer, ORPOTrainer or CPOTrainer, for SFT/DPO/KTO a
temperature other than 1, a logit scale other than 1, ``cast_lm_head_to_fp32``, an ``lm_head`` that is not a
plain ``nn.Linear`` (LoRA on it, hooks, FSDP2's sharded weight), MoE router logits of a config without
``num_experts`` / ``num_experts_per_tok``, or a model that is not patched (``leantune.unpatch`` after this call
gives TRL's head back, a later ``leantune.patch`` takes it again); the summary's ``loss_runs`` says which. With
router logits asked for (TRL's SFTTrainer does for a ``router_aux_loss_coef`` above 0), leantune's head returns
the load-balancing ``aux_loss`` as TRL's head computes it (Mixtral's ``load_balancing_loss_func``).
:func:`loss_head_calls` counts the calls served.

TRL 1.14 and earlier have no fused head: their SFTTrainer reads ``outputs.logits`` in training. For a trainer whose
model has none, :func:`patch_trainer` makes the patched forward form the logits in training too (the loss still
from the fused op); without this function, ``leantune.patch(model, loss=False)`` is the choice for such clients,
and after a bare patch the logits such a TRL trainer reads in training are a stand-in whose use raises a TypeError
naming both fixes (:mod:`leantune.patch.missing_logits`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from torch import nn

from .. import ops
from ..heap import long_lived_frozen
from ..patch import patch
from ..patch._model import hf_model, instance_forward
from ..patch.forwards import STATE_ATTR, causal_lm_forward
from ..patch.lora_status import has_hooks
from .trl_preference import PairForward, pair_trainer_kind, take_pair_head

IGNORE_INDEX = -100  # TRL's label for "no target", fixed in its fused head
STATS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
LOSS_STATS = ("log_sum_sq_probs",)  # read by a loss (DPO's use_weighting), so computed even with metrics off
# the trainers' logged metrics each statistic feeds (left out of the logs when it is not computed)
LOGGED_FROM = {"entropy": ("entropy",), "is_top1": ("mean_token_accuracy",),
               "mean_logits": ("logits/chosen", "logits/rejected")}


class FusedLMHead:
    """The instance ``forward`` of a transformers causal LM under a TRL trainer: ``fused_lm_head=True`` calls served by
    ``ops.linear_cross_entropy`` while the model is patched (see the module docstring), everything else as before.

    Attributes:
        model: the transformers causal LM.
        previous: the forward it stands in front of (TRL's fused-head wrapper).
        outputs: the per-token fields TRL asked its head for (``log_probs`` always).
        metrics: whether the statistics are computed (else zeros).
        calls: how many ``fused_lm_head=True`` calls leantune's head served.
        passed: how many ``fused_lm_head=True`` calls went on to the forward behind it (TRL's chunked head), or
            (``fallback`` set: ORPO, CPO) batches that TRL's own code computed instead.
        masked_statistics: statistics 0 at ignored rows, as TRL's head returns them; False keeps them at every row
            (ORPO's and CPO's mean-logit metrics average every position, padding included).
        label_mismatch: None, or a 0-dim bool tensor that a route sets on the device when a batch broke its
            assumption (ORPO's: :mod:`.trl_preference`); raised at the next logging step.
    """

    leantune_loss = "ops.linear_cross_entropy per token (TRL's fused_lm_head calls, leantune.integrations.trl)"
    fallback = "TRL's chunked head"
    masked_statistics = True
    label_mismatch = None

    def __init__(self, model: nn.Module, previous, outputs: tuple[str, ...], metrics: bool = True,
                 temperature: float | None = None):
        self.model, self.previous, self.outputs, self.metrics = model, previous, tuple(outputs), metrics
        self.temperature = temperature  # set: GRPO's head (ops.linear_log_probs at that temperature)
        self.calls = self.passed = 0
        self.passed_why: str | None = None  # the last call passed on: why

    def leantune_runs(self, configured: str) -> str:
        """The summary's ``loss_runs`` (``leantune.patch.PatchSummary``): ``configured`` and which head ran how
        often, and why the last call passed to TRL's head did."""
        why = f" (last one: {self.passed_why})" if self.passed and self.passed_why else ""
        return (f"{configured}; ran so far: leantune's head {self.calls} fused_lm_head calls, {self.fallback} "
                f"{self.passed}{why}")

    @property
    def __signature__(self):  # transformers' generate checks its keyword arguments against the forward's
        return inspect.signature(self.previous)

    def __repr__(self):
        return f"<leantune FusedLMHead of {type(self.model).__name__}, {self.calls} calls>"

    def computes(self, name: str) -> bool:
        """Whether statistic ``name`` is computed (asked for by TRL, and metrics on or a loss reads it)."""
        return name in self.outputs and (self.metrics or name in LOSS_STATS)

    def _serves(self) -> bool:
        state = self.model.__dict__.get(STATE_ATTR)
        head = self.model.get_output_embeddings()
        return (state is not None and state.kind == "causal_lm" and state.loss and type(head) is nn.Linear
                and not has_hooks(head) and type(head.weight.data) is torch.Tensor)  # not FSDP2's DTensor

    def __call__(self, *args, fused_lm_head: bool = False, **kwargs):
        served = self._serves()
        if not served or (kwargs.get("output_router_logits") and not _router_aux_loss_ok(self.model)):
            if not fused_lm_head:  # the forward behind may be a model's own (ORPO, CPO): no TRL keyword for it
                return self.previous(*args, **kwargs)
            self.passed += 1
            self.passed_why = ("the model is not patched for its loss, or its lm_head is not a plain unhooked "
                               "nn.Linear" if not served else
                               "MoE router logits asked for (output_router_logits: TRL turns it on for a "
                               "router_aux_loss_coef above 0) of a model without num_experts and "
                               "num_experts_per_tok in its config")
            return self.previous(*args, fused_lm_head=True, **kwargs)
        if not fused_lm_head:
            return causal_lm_forward(self.model, *args, **kwargs)
        return self._fused(*args, **kwargs)

    def _fused(self, *args, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        from trl.trainer.utils import FusedCausalLMOutput

        model = self.model
        kwargs["use_cache"] = False
        backbone = getattr(model, model.base_model_prefix)(*args, **kwargs)
        hidden = backbone.last_hidden_state
        if shift_labels is None:  # TRL's convention: position t scores label t + 1, so S - 1 positions
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = model.get_output_embeddings()
        hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
        mask = labels != IGNORE_INDEX
        family = model.__dict__[STATE_ATTR].family
        softcap = getattr(model.config, family.final_softcap_attr, None) if family.final_softcap_attr else None
        wanted = tuple(name for name in STATS if self.computes(name))
        # every position goes to the op, the ignored ones with loss 0 and zero gradient: selecting the labelled rows
        # (hidden[mask]) has a data-dependent size, a host sync each step; the price is the head's matmuls on the
        # ignored rows too (docs/design.md, "No host sync in a step")
        nll, found = self._rows(hidden.reshape(-1, hidden.shape[-1]), head, labels.reshape(-1), softcap, wanted)
        self.calls += 1
        # the op's loss is exactly 0 at ignored rows, and the result stays connected to the graph (an all-ignored
        # micro-batch: a zero with a gradient), as TRL's
        log_probs = (0.0 - nll).reshape(mask.shape)  # 0 - 0 is +0 at ignored rows, as TRL's zeros (-0 would not be)
        stats = dict.fromkeys(STATS)
        for name in (name for name in STATS if name in self.outputs):
            kept = found.get(name)
            if kept is not None and self.masked_statistics:
                kept = torch.where(mask, kept.reshape(mask.shape), False if name == "is_top1" else 0.0)
            stats[name] = (kept.reshape(mask.shape) if kept is not None else
                           torch.zeros(mask.shape, dtype=torch.bool if name == "is_top1" else torch.float32,
                                       device=mask.device))
        divisor = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss, aux_loss = -log_probs.sum() / divisor, None
        if kwargs.get("output_router_logits"):  # a MoE's load-balancing loss, as TRL's head adds it (trl 1.16)
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            text_config = model.config.get_text_config()
            aux_loss = load_balancing_loss_func(backbone.router_logits, text_config.num_experts,
                                                text_config.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, label_mask=mask, aux_loss=aux_loss, **stats)

    def _rows(self, rows, head, targets, softcap, wanted):
        """(-log p of each target row, {statistic: [rows]}) from leantune's head: ops.linear_cross_entropy with its
        statistics (SFT, DPO), or ops.linear_log_probs at TRL's temperature with the entropy (GRPO)."""
        if self.temperature is None:
            out = ops.linear_cross_entropy(rows, head.weight, targets, head.bias, softcap=softcap, reduction="none",
                                           ignore_index=IGNORE_INDEX, statistics=wanted, checks="deferred")
            return out if wanted else (out, {})
        with_entropy = "entropy" in wanted
        out = ops.linear_log_probs(rows, head.weight, targets, head.bias, temperature=self.temperature,
                                   softcap=softcap, entropy=with_entropy, ignore_index=IGNORE_INDEX, checks="deferred")
        log_probs, entropy = out if with_entropy else (out, None)
        return -log_probs, ({"entropy": entropy} if with_entropy else {})


def _router_aux_loss_ok(model) -> bool:
    """Whether leantune's head can add ``model``'s MoE load-balancing loss as TRL's head does (its text config names
    ``num_experts`` and ``num_experts_per_tok``)."""
    text_config = model.config.get_text_config()
    return all(isinstance(getattr(text_config, name, None), int) for name in ("num_experts", "num_experts_per_tok"))


def _trl_head_settings(forward) -> dict | None:
    """The settings TRL's ``add_fused_lm_head`` closed over in ``forward`` (its wrapper), or None when ``forward`` is
    not that wrapper."""
    func = getattr(forward, "__func__", None)
    code = getattr(func, "__code__", None)
    # functools.wraps gave the wrapper the model forward's name and module: its code object still has TRL's
    if code is None or code.co_name != "_fused_forward" or not func.__globals__.get("__name__", "").startswith("trl."):
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
    return cells if "original_forward" in cells else None


def _why_not_served(settings: dict) -> str | None:
    if settings.get("temperature", 1.0) != 1.0:
        return f"temperature {settings['temperature']} (leantune's head scores at temperature 1)"
    if settings.get("logit_scale", 1.0) != 1.0:
        return f"logit scale {settings['logit_scale']} (leantune's head has none)"
    if settings.get("cast_lm_head_to_fp32"):
        return "cast_lm_head_to_fp32 (leantune's head runs in the model's dtype)"
    return None


def _take_head(model, metrics: bool, trainer) -> str:
    """Install :class:`FusedLMHead` on ``model``'s transformers model; returns what its loss head is now."""
    hf = hf_model(model)
    forward = hf.__dict__.get("forward")
    if isinstance(forward, FusedLMHead):
        # GRPO's token mask and entropy bonus read the entropy whatever the metrics
        forward.metrics = metrics or (forward.temperature is not None and _grpo_reads_entropy(trainer))
        return "leantune"
    pair = pair_trainer_kind(trainer)
    if pair is not None and model is trainer.model:
        return take_pair_head(trainer, pair, metrics, FusedLMHead)
    settings = _trl_head_settings(forward)
    if settings is None:  # TRL <= 1.14 (or a plain Trainer): outputs.logits may be read in training
        return "no fused head"
    grpo = _grpo_head(trainer, settings)
    if grpo is not None:
        return _take_grpo_head(hf, forward, settings, metrics, trainer, grpo)
    # the rest may differentiate the statistics, which leantune's head computes without gradient
    why = _why_not_served(settings) if isinstance(trainer, _statistics_trainers()) else (
        f"{type(trainer).__name__} is not an SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer, "
        "ORPOTrainer or CPOTrainer (it may differentiate the statistics)")
    if why is not None:
        return f"TRL's fused head kept: {why}"
    hf.forward = FusedLMHead(hf, forward, settings.get("outputs", ("log_probs",)), metrics)
    return "leantune"


def _statistics_trainers() -> tuple[type, ...]:
    """TRL's trainers whose fused-head statistics are logged only (detached or never differentiated, read in trl
    1.16): served by ops.linear_cross_entropy with its statistics. KTO: per-sequence log-prob sums, its KL term,
    and the entropy (detached) and mean logits for its metrics."""
    from trl import DPOTrainer, KTOTrainer, SFTTrainer

    return SFTTrainer, DPOTrainer, KTOTrainer


def _grpo_head(trainer, settings: dict):
    """None for a trainer other than TRL's GRPOTrainer or RLOOTrainer (the same fused-head calls in trl 1.16:
    log-probs at the sampling temperature, the entropy for the metric); for one, why TRL's head stays ("" when
    leantune's log-prob head serves it)."""
    from trl import GRPOTrainer, RLOOTrainer

    if not isinstance(trainer, (GRPOTrainer, RLOOTrainer)):
        return None
    if settings.get("logit_scale", 1.0) != 1.0:
        return f"logit scale {settings['logit_scale']} (leantune's head has none)"
    if settings.get("cast_lm_head_to_fp32"):
        return "cast_lm_head_to_fp32 (leantune's head runs in the model's dtype)"
    return ""


def _grpo_reads_entropy(trainer) -> bool:
    """Whether GRPO's loss reads the entropy: its high-entropy token mask, or its entropy bonus (differentiated)."""
    return getattr(trainer, "top_entropy_quantile", 1.0) < 1.0 or bool(getattr(trainer, "_entropy_bonus_enabled",
                                                                                False))


def _take_grpo_head(hf, forward, settings: dict, metrics: bool, trainer, why: str) -> str:
    """Put leantune's log-prob head (ops.linear_log_probs at TRL's temperature, with the entropy) in front of
    GRPOTrainer's fused head on ``hf``; the entropy is computed with metrics off too when the trainer reads it."""
    if why:
        return f"TRL's fused head kept: {why}"
    needs_entropy = _grpo_reads_entropy(trainer)
    temperature = settings.get("temperature", 1.0)
    head = FusedLMHead(hf, forward, settings.get("outputs", ("log_probs",)), metrics or needs_entropy,
                       temperature=temperature)
    head.leantune_loss = (f"ops.linear_log_probs at temperature {temperature:g} per token "
                          f"({type(trainer).__name__}'s fused_lm_head calls, leantune.integrations.trl)")
    hf.forward = head
    return "leantune"


def _check_trainer(trainer) -> None:
    """ValueError unless ``trainer`` is a built TRL trainer, naming what :func:`patch_trainer` takes."""
    from_trl = any(getattr(cls, "__module__", "").startswith("trl.") for cls in type(trainer).__mro__)
    if from_trl and isinstance(getattr(trainer, "model", None), nn.Module):
        return
    name = f"{type(trainer).__module__}.{type(trainer).__qualname__}"
    if isinstance(trainer, nn.Module):
        hint = "; for a model, call leantune.patch(model)"
    elif isinstance(getattr(trainer, "model", None), nn.Module):
        hint = "; for another trainer, call leantune.patch(trainer.model) (its loss then comes from the model forward)"
    else:
        hint = ""
    raise ValueError(f"patch_trainer takes a built TRL trainer (trl.SFTTrainer, DPOTrainer, KTOTrainer, "
                     f"GRPOTrainer, RLOOTrainer, trl.experimental's ORPOTrainer or CPOTrainer after construction), "
                     f"got {name}{hint}")


def _leave_out_of_logs(trainer, names: tuple[str, ...]) -> None:
    """With ``names``, drop those metrics from the trainer's pending metrics before each ``log`` (statistics not
    computed under ``metrics=False`` are left out, not logged as 0); without, take that wrapper off again."""
    if getattr(trainer.__dict__.get("log"), "leantune_left_out", None) is not None:
        del trainer.__dict__["log"]
    if not names or not callable(getattr(trainer, "log", None)):
        return
    log = trainer.log

    @functools.wraps(log)
    def log_measured(logs, *args, **kwargs):
        # TRL's {"train": {...}, "eval": {...}}: _metrics, or ORPO's and CPO's _stored_metrics
        stores = (getattr(trainer, "_metrics", {}), getattr(trainer, "_stored_metrics", {}))
        for pending in (pending for store in stores for pending in store.values()):
            for name in names:
                pending.pop(name, None)
        return log(logs, *args, **kwargs)

    log_measured.leantune_left_out = names
    trainer.log = log_measured


def _not_computed(trainer) -> tuple[str, ...]:
    """The logged metrics whose statistic the policy's leantune head does not compute."""
    forward = _head_of(hf_model(trainer.model))
    if not isinstance(forward, FusedLMHead):
        return ()
    return tuple(metric for stat, metrics in LOGGED_FROM.items() if stat in forward.outputs
                 and not forward.computes(stat) for metric in metrics)


def patch_trainer(trainer, *, metrics: bool = True, freeze_heap: bool = True, **patch_kwargs):
    """Make a built TRL trainer (SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer, ORPOTrainer,
    CPOTrainer) train with leantune's ops and loss head; returns ``trainer``.

    Args:
        trainer: a ``trl`` trainer after construction (its model may already be patched, or not).
        metrics: compute TRL's logged statistics (entropy, token accuracy, mean logit: ORPO's and CPO's
            logits/chosen and logits/rejected too) inside the loss op's pass (module docstring); False leaves them out
            of the logs (GRPO's entropy is still computed when its
            token mask or entropy bonus reads it).
        freeze_heap: while ``trainer.train()`` runs, keep the Python objects alive at its start out of the garbage
            collector's full collections (:func:`leantune.heap.long_lived_frozen`: a full collection walks the
            model's ~500k objects, a host pause of 0.2-0.3 s every few steps), as ``leantune train`` does; False
            takes it off a trainer given it before.
        **patch_kwargs: :func:`leantune.patch`'s switches (``rope``, ``mlp``, ``lora``, ``loss``, ...).

    Returns:
        ``trainer``; ``trainer.model`` (and a separate ``trainer.ref_model``) patched. Where TRL's fused head is
        kept, the patch summary's ``loss_runs`` says why (module docstring).

    Raises:
        ValueError: ``trainer`` is not a TRL trainer with a model (a model, a PEFT wrapper, a plain
            ``transformers.Trainer``: the message says what to call instead), and as :func:`leantune.patch`
            (unsupported family, not a transformers model; the trainer's heads are left as they were).
        TypeError: a keyword argument that is not one of the above, before the trainer is touched.
        ValueError: ``metrics`` or ``freeze_heap`` not a bool, before the trainer is touched.
    """
    _check_trainer(trainer)
    unknown = sorted(set(patch_kwargs) - set(inspect.signature(patch).parameters) - {"model"})
    if unknown:  # before the trainer is touched
        raise TypeError(f"patch_trainer got unexpected keyword arguments {unknown}: it takes metrics, freeze_heap "
                        "and leantune.patch's switches")
    for name, value in (("metrics", metrics), ("freeze_heap", freeze_heap)):
        if not isinstance(value, bool):  # "no" would be truthy
            raise ValueError(f"{name} must be True or False, got {value!r}")
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        hf = hf_model(model)
        before = hf.__dict__.get("forward"), trainer.__dict__.get("concatenated_forward")
        head = _take_head(model, metrics, trainer)
        try:
            patch(model, **patch_kwargs)
        except Exception:  # a switch patch refuses: the trainer's heads as they were
            for owner, name, value in ((hf, "forward", before[0]), (trainer, "concatenated_forward", before[1])):
                if value is None:
                    owner.__dict__.pop(name, None)
                else:
                    owner.__dict__[name] = value
            raise
        state = hf.__dict__.get(STATE_ATTR)
        if head == "no fused head" and state is not None and state.kind == "causal_lm":
            # a client that reads outputs.logits in training: form them (the loss still from the fused op)
            hf.__dict__[STATE_ATTR] = dataclasses.replace(state, training_logits=True)
            hf.leantune_summary["loss_runs"] += (f"; logits formed in training too ({type(trainer).__name__} makes "
                                                 "no fused_lm_head calls: TRL <= 1.14, or a trainer that scores "
                                                 "the logits or hidden states itself, e.g. GKD or distillation)")
        elif head.startswith("TRL's"):
            hf.leantune_summary["loss_runs"] = head
    _leave_out_of_logs(trainer, _not_computed(trainer))
    _freeze_heap_in_train(trainer, freeze_heap)
    _raise_deferred_at_logging(trainer)
    return trainer


def _raise_deferred_at_logging(trainer) -> None:
    """Add a callback (once) that raises a loss op's deferred label error at each logging step, where the Trainer
    has just read the loss back (a host wait anyway): the head's loss runs with ``checks="deferred"``."""
    from transformers import TrainerCallback

    class RaiseDeferredErrors(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            ops.raise_deferred_errors()
            forward = trainer.__dict__.get("concatenated_forward")
            if isinstance(forward, PairForward):  # ORPO's one-target check (trl_preference)
                forward.raise_if_mismatched()

    handler = getattr(trainer, "callback_handler", None)
    if handler is None:  # not a transformers Trainer
        return
    if not any(type(cb).__name__ == "RaiseDeferredErrors" for cb in handler.callbacks):
        trainer.add_callback(RaiseDeferredErrors())


def _freeze_heap_in_train(trainer, on: bool) -> None:
    """Run ``trainer.train`` inside :func:`long_lived_frozen` (an instance attribute wrapping the class's method,
    so the thaw happens whichever way it ends), or take that wrapper off again."""
    current = trainer.__dict__.get("train")
    ours = getattr(current, "leantune_frozen_heap", False)
    if not on:
        if ours:
            del trainer.__dict__["train"]
        return
    if ours or not callable(getattr(trainer, "train", None)):
        return
    train = trainer.train

    @functools.wraps(train)
    def train_frozen(*args, **kwargs):
        with long_lived_frozen():
            return train(*args, **kwargs)

    train_frozen.leantune_frozen_heap = True
    trainer.train = train_frozen


def loss_head_calls(model) -> int:
    """How many ``fused_lm_head=True`` calls leantune's head served on ``model`` (or the transformers model inside
    a PEFT wrapper); 0 when :func:`patch_trainer` never took its head."""
    forward = _head_of(hf_model(model))
    return forward.calls if isinstance(forward, FusedLMHead) else 0


def _head_of(hf):
    """hf's instance forward, leantune's head where one sits under accelerate's mixed-precision wrappers."""
    return instance_forward(hf, lambda f: isinstance(f, FusedLMHead))


__all__ = ["FusedLMHead", "loss_head_calls", "patch_trainer"]
