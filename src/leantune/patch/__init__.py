"""``leantune.patch(model)``: leantune's ops inside a Hugging Face causal LM, on this instance only.

What is swapped (each kind can be switched off), all as ``forward`` callables bound on module instances
(``forwards.BoundForward``: they survive ``copy.deepcopy``, ``pickle`` and ``torch.save``):

Which modules exist and how they are built is the family's row in :mod:`.families` (what a decoder layer is made
of); the decoder layer keeps HF's forward, so norm placement and residual scalars are HF's own.

- ``rms_norm``: every ``{Family}RMSNorm`` -> ``ops.rms_norm`` with the family's casting/offset (incl. post-norms,
  sandwich norms and q/k norms: they are RMSNorm modules of the same class). LayerNorm families keep HF's norms.
- ``rope``: the attention modules run ``ops.rope`` through a dispatcher put in the family's modeling module while a
  patched model exists (transformers 5 calls the module-level ``apply_rotary_pos_emb``; no per-instance seam); for
  split-halves RoPE only (partial rotary included); interleaved-pair RoPE keeps HF's function.
- ``mlp``: gated ``{Family}MLP`` (separate gate/up or a fused ``gate_up_proj``) -> ``ops.swiglu`` / ``ops.geglu``;
  with LoRA on its projections, ``ops.lora_mlp``. A plain (non-gated) MLP keeps HF's activation. A
  mixture-of-experts family's experts module (``mlp.experts``, PEFT's ``target_parameters`` wrappers included) ->
  ``ops.moe_experts`` (:mod:`.experts`); the router, shared expert and aux loss stay HF's.
- ``lora``: q/k/v -> ``ops.lora_qkv`` (a fused ``qkv_proj``: ``ops.lora_linear``), o_proj and the projections of a
  plain MLP -> ``ops.lora_linear`` (PEFT's scaling, dropout and base bias read at every forward). DoRA
  projections: q/k/v -> ``ops.lora_qkv``, a gated MLP -> ``ops.lora_mlp`` (their DoRA nodes), the others ->
  ``ops.dora_linear`` (DoRA with dropout in training keeps PEFT's forward). Other LoRA
  variants, several active adapters, merged or disabled adapters, ``lora_bias`` and non-``nn.Linear`` bases keep
  PEFT's own forward (the summary lists them).
- ``loss``: ``XForCausalLM.forward`` -> base model, then ``ops.linear_cross_entropy`` on the hidden states (labels
  shifted as HF does, ``num_items_in_batch`` honoured, final-logit softcap as data). With labels, ``logits`` is
  None in training (never formed); in eval mode they are computed as HF does, beside the fused loss. Without labels
  HF's forward runs, so inference and ``generate`` are unchanged.

Parameters, buffers and ``state_dict`` keys are untouched; :func:`unpatch` deletes the instance forwards. PEFT
wrappers may come before or after ``patch``: LoRA layers are looked up at forward time.
"""

from __future__ import annotations

import collections
import importlib
import logging
import warnings

from torch import nn

from ._model import hf_model as _hf_model
from .document_attention import install_dispatchers as install_mask_dispatchers
from .experts import experts_activation, experts_base, experts_status, float_class
from .families import ACTIVATIONS, FAMILIES, NOT_COVERED, SINK_IMPLEMENTATIONS, Family, family_for
from .forwards import (
    LOSS_HEAD_ATTR,
    STATE_ATTR,
    ModuleState,
    bind,
    holds_leantune,
    is_leantune_forward,
    lora_status,
    unbind,
)
from .lora_status import is_dora
from .offload import disable_offloaded_checkpoints, enable_offloaded_checkpoints
from .summary import LEANTUNE_FORWARD_LOSS, PatchSummary, forward_name, quantized_counts
from .tiled_mlp import check_tile_tokens, disable_tiled_mlp, enable_tiled_mlp

logger = logging.getLogger(__name__)

