"""The replacement forwards that :func:`leantune.patch` binds onto module instances, one per kind, family-agnostic.

Each patched module carries a small plain state object (``module._leantune``: the family row and the switches) and
a :class:`BoundForward`; the original forward is the class's. ``copy.deepcopy``, ``pickle`` and ``torch.save`` of a
patched model give a working patched copy (the forward rebinds itself through :func:`bind`).

The attention and MLP forwards, which follow the family row's structure fields, live in :mod:`.blocks`.
LoRA projections are read from PEFT at every forward (:mod:`.lora_status` decides which ones the fused ops serve
exactly; the others keep PEFT's forward).

RoPE has no per-instance seam in transformers 5 (the attention forward calls the module-level
``apply_rotary_pos_emb``), so the family's modeling module gets a dispatcher while any patched attention module
uses it (:func:`acquire_rope` / :func:`release_rope`, counted per module by :func:`bind` / :func:`unbind`); it
runs ``ops.rope`` only inside HF's forward of a patched attention module (a context variable set there in eager
mode, holding the family's rope kind: "half_freqs" cos/sin are widened to one column per rotated dim first), so an
unpatched model keeps HF's exact function. leantune's own copy of the attention passes the kind to
:func:`._common.rotate` directly (and under torch.compile serves every patched attention whose kind is on).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import numbers
import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from . import fp8_inputs
from ._common import call_original as _call_original
from ._common import rope_active as _rope_active
from ._common import rotate as _rotate
from ._common import served as _served
from .blocks import attention_forward, mlp_forward, sinks_served
from .document_attention import remember_single_sequences
from .experts import experts_forward
from .families import Family
from .input_embeddings import input_embeddings
from .lora_status import carries_fusable_lora, has_hooks, lora_status
from .missing_logits import logits_for_caller


# --------------------------------------------------------------------------------------------------- module state
@dataclasses.dataclass(frozen=True)
class ModuleState:
    """What a patched module needs at forward time (plain data: deep-copies with the module)."""

    kind: str  # "rms_norm" | "attention" | "mlp" | "experts" | "causal_lm"
    family: Family
    rope: bool = False
    lora: bool = False
    mlp: bool = False
    loss: bool = False
    activation: str | None = None  # "swiglu" | "geglu_tanh" | "geglu_erf"
    training_logits: bool = False  # causal_lm: form logits in training too, for clients that read them


# ----------------------------------------------------------------------------------------------------------- RoPE
_rope_users: dict[str, weakref.WeakSet] = {}
_rope_originals: dict[str, object] = {}


def _make_rope_dispatch(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        # the family's rope kind inside a patched attention forward (eager mode), else False
        return _rotate(_rope_active(), original, q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__doc__ = f"leantune dispatcher: ops.rope inside patched attention, else {original!r}."
    apply_rotary_pos_emb._leantune_original = original
    return apply_rotary_pos_emb


def acquire_rope(family: Family, model) -> None:
    """Install the dispatcher in the family's modeling module (if needed) and register ``model`` (a patched
    attention module) as a user."""
    module = importlib.import_module(family.modeling_module)
    users = _rope_users.setdefault(family.modeling_module, weakref.WeakSet())
    current = module.apply_rotary_pos_emb
    if getattr(current, "_leantune_original", None) is None:
        _rope_originals[family.modeling_module] = current
        module.apply_rotary_pos_emb = _make_rope_dispatch(current)
    if model not in users:
        users.add(model)
        # A patched model dropped without unpatch also counts out (when it is collected).
        weakref.finalize(model, _restore_if_unused, family.modeling_module)


def release_rope(family: Family, model) -> None:
    """Unregister ``model``; the last user out restores HF's function (unless someone replaced ours since)."""
    users = _rope_users.get(family.modeling_module)
    if users is not None:
        users.discard(model)
        _restore_if_unused(family.modeling_module)


def _restore_if_unused(modeling_module: str) -> None:
    if any(True for _ in _rope_users.get(modeling_module, ())):  # iteration skips models being collected
        return
    module = importlib.import_module(modeling_module)
    original = _rope_originals.pop(modeling_module, None)
    if original is not None and getattr(module.apply_rotary_pos_emb, "_leantune_original", None) is original:
        module.apply_rotary_pos_emb = original


