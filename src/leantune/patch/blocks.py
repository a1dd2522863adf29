"""The attention and MLP forwards :func:`leantune.patch` binds, built from the family row's structure fields
(:class:`~leantune.patch.families.Family`): they switch on what a layer is made of (fused or separate projections,
QK-norm placement, RoPE style and per-layer switch, gated or plain MLP), never on a family's name.

Both mirror HF's forwards of transformers 5.17 (``models/<family>/modeling_<family>.py``: e.g. ``Qwen3Attention``,
``Phi3Attention``, ``Olmo2Attention``, ``HunYuanDenseV1Attention``, ``Phi3MLP``, ``ArceeMLP``) operation for
operation, with the LoRA projections through ``ops.lora_qkv`` / ``ops.lora_mlp`` / ``ops.lora_linear`` (exactly where
:mod:`.lora_status` says those reproduce PEFT's forward; PEFT's forward otherwise). On an FP8 base q/k/v and gate/up
take the e4m3 codes their input's RMSNorm wrote (:mod:`.fp8_inputs`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .. import ops
from . import fp8_inputs
from ._common import call_original, hf_rope, reset_rope_active, rotate, served, set_rope_active
from .families import SINK_IMPLEMENTATIONS, Family
from .lora_status import fusable, fused_group, lora_status, project
from .recompute import in_checkpoint_recompute


# ------------------------------------------------------------------------------------------------------------ MLP
def _glu(gate, up, activation: str):
    if activation == "swiglu":
        return ops.swiglu(gate, up)
    return ops.geglu(gate, up, approximate="tanh" if activation == "geglu_tanh" else "none")


def _split_rows(weights: ops.LoraWeights):
    """A fused ``gate_up_proj`` (weight ``[2I, H]``, gate rows first as HF's ``chunk(2, -1)`` reads them) as two
    LoraWeights sharing ``lora_A``; None for a weight that cannot be sliced (NF4)."""
    weight, lora_a, lora_b, scaling, bias = weights
    if not torch.is_tensor(weight) or weight.shape[0] % 2:
        return None
    rows = weight.shape[0] // 2

    def half(t, i):
        return None if t is None else t[i * rows:(i + 1) * rows]

    return [ops.LoraWeights(half(weight, i), lora_a, half(lora_b, i), scaling, half(bias, i)) for i in (0, 1)]


def mlp_forward(self, x):
    """The family's MLP block. Gated (``down(act(gate(x)) * up(x))``, with ``gate_up_proj`` chunked when fused):
    ``ops.lora_mlp`` when every projection carries fusable LoRA (and the MLP kind is on), else per projection
    (``ops.lora_linear`` where fusable) around ``ops.swiglu``/``ops.geglu``. Plain (``down(act(up(x)))``): HF's
    activation module between the projections. Then the family's residual dropout, if any."""
    if not served(x):
        return call_original(self, x)
    state = self._leantune
    family = state.family
    modules = [getattr(self, name) for name in family.mlp_projections]
    # each projection's PEFT state read once per forward (it may change between forwards: set_adapter, merge)
    statuses = [lora_status(m) for m in modules] if state.lora else [None] * len(modules)
    if family.mlp == "plain":
        up, down = modules
        out = project(down, getattr(self, family.act_fn_attr)(project(up, x, statuses[0])), statuses[1])
    else:
        out = _gated(self, state, family, x, modules, statuses)
    if family.residual_dropout_attr is not None:  # HF's call, after the down projection
        out = F.dropout(out, p=getattr(self, family.residual_dropout_attr), training=self.training)
    return out


def _gated(self, state, family: Family, x, modules, statuses):
    if state.lora and state.mlp:
        # DoRA through lora_mlp's DoRA node, except a fused gate_up_proj (split below into LoraWeights halves): one
        # projection at a time there
        group = fused_group(statuses, dora=family.mlp != "gated_fused")
        if group is not None:
            weights, p, training = group
            if family.mlp == "gated_fused":
                # PEFT drops gate_up's input once; lora_mlp draws one mask per projection: split only without dropout
                split = _split_rows(weights[0]) if p == 0.0 or not training else None
                weights = None if split is None else [*split, weights[1]]
            if weights is not None:
                # in a checkpointed layer's recomputation the MLP output goes only to the residual add (whose result
                # is thrown away): the op saves what backward needs without forming it (down's GEMM skipped)
                output = not (family.mlp_output_to_residual and not (self._forward_hooks or self._forward_pre_hooks)
                              and in_checkpoint_recompute())
                return ops.lora_mlp(x, *weights, activation=state.activation, dropout=p, training=training,
                                    x_quantized=fp8_inputs.take(x, weights[:2]), output=output)
    if family.mlp == "gated_fused":
        gate, up = project(modules[0], x, statuses[0]).chunk(2, dim=-1)
    else:
        gate, up = project(modules[0], x, statuses[0]), project(modules[1], x, statuses[1])
    hidden = _glu(gate, up, state.activation) if state.mlp else getattr(self, family.act_fn_attr)(gate) * up
    return project(modules[-1], hidden, statuses[-1])


# ------------------------------------------------------------------------------------------------------ attention
def attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                      **kwargs):
    """The family's attention with ``ops.rope`` (when the rope kind is on and the family rotates split halves).
    When any projection carries fusable LoRA, leantune's copy of the attention runs (``ops.lora_qkv`` for separate
    q/k/v when all three can be served in one call, ``ops.lora_linear`` per projection otherwise, a fused
    ``qkv_proj`` included), handing the rope kind to the rotation; else HF's own forward runs, with the rope kind in
    the flag its ``apply_rotary_pos_emb`` (leantune's dispatcher) reads. Under torch.compile the copy also serves an
    attention without fusable LoRA whose rope kind is on (projections then through their own modules): the flag is
    a mutation, which torch 2.11 cannot trace inside a checkpointed layer (see :mod:`._common`). A family with
    attention sinks under the eager or sdpa implementation always runs the copy, whose kernel is then
    ``ops.sink_attention`` (SDPA with the sinks) instead of HF's attention function (:func:`sinks_served`)."""
    if not served(hidden_states):  # HF's own function then serves the rotation too
        return call_original(self, hidden_states, position_embeddings=position_embeddings,
                             attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
    state = self._leantune
    kind = state.family.rope if state.rope else False  # "half" / "half_freqs" (ops.rope) or False (HF's function)
    projections = [getattr(self, name) for name in state.family.attention_projections]
    # each projection's PEFT state read once per forward; None: LoRA fusion off
    statuses = [lora_status(m) for m in projections] if state.lora else [None] * len(projections)
    compiling = torch.compiler.is_compiling()
    # a family with sinks under eager/sdpa always takes the copy: it runs ops.sink_attention, not HF's function
    if (any(s is not None and fusable(s) for s in statuses) or (kind and compiling)
            or sinks_served(self, state.family)):
        return _fused_attention(self, state.family, kind, statuses, hidden_states, position_embeddings,
                                attention_mask, past_key_values, **kwargs)
    if compiling:  # kind is False here, and the dispatcher reads no flag while tracing: HF's function
        return call_original(self, hidden_states, position_embeddings=position_embeddings,
                             attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
    token = set_rope_active(kind)
    try:
        return call_original(self, hidden_states, position_embeddings=position_embeddings,
                             attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
    finally:
        reset_rope_active(token)


def sinks_served(module, family: Family) -> bool:
    """Whether a patched attention of ``family`` runs ``ops.sink_attention`` (sinks through SDPA) instead of HF's
    attention function: the family has sinks and the model's attention implementation is eager or sdpa, and the
    config does not ask for attention weights (``output_attentions``: the op forms none; HF's eager returns them).
    A per-call ``output_attentions=True`` is not seen here: the op then returns no weights."""
    return (family.attention_sinks_attr is not None
            and getattr(module.config, "_attn_implementation", None) in SINK_IMPLEMENTATIONS
            and not getattr(module.config, "output_attentions", False))


def _qkv(self, family: Family, statuses, hidden_states):
    if family.qkv == "fused":  # Phi3Attention: [q | k | v] along the output features
        qkv = project(self.qkv_proj, hidden_states, statuses[0])
        q_size = self.config.num_attention_heads * self.head_dim
        kv_size = self.config.num_key_value_heads * self.head_dim
        return qkv.split([q_size, kv_size, kv_size], dim=-1)
    group = fused_group(statuses[:3], dora=True) if all(s is not None for s in statuses[:3]) else None
    if group is not None:
        (q_w, k_w, v_w), p, training = group
        return ops.lora_qkv(hidden_states, q_w, k_w, v_w, dropout=p, training=training,
                            x_quantized=fp8_inputs.take(hidden_states, (q_w, k_w, v_w)))
    # e.g. only o_proj fusable, or q/k/v with different dropout: one projection at a time
    return tuple(project(m, hidden_states, status)
                 for m, status in zip((self.q_proj, self.k_proj, self.v_proj), statuses))


def _fused_attention(self, family: Family, kind, statuses, hidden_states, position_embeddings, attention_mask,
                     past_key_values, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[family.modeling_module]  # its classes built the model (import_module breaks the graph)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = _qkv(self, family, statuses, hidden_states)
    q_norm, k_norm = (getattr(self, name) for name in family.qk_norm_names) if family.qk_norm else (None, None)
    if family.qk_norm == "width":  # OLMo 2/3: over all heads of the projection, before the head split
        query, key = q_norm(query), k_norm(key)
    clip = getattr(self.config, family.qkv_clip_attr, None) if family.qkv_clip_attr else None
    if clip is not None:  # OLMoE's clip_qkv (HF: clamp_ in place, same values and gradients)
        query, key, value = (t.clamp(min=-clip, max=clip) for t in (query, key, value))
    query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
    if family.qk_norm == "head":
        query, key = q_norm(query), k_norm(key)  # on the head dim: same before or after the transpose
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if family.rope_if is None or family.rope_if(self):
        cos, sin = position_embeddings
        query, key = rotate(kind, hf_rope(modeling.apply_rotary_pos_emb), query, key, cos, sin)
    if family.qk_norm == "head_after_rope":
        query, key = q_norm(query), k_norm(key)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      modeling.eager_attention_forward)
    extra = {}
    if family.sliding_window == "config":
        extra["sliding_window"] = getattr(self.config, "sliding_window", None)
    elif family.sliding_window == "module":
        extra["sliding_window"] = self.sliding_window
    elif family.sliding_window == "module_if_sliding":
        extra["sliding_window"] = self.sliding_window if self.is_sliding else None
    if family.attn_softcap:
        extra["softcap"] = self.attn_logit_softcapping
    dropout = 0.0 if not self.training else self.attention_dropout
    if sinks_served(self, family):
        # HF's eager function would form [B, H, S, S] scores (and probabilities) in the attention dtype; the mask is
        # the one HF built for this layer's type (window included), so the window is passed only for a None mask
        attn_output, attn_weights = ops.sink_attention(
            query, key, value, getattr(self, family.attention_sinks_attr), scaling=self.scaling,
            attention_mask=attention_mask, sliding_window=extra.get("sliding_window"), dropout_p=dropout), None
    else:
        if family.attention_sinks_attr is not None:  # HF's kwarg name; its attention function applies them
            extra["s_aux"] = getattr(self, family.attention_sinks_attr)
        attn_output, attn_weights = interface(self, query, key, value, attention_mask, dropout=dropout,
                                              scaling=self.scaling, **extra, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    out = project(self.o_proj, attn_output, statuses[-1])
    if family.residual_dropout_attr is not None:
        out = F.dropout(out, p=getattr(self, family.residual_dropout_attr), training=self.training)
    return out, attn_weights