KINDS = ("rms_norm", "rope", "mlp", "loss", "lora")
_MODEL_ATTR = "_leantune_model"  # on the HF causal LM: (family name, flags) of the current patch
SUMMARY_ATTR = "leantune_summary"
# the summary's counts; "dora": DoRA projections served by ops.dora_linear (also counted in "lora")
# "experts": MoE experts modules through ops.moe_experts; "experts_lora": those of them with LoRA on the experts
_COUNTS = ("rms_norm", "rope", "mlp", "loss", "lora", "lora_qkv", "lora_mlp", "dora", "experts", "experts_lora")


def _bind(module: nn.Module, state: ModuleState) -> None:
    module.forward = bind(module, state)


def _foreign_forward(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return forward is not None and not is_leantune_forward(forward)


def patch(model, *, rms_norm: bool = True, rope: bool = True, mlp: bool = True, loss: bool = True,
          lora: bool = True, offload_checkpoints: bool = False, tile_mlp: int | None = None, strict: bool = False):
    """Make ``model`` run leantune's ops; returns ``model`` (the same object, patched in place).

    Args:
        model: an instantiated transformers causal LM (a model type in :data:`FAMILIES`), or a PEFT wrapper of one
            (``get_peft_model`` may also come after ``patch``).
        rms_norm, rope, mlp, loss, lora: which kinds to swap (see the module docstring).
        offload_checkpoints: keep each checkpointed decoder layer's input in pinned host memory between forward and
            backward (:mod:`leantune.patch.offload`); needs non-reentrant gradient checkpointing at training
            forwards (enabled before or after this call).
        tile_mlp: tokens per tile: run every MLP block over token tiles of this many tokens, recomputed tile by tile
            in backward (:mod:`leantune.patch.tiled_mlp`); None (default) runs it whole. For long sequences, where
            the MLP's [tokens, intermediate] tensors bound the context.
        strict: raise for a model type that has no family row, instead of warning and leaving the model unpatched.

    Returns:
        ``model``. Its summary (counts per kind, ``fused``: the parts of the family's layers that run leantune's ops as
        patched (a kind switched off, no PEFT, no dense MLP leave theirs out), ``kept``: parts of its layers that keep
        HF's forward and why, ``loss_runs``: the loss that the model's forward runs, re-read at each access from what is
        installed and what ran (:class:`PatchSummary`), and ``unpatched``: modules left alone and why, ``quantized``:
        how many linear layers hold leantune.quantize's codes, by kind, e.g. ``{"fp8": 224}``, also named in ``fused``)
        is logged at INFO and stored as ``leantune_summary`` on the transformers model (reachable through PEFT
        wrappers). A model type without a row is left unpatched with a ``UserWarning`` naming what is missing (its
        summary has ``family`` None). A wrapper forward put on the causal LM by someone else (TRL's fused LM head) is
        kept: patched before it, leantune's forward inside runs where the wrapper calls it; patched after, the loss is
        the wrapper's unless it holds leantune's forward or is leantune's own head (:mod:`leantune.integrations.trl`).
        Counts and ``fused`` are as of the call: patching before ``get_peft_model`` counts 0 LoRA projections, yet LoRA
        is fused at forward time, and after ``merge_and_unload`` the counts still name the adapters (call ``patch``
        again to refresh the summary; patching twice is harmless).

    Raises:
        ValueError: ``config.model_type`` has no family row and ``strict`` is set (the message lists the supported
            ones), ``model`` is not a transformers model, a switch is not a bool, or ``tile_mlp`` is not a positive
            int.
    """
    switches = {"rms_norm": rms_norm, "rope": rope, "mlp": mlp, "loss": loss, "lora": lora,
                "offload_checkpoints": offload_checkpoints, "strict": strict}
    for name, value in switches.items():
        if not isinstance(value, bool):  # "no" would be truthy
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if tile_mlp is not None:
        check_tile_tokens(tile_mlp, "tile_mlp")
    hf = _hf_model(model)
    model_type = getattr(hf.config, "model_type", None)
    if strict or model_type in FAMILIES:
        family = family_for(model_type)
    else:
        if _MODEL_ATTR in hf.__dict__:
            unpatch(model)
        _not_covered(hf, model_type)
        return model
    if _MODEL_ATTR in hf.__dict__:
        unpatch(model)
    modeling = importlib.import_module(family.modeling_module)
    norm_cls = getattr(modeling, family.norm_class) if family.norm_class else None
    attention_cls = getattr(modeling, family.attention_class)
    # None: no dense MLP (Mixtral has no such class; gpt-oss's GptOssMLP is its MoE block, mlp "none")
    mlp_cls = getattr(modeling, family.mlp_class, None) if family.mlp_class else None
    experts_cls = getattr(modeling, family.experts_class) if family.experts_class else None
    act_name = getattr(hf.config, family.activation_attr, None)
    activation = ACTIVATIONS.get(act_name) if family.mlp not in ("plain", "none") else None
    use_rope = rope and family.rope_fused

    counts = collections.Counter()
    left: dict[str, str] = {}
    attention_bound = False
    for name, module in hf.named_modules():
        if experts_cls is not None and mlp:
            _bind_experts(name, module, experts_cls, family, hf.config, counts, left)
        kind = type(module)
        if kind not in (norm_cls, attention_cls, mlp_cls):
            continue
        if _foreign_forward(module):
            left[name] = "has an instance-level forward (e.g. an accelerate hook): kept"
            continue
        if kind is norm_cls and rms_norm:
            _bind(module, ModuleState("rms_norm", family))
            counts["rms_norm"] += 1
        elif kind is attention_cls and (use_rope or lora):
            _bind(module, ModuleState("attention", family, rope=use_rope, lora=lora))
            counts["rope"] += int(use_rope)
            attention_bound = True
        elif kind is mlp_cls and ((mlp and family.mlp != "plain") or lora):
            if _zero_width(module, family):
                left[name] = "a projection with no rows or columns (e.g. Qwen2-MoE without a shared expert): kept"
                continue
            use_mlp = mlp and activation is not None
            if mlp and activation is None and family.mlp != "plain":
                left[name] = f"activation {act_name!r} has no fused op: HF's activation kept"
            _bind(module, ModuleState("mlp", family, mlp=use_mlp, lora=lora, activation=activation))
            counts["mlp"] += int(use_mlp)
        if kind in (attention_cls, mlp_cls) and lora:
            _count_lora(name, module, family, counts, left, mlp_fused=mlp and activation is not None)
    wrapper = hf.__dict__.get("forward") if _foreign_forward(hf) else None
    loss_runs = "HF's loss_function on full logits (loss kind off)"
    if wrapper is not None and not loss:
        loss_runs = f"the instance forward {forward_name(wrapper)}'s own loss (loss kind off)"
    if loss:
        head = getattr(hf, "lm_head", None)
        if head is None or not hasattr(hf, hf.base_model_prefix):
            left["<causal lm>"] = f"{type(hf).__name__} has no lm_head/base model: HF's forward kept"
            loss_runs = "HF's loss_function on full logits (no lm_head/base model)"
        elif ((family.logits_divisor_attr or family.logits_multiplier_attr)
              and getattr(getattr(head, "base_layer", head), "bias", None) is not None):
            left["<causal lm>"] = "lm_head has a bias and the logits are scaled: HF's forward kept"
            loss_runs = "HF's loss_function on full logits (biased lm_head under a logits scale)"
        elif wrapper is not None and not holds_leantune(wrapper, hf):
            left["<causal lm>"] = "has an instance-level forward: HF's loss kept"
            loss_runs = f"the instance forward {forward_name(wrapper)}'s own loss"
        else:
            state = ModuleState("causal_lm", family, loss=True)
            if wrapper is None:
                _bind(hf, state)
                loss_runs = LEANTUNE_FORWARD_LOSS
            else:  # e.g. TRL's fused LM head around a forward patched earlier: the state revives the one inside
                bind(hf, state)
                loss_runs = getattr(wrapper, LOSS_HEAD_ATTR, None) or (
                    f"the instance forward {forward_name(wrapper)}, around leantune's causal-LM forward: "
                    "ops.linear_cross_entropy only where it calls that forward")
            counts["loss"] = 1
            install_mask_dispatchers()
            if type(hf.lm_head) is not nn.Linear:
                left["lm_head"] = f"{type(hf.lm_head).__name__}: logits formed, loss from ops.cross_entropy"
    hf.__dict__[_MODEL_ATTR] = (family.name, use_rope and counts["rope"] > 0)
    if tile_mlp is not None:  # after the MLP forwards are bound: it tiles whichever forward the module has
        enable_tiled_mlp(model, tile_tokens=tile_mlp)
        if family.experts is not None:  # the experts blocks keep their memory: say so, the summary and a warning
            left["<experts blocks>"] = ("not tiled: tile_mlp tiles dense MLP blocks only (a shared expert is one); "
                                        "the routed experts run over all tokens at once")
            warnings.warn(f"leantune.patch: tile_mlp={tile_mlp} does not tile {family.name}'s MoE experts blocks "
                          "(dense MLP blocks only): their activation memory is not reduced", UserWarning,
                          stacklevel=2)
    if offload_checkpoints:
        enable_offloaded_checkpoints(model)
    # as of this call: the sinks' kernel follows the implementation at each forward (set_attn_implementation later
    # changes what runs, not this summary)
    attn_implementation = getattr(hf.config, "_attn_implementation", None)
    summary = {
        "family": family.name,
        "counts": {k: counts[k] for k in _COUNTS},
        "off": [k for k, on in zip(KINDS, (rms_norm, rope, mlp, loss, lora)) if not on],
        "fused": (_fused_parts(family, activation, attn_implementation, counts, attention_bound)
                  + ([_DORA_NOTE] if counts["dora"] else [])),
        "kept": family.kept(attn_implementation),
        "offload_checkpoints": offload_checkpoints,
        "tile_mlp": tile_mlp,
        "loss_runs": loss_runs,
        "unpatched": left,
        "quantized": quantized_counts(model),  # these two re-read at each access (PatchSummary)
    }
    hf.__dict__[SUMMARY_ATTR] = PatchSummary(hf, summary)
    logger.info("leantune.patch(%s): %s", type(hf).__name__, _describe(summary))
    return model


def _zero_width(mlp, family) -> bool:
    """Whether one of the MLP's projections has 0 output or input features (HF's forward then runs it)."""
    projections = (getattr(mlp, name, None) for name in family.mlp_projections)
    return any(getattr(p, attr, 1) == 0 for p in projections for attr in ("in_features", "out_features"))


def _bind_experts(name, module, experts_cls, family, config, counts, left) -> None:
    """Bind the experts forward on the outermost module at ``module.experts`` (a PEFT ParamWrapper chain or the
    experts module itself, :mod:`.experts`)."""
    child = module.__dict__.get("_modules", {}).get("experts")
    if child is None or float_class(experts_base(child)) is not experts_cls:
        return
    where = f"{name}.experts" if name else "experts"
    if _foreign_forward(child):
        left[where] = "has an instance-level forward (e.g. an accelerate hook): kept"
        return
    if experts_activation(experts_base(child), config, family) is None:
        left[where] = f"activation {getattr(config, family.activation_attr, None)!r} has no fused op: HF's experts"
        return
    _bind(child, ModuleState("experts", family))
    counts["experts"] += 1
    weights, reason = experts_status(child, family)
    if weights is None:
        left[where] = f"PEFT's / HF's experts forward kept: {reason}"
    elif any(w.lora_A is not None for w in weights):
        counts["experts_lora"] += 1


def _not_covered(hf: nn.Module, model_type) -> None:
    """The warning path: ``hf`` stays on HF's forwards; the warning and the summary name what is missing."""
    layers = _decoder_layer_parts(hf)
    missing = NOT_COVERED.get(model_type, "no row in leantune.patch.families describes its decoder layer")
    reason = f"model_type {model_type!r} not covered: {missing}" + (f" (its layer holds {layers})" if layers else "")
    warnings.warn(f"leantune.patch: {reason}; the model runs unpatched on HF's forwards, offload_checkpoints and "
                  f"tile_mlp not applied (supported: "
                  f"{', '.join(sorted(FAMILIES))}; strict=True raises instead)", UserWarning, stacklevel=3)
    hf.__dict__[SUMMARY_ATTR] = {
        "family": None, "counts": dict.fromkeys(_COUNTS, 0),
        "off": list(KINDS), "fused": [], "kept": {"<model>": reason}, "offload_checkpoints": False,
        "tile_mlp": None, "loss_runs": "HF's forward (model type not covered)", "unpatched": {"<model>": reason},
        "quantized": quantized_counts(hf),
    }


def _decoder_layer_parts(hf: nn.Module) -> str:
    """The first decoder layer's class and the module classes directly inside it, e.g. ``Qwen3MoeDecoderLayer:
    Qwen3MoeAttention, Qwen3MoeRMSNorm, Qwen3MoeSparseMoeBlock`` (what a new family row would have to describe)."""
    layers = getattr(hf.config, "num_hidden_layers", None)
    for module in hf.modules():  # the decoder stack: the first ModuleList with one entry per layer
        if isinstance(module, nn.ModuleList) and len(module) and len(module) == layers:
            return f"{type(module[0]).__name__}: " + ", ".join(sorted({type(c).__name__ for c in module[0].children()}))
    return ""


_DORA_NOTE = ("DoRA fused: q/k/v through ops.lora_qkv, the gated MLP through ops.lora_mlp (their DoRA nodes; a "
              "fused gate_up_proj one projection at a time), o_proj and the rest through ops.dora_linear; magnitude "
              "and ||W + sBA|| rows formed once per call; DoRA with lora_dropout in training keeps PEFT's forward")


def _fused_parts(family: Family, activation: str | None, attn_implementation: str | None, counts,
                 attention_bound: bool) -> list[str]:
    """What of the family's layers runs leantune's ops as patched (``counts``: the patch's; a part with none left out,
    e.g. with its kind off, without PEFT or with no dense MLP); ``kept`` lists what keeps HF's forward."""
    parts = []
    if counts["rms_norm"]:
        parts.append(f"RMSNorm (casting {family.norm_casting}, offset {family.norm_offset:g})"
                     + (f", incl. {family.qk_norm} q/k norms" if family.qk_norm else ""))
    if counts["rope"]:
        parts.append("RoPE: ops.rope " + ("on the whole head (cos/sin given per frequency, widened to [cos, cos])"
                                          if family.rope == "half_freqs" else
                                          "(partial rotary where cos is narrower than a head)")
                     + (", skipped on layers without RoPE" if family.rope_if else ""))
    if counts["lora"]:
        qkv = "qkv_proj LoRA: ops.lora_linear" if family.qkv == "fused" else "q/k/v LoRA: ops.lora_qkv"
        parts.append((qkv + "; " if counts["lora_qkv"] else "") + "other LoRA projections: ops.lora_linear")
    if family.attention_sinks_attr and attention_bound and attn_implementation in SINK_IMPLEMENTATIONS:
        parts.append(f"attention with sinks ({family.attention_sinks_attr}): ops.sink_attention (SDPA, the sink as "
                     f"an extra key; HF's mask for each layer type) instead of HF's {attn_implementation} function")
    if counts["lora_mlp"]:
        fused = " (gate_up_proj split by rows; per projection when LoRA dropout is on in training)" \
            if family.mlp == "gated_fused" else ""
        parts.append(f"MLP: ops.lora_mlp / {activation}{fused}")
    elif counts["mlp"]:
        parts.append(f"MLP activation: ops.{activation} between the projections")
    if counts["experts"]:
        parts.append(f"MoE experts: ops.moe_experts ({family.experts}, gate/up "
                     f"{'interleaved' if family.experts_interleaved else 'halves'}; tokens grouped by expert on the "
                     "device, LoRA on gate_up_proj / down_proj as per-expert low-rank products, W + BA never "
                     "formed; NF4 stacks from leantune.quantize dequantised inside the op); router, shared expert "
                     "and aux loss: HF's")
    if counts["loss"]:
        scaled = family.logits_divisor_attr or family.logits_multiplier_attr
        parts.append("loss: ops.linear_cross_entropy" + (" on the hidden states scaled as the logits" if scaled else "")
                     + (" with the final-logit softcap" if family.final_softcap_attr else ""))
    return parts


def _count_lora(name: str, module: nn.Module, family: Family, counts, left, *, mlp_fused: bool) -> None:
    fused, dora = [], []
    for proj in family.projections:
        child = getattr(module, proj, None)
        if child is None:
            continue
        weights, _, _, reason = lora_status(child)
        if weights is not None and weights.lora_A is not None:
            fused.append(proj)
            if is_dora(weights):
                dora.append(proj)
        elif hasattr(child, "lora_A"):  # a PEFT layer the fused ops cannot reproduce exactly
            left[f"{name}.{proj}"] = f"PEFT's forward kept: {reason}"
    counts["lora"] += len(fused)
    counts["dora"] += len(dora)
    counts["lora_qkv"] += int(any(p in fused for p in ("q_proj", "k_proj", "v_proj", "qkv_proj")))
    # a fused gate_up_proj with DoRA runs one projection at a time (blocks._gated)
    grouped = [p for p in fused if p not in dora] if family.mlp == "gated_fused" else fused
    counts["lora_mlp"] += int(mlp_fused and family.mlp != "plain"
                              and all(p in grouped for p in family.mlp_projections))


def _describe(summary) -> str:
    parts = [f"{k}={v}" for k, v in summary["counts"].items()] + [f"loss runs: {summary['loss_runs']}"]
    if summary["off"]:
        parts.append("off: " + ", ".join(summary["off"]))
    if summary["unpatched"]:
        items = list(summary["unpatched"].items())
        shown = "; ".join(f"{k}: {v}" for k, v in items[:5])
        parts.append(f"unpatched ({len(items)}): {shown}" + (" ..." if len(items) > 5 else ""))
    return ", ".join(parts)


def unpatch(model):
    """Undo :func:`patch` on ``model`` (instance forwards removed, RoPE dispatcher released); returns ``model``.

    Args:
        model: the model given to :func:`patch` (a transformers causal LM or a PEFT wrapper of one).

    Returns:
        ``model``, with HF's own forwards (and PEFT's) again; harmless on a model that was never patched. A wrapper
        that still holds one of leantune's forwards (TRL's fused LM head) then reaches HF's forward through it, and a
        later :func:`patch` revives it. A model that was patched keeps a ``leantune_summary`` saying it is unpatched
        (no counts, ``loss_runs`` naming ``leantune.unpatch``).

    Raises:
        ValueError: ``model`` is neither a transformers model nor a PEFT wrapper of one.
    """
    hf = _hf_model(model)
    disable_tiled_mlp(model)  # before unbinding: a tiled forward wraps the bound one
    disable_offloaded_checkpoints(model)
    for module in hf.modules():
        if STATE_ATTR in module.__dict__:
            unbind(module)
    was_patched = hf.__dict__.pop(_MODEL_ATTR, None) is not None
    if was_patched or SUMMARY_ATTR in hf.__dict__:
        # the summary stays readable and says so (reading it raised AttributeError before)
        hf.__dict__[SUMMARY_ATTR] = {
            "family": None, "counts": dict.fromkeys(_COUNTS, 0),
            "off": list(KINDS), "offload_checkpoints": False, "tile_mlp": None,
            "loss_runs": "not leantune's: the model is unpatched (leantune.unpatch)",
            "unpatched": {"model": "leantune.unpatch"}, "quantized": quantized_counts(hf),
        }
    return model


def is_patched(model) -> bool:
    """True when ``model`` (or the transformers model inside a PEFT wrapper) is patched."""
    return _MODEL_ATTR in _hf_model(model).__dict__


__all__ = ["FAMILIES", "KINDS", "Family", "family_for", "is_patched", "patch", "unpatch"]