def rope_installed(family: Family) -> bool:
    """True while the family's modeling module holds leantune's dispatcher (tests)."""
    module = importlib.import_module(family.modeling_module)
    return getattr(module.apply_rotary_pos_emb, "_leantune_original", None) is not None


# ------------------------------------------------------------------------------------------------------ forwards
def rms_norm_forward(self, hidden_states):
    """HF ``*RMSNorm.forward`` as ``ops.rms_norm`` with the family's casting and offset (with its FP8 side output
    where y feeds FP8 projections: :mod:`.fp8_inputs`)."""
    if not _served(hidden_states, self.weight):
        return _call_original(self, hidden_states)
    family = self._leantune.family
    eps = getattr(self, family.norm_eps_attr)
    # the e4m3 codes of y too, written by the norm's kernel, when y feeds FP8 projections (:mod:`.fp8_inputs`)
    fp8_out = fp8_inputs.wanted(self)
    out = ops.rms_norm(hidden_states, self.weight, eps, offset=family.norm_offset, casting=family.norm_casting,
                       fp8_out=fp8_out)
    y, quantized = out if fp8_out else (out, None)
    fp8_inputs.record(y, self, quantized)
    return y


def _causal_lm_loss(lm_head, hidden, labels, num_items, ignore_index, softcap, head_logits=None):
    """HF's ``ForCausalLMLoss`` on already shifted ``labels [N]`` and ``hidden [N, H]``, without [N, V] logits when
    ``lm_head`` is a plain linear layer (``head_logits``: ``lm_head(hidden)`` when the caller already has it).

    No host sync (docs/design.md, "No host sync in a step"): the loss op runs with ``checks="deferred"`` (a bad
    label gives a NaN loss and a deferred ValueError) and ``num_items_in_batch`` never leaves the device.

    HF's ``fixed_cross_entropy`` divides the summed loss by ``num_items_in_batch`` whatever it is (a [1, 1] tensor
    under DataParallel, a float, a tensor on another GPU). A one-element tensor or a whole count >= 0 goes to the op
    as its divisor, so the 1/count scale enters the gradient before its one rounding; a 0 when no label is valid
    (HF Trainer's value for an accumulation window without targets) gives 0.0 and zero gradients where HF's 0 / 0
    is NaN, and a 0 dividing valid tokens gives HF's inf (both decided on the device). Anything else (a fractional
    Python number, a tensor of several elements) takes HF's expression.
    """
    count = _divisor_count(num_items, labels.device)
    hf_divides = num_items is not None and count is None
    reduction = "sum" if hf_divides else "mean"
    if _plain_linear(lm_head):
        loss = ops.linear_cross_entropy(hidden, lm_head.weight, labels, lm_head.bias, ignore_index=ignore_index,
                                        softcap=softcap, reduction=reduction, num_items=count, checks="deferred")
    else:  # e.g. LoRA on lm_head or modules_to_save: its logits are needed, the loss still fused with the softcap
        logits = lm_head(hidden) if head_logits is None else head_logits
        loss = ops.cross_entropy(logits, labels, ignore_index=ignore_index, softcap=softcap, reduction=reduction,
                                 num_items=count, checks="deferred")
    if hf_divides:
        return loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    if torch.is_tensor(num_items):  # HF's dtype and shape, as a tensor of its own (FSDP2 warns on a returned view)
        loss = loss.to(_quotient_dtype(loss, num_items))
        shape = torch.broadcast_shapes((), num_items.shape)
        return loss if loss.shape == shape else loss.reshape(shape).clone()
    return loss


def _quotient_dtype(loss, num_items) -> torch.dtype:
    """The dtype of HF's ``loss / num_items`` for a 0-dim float ``loss`` (torch's promotion), without
    ``torch.result_type`` (a graph break under torch.compile): an integer count keeps loss's dtype; a float one with
    dimensions wins its category; two 0-dim floats promote."""
    if not (num_items.is_floating_point() or num_items.is_complex()):
        return loss.dtype
    if num_items.dim() > 0:
        return num_items.dtype if num_items.is_floating_point() else torch.promote_types(loss.dtype, num_items.dtype)
    return torch.promote_types(loss.dtype, num_items.dtype)


def _divisor_count(num_items, device):
    """``num_items_in_batch`` as the loss op's divisor: a one-element real tensor as a 0-dim tensor on ``device``
    (its value is not read: no host sync), a Python number holding a whole count in [0, 2^63) as an int, else None
    (HF's expression divides)."""
    if torch.is_tensor(num_items):
        if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
            return None
        return num_items.detach().reshape(()).to(device, non_blocking=True)
    if isinstance(num_items, bool) or not isinstance(num_items, numbers.Real):
        return None
    try:
        whole = float(num_items).is_integer() and 0 <= num_items < 2**63
    except OverflowError:  # an int beyond float's range
        return None
    return int(num_items) if whole else None


def causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                      inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, skip_logits=None, **kwargs):
    """``XForCausalLM.forward`` with the loss from ``ops.linear_cross_entropy``: with labels (as HF, a given
    ``shift_labels`` is used instead of shifting them) the loss never needs [tokens, vocab] logits. In training
    (``self.training``) none are formed and ``logits`` is None (with ``return_dict=False`` the tuple keeps a None in
    the logits slot, so positions match HF's); in eval mode the logits are also computed as HF does (``lm_head`` on
    the hidden states, then the family's final-logit softcap) for callers that read them (HF Trainer's
    ``compute_metrics``), and the loss still comes from the op. ``skip_logits`` (leantune's keyword; None: skip in
    training only) asks for either explicitly, e.g. ``skip_logits=True`` for an evaluation that reads only the loss.
    Without labels HF's forward runs unchanged.

    Labels are shifted as HF's ``ForCausalLMLoss`` does (pad with ignore_index, drop the first);
    ``num_items_in_batch`` divides the summed loss as in HF's ``fixed_cross_entropy`` (same value, dtype and shape for
    any input HF accepts); the family's final-logit softcap is applied in the op. One difference from HF: when no
    token has a label (also with ``num_items_in_batch`` 0) the loss is 0.0 with zero gradients (HF: NaN), the ops'
    rule (docs/design.md, "Public op contract").
    """
    # HF computes a loss only with labels; a logits_to_keep slice asks for logits (generation): HF's forward for both
    head_weight = next(self.lm_head.parameters(), None)
    if (labels is None or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
            or (head_weight is not None and not _served(head_weight))):
        return _call_original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                              use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    family = self._leantune.family
    base = getattr(self, self.base_model_prefix)
    router_logits = False
    if family.experts is not None:  # HF's MoE causal LMs: the router logits for the aux loss (HF's argument)
        router_logits = kwargs.pop("output_router_logits", None)
        if router_logits is None:
            router_logits = getattr(self.config, "output_router_logits", False)
        kwargs["output_router_logits"] = router_logits
    if inputs_embeds is None and input_ids is not None:
        hidden_states_out = kwargs.get("output_hidden_states") or getattr(self.config, "output_hidden_states", False)
        input_ids, inputs_embeds = None, input_embeddings(base, input_ids, bool(hidden_states_out))
    masks = attention_mask
    if (position_ids is None and attention_mask is None and past_key_values is None and inputs_embeds is not None
            and "cache_position" not in kwargs):
        # the positions transformers would make (0..S-1, one sequence a row), made here so that its packed-row check
        # is answered without a host sync (docs/design.md, "No host sync in a step")
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        remember_single_sequences(position_ids)
        # causal rows, one sequence each: a family with sinks may need no masks at all (given positions may be
        # packed documents, whose block-diagonal mask transformers builds: not skipped)
        masks = _sink_layer_masks(base, family, inputs_embeds)
    outputs = base(input_ids=input_ids, attention_mask=masks, position_ids=position_ids,
                   past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden_states = outputs.last_hidden_state
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.reshape(-1).to(hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    softcap = getattr(self.config, family.final_softcap_attr, None) if family.final_softcap_attr else None
    divisor = getattr(self.config, family.logits_divisor_attr) if family.logits_divisor_attr else None
    multiplier = getattr(self.config, family.logits_multiplier_attr) if family.logits_multiplier_attr else None
    if divisor is not None:  # Granite's lm_head(h) / s as lm_head(h / s): patch keeps HF's loss for a biased head
        hidden = hidden / divisor
    if multiplier is not None:  # HyperCLOVA X's lm_head(h) * s as lm_head(h * s), likewise
        hidden = hidden * multiplier
    logits = head_logits = None
    if skip_logits is None:  # evaluation may read them (metrics), and so may clients that asked in training
        skip_logits = self.training and not self._leantune.training_logits
    if not skip_logits:
        logits = head_logits = self.lm_head(hidden_states)
        if divisor is not None:  # HF's expression
            logits = head_logits = logits / divisor
        if multiplier is not None:
            logits = head_logits = logits * multiplier
        if softcap is not None:  # HF's expression and rounding order
            logits = torch.tanh(logits / softcap) * softcap
        head_logits = head_logits.reshape(-1, head_logits.shape[-1])
    loss = _causal_lm_loss(self.lm_head, hidden, shift_labels, num_items, ignore_index, softcap, head_logits)
    # what ran, for the summary's loss_runs (Python calls: a replayed CUDA graph counts once, at capture)
    self.__dict__[LOSS_CALLS_ATTR] = self.__dict__.get(LOSS_CALLS_ATTR, 0) + 1
    if logits is None and self.training:  # TRL <= 1.14 reads them: a stand-in whose use names the fix
        logits = logits_for_caller()
    fields = dict(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    if family.experts is not None:
        return _moe_output(self, family, fields, outputs, attention_mask, router_logits, return_dict)
    output = CausalLMOutputWithPast(**fields)
    if return_dict:
        return output
    # HF's to_tuple drops None fields; keep the logits slot so that out[1] is never silently another field
    return (loss, logits, *(v for v in (outputs.past_key_values, outputs.hidden_states, outputs.attentions)
                          if v is not None))


def _sink_layer_masks(base, family: Family, inputs_embeds) -> dict | None:
    """For a family with sinks, rows without a padding mask, given positions or a cache: ``{layer type: None}``,
    the per-layer-type masks handed to the base model in place of the ones transformers would build (its model
    forward takes such a dict as given), when every attention layer of ``base`` runs ``ops.sink_attention``, which
    then applies causality (``is_causal``: SDPA's flash kernel on the card) and each layer's window (its own band)
    itself. That skips transformers' eager masks: two [B, 1, S, S] tensors built from a host scalar (a host sync
    on CUDA) and the flash kernel lost to an explicit mask. None (transformers builds its masks) when any attention
    layer would run another function: not leantune's forward (unpatched, a hook), an implementation other than
    eager/sdpa, inputs the ops do not take (a None mask there would drop causality)."""
    if family.attention_sinks_attr is None or inputs_embeds is None or not _served(inputs_embeds):
        return None
    layer_types = getattr(base.config, "layer_types", None)
    modeling = sys.modules.get(family.modeling_module)
    attention_cls = getattr(modeling, family.attention_class, None)
    if not layer_types or attention_cls is None:
        return None
    found = False
    for module in base.modules():
        if isinstance(module, attention_cls):
            forward = module.__dict__.get("forward")
            if (not is_leantune_forward(forward) or forward.__func__ is not attention_forward
                    or STATE_ATTR not in module.__dict__ or not sinks_served(module, family)):
                return None
            found = True
    return {layer_type: None for layer_type in layer_types} if found else None


def _moe_output(self, family, fields, outputs, attention_mask, router_logits, return_dict):
    """HF's MoE causal-LM ending (``Qwen3MoeForCausalLM.forward`` and its kin): with router logits, the family's
    ``load_balancing_loss_func`` on them, ``router_aux_loss_coef`` times it added to the loss."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    aux_loss = None
    if router_logits:
        modeling = importlib.import_module(family.modeling_module)
        if attention_mask is None:
            # HF's no-mask branch counts with torch.bincount, a host sync on CUDA (one per layer); an all-ones mask
            # takes its scatter_add branch instead: the same counts and sums, exactly, read nothing back
            first = outputs.router_logits[0]
            attention_mask = torch.ones(first.shape[0], device=first.device, dtype=torch.float32)
        aux_loss = modeling.load_balancing_loss_func(outputs.router_logits, self.num_experts,
                                                     self.num_experts_per_tok, attention_mask)
        fields["loss"] = fields["loss"] + self.router_aux_loss_coef * aux_loss.to(fields["loss"].device)
    output = MoeCausalLMOutputWithPast(**fields, aux_loss=aux_loss, router_logits=outputs.router_logits)
    if return_dict:
        return output
    # HF's to_tuple drops None fields; the logits slot stays (as the dense ending's) so out[2] is never another field
    return tuple(value for name in output.__dataclass_fields__
                 if (value := getattr(output, name)) is not None or name == "logits")


def _plain_linear(module) -> bool:
    return type(module) is nn.Linear and not has_hooks(module)


FORWARDS = {
    "rms_norm": rms_norm_forward,
    "attention": attention_forward,
    "mlp": mlp_forward,
    "experts": experts_forward,
    "causal_lm": causal_lm_forward,
}
STATE_ATTR = "_leantune"  # the ModuleState of a patched module, in its __dict__


class BoundForward:
    """A patched module's ``forward``: ``FORWARDS[kind]`` bound to the module, like a bound method.

    Not a plain bound method because of copies: pickle saves one as ``getattr(module, "attention_forward")``, which a
    module being reloaded does not have. This one reduces to :func:`bind`, so a pickled (``torch.save``) or
    deep-copied patched model comes back patched, and its attention modules hold the RoPE dispatcher like the
    original's. ``__signature__`` is the forward's without ``self`` (HF's generate and Trainer inspect it).
    """

    __slots__ = ("__func__", "__self__")

    def __init__(self, func, module):
        self.__func__, self.__self__ = func, module

    def __call__(self, *args, **kwargs):
        module = self.__self__
        if STATE_ATTR not in module.__dict__:  # unpatched while a wrapper (e.g. TRL's fused LM head) still holds it
            return _call_original(module, *args, **kwargs)
        return self.__func__(module, *args, **kwargs)

    def __reduce__(self):
        return bind, (self.__self__, self.__self__.__dict__[STATE_ATTR])

    @property
    def __signature__(self):
        signature = inspect.signature(self.__func__)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    @property
    def __name__(self):
        return self.__func__.__name__

    @property
    def __doc__(self):
        return self.__func__.__doc__

    def __repr__(self):
        return f"<leantune {self.__func__.__name__} of {type(self.__self__).__name__}>"


def bind(module: nn.Module, state: ModuleState) -> BoundForward:
    """Give ``module`` its state and (for attention with the rope kind on) a share of the RoPE dispatcher; returns
    the forward to install. Also what a copy of a patched module is rebuilt with."""
    module.__dict__[STATE_ATTR] = state
    if state.kind == "attention" and state.rope:
        acquire_rope(state.family, module)
    return BoundForward(FORWARDS[state.kind], module)


def unbind(module: nn.Module) -> None:
    """Undo :func:`bind`: the state and the instance forward removed, the RoPE share released."""
    state = module.__dict__.pop(STATE_ATTR, None)
    if is_leantune_forward(module.__dict__.get("forward")):
        del module.forward
    if state is not None and state.kind == "attention" and state.rope:
        release_rope(state.family, module)


def is_leantune_forward(fn) -> bool:
    """Whether ``fn`` (a module's instance ``forward``) is one that :func:`bind` installed."""
    return isinstance(fn, BoundForward)


LOSS_CALLS_ATTR = "_leantune_loss_calls"  # on the causal LM: how many losses leantune's causal-LM forward computed
LOSS_HEAD_ATTR = "leantune_loss"  # on a wrapper's forward that serves the loss with leantune's op: what runs (str)


def holds_leantune(fn, module, depth: int = 4) -> bool:
    """Whether the instance forward ``fn`` of ``module`` is a wrapper that leads to leantune: a forward marked with
    ``leantune_loss`` (an integration's loss head), or one that holds :class:`BoundForward` of ``module`` in its
    bound function, ``__wrapped__`` or closure (TRL's ``add_fused_lm_head`` keeps the forward it replaced in a
    closure), up to ``depth`` steps away."""
    stack, seen = [(fn, 0)], set()
    while stack:
        f, steps = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, BoundForward):
            if f.__self__ is module:
                return True
            continue
        if isinstance(getattr(f, LOSS_HEAD_ATTR, None), str):
            return True
        if steps >= depth:
            continue
        inner = [getattr(f, "__func__", None), getattr(f, "__wrapped__", None)]
        for cell in getattr(f, "__closure__", None) or ():
            try:
                inner.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        stack.extend((g, steps + 1) for g in inner if callable(g))
    return False


__all__ = ["FORWARDS", "LOSS_CALLS_ATTR", "LOSS_HEAD_ATTR", "STATE_ATTR", "BoundForward", "ModuleState",
           "acquire_rope", "bind",
           "carries_fusable_lora", "causal_lm_forward", "holds_leantune", "is_leantune_forward", "lora_status",
           "release_rope", "rope_installed", "unbind"]
