"""The family table: what a decoder layer of each supported transformers model type is made of, as data.

Every family runs the same replacement forwards (:mod:`leantune.patch.forwards`, :mod:`leantune.patch.blocks`); a
row says which HF classes to patch and how their parts are built. The decoder layer itself always keeps HF's
forward: it calls the patched norm, attention and MLP modules, so norm placement (pre-norm, OLMo 2/3 and EXAONE 4
post-norm, Gemma 2/3 and GLM-4 sandwich norms) and Granite's ``residual_multiplier`` need no entry. A new family that
is built from parts already described is one new row; a part that no field describes keeps HF's forward (the row
says so and ``leantune_summary`` reports it).

Sources (transformers 5.17, ``models/<family>/modeling_<family>.py``):
- RMSNorm casting: ``weight * x_hat.to(dtype)`` ("llama": Llama, Mistral, Qwen2/3, Phi-3, Granite, GLM, SmolLM3, ...);
  ``(weight.float() * x_hat).to(dtype)`` (Helium, OLMo 2/3, gpt-oss: "gemma" with offset 0); Gemma 1/2/3
  ``(x_hat * (1 + w.float())).to(dtype)`` ("gemma", offset 1, HF PR 29402). Epsilon in ``variance_epsilon`` or
  ``eps``. LayerNorm models (Starcoder2) keep HF's norm.
- GLU activation: ``config.hidden_act`` (or Gemma 2/3's ``hidden_activation``); ``silu`` -> SwiGLU,
  ``gelu_pytorch_tanh`` -> GeGLU with tanh GELU, ``gelu`` -> GeGLU with erf GELU.
- MLP kinds: "gated" (gate_proj/up_proj/down_proj), "gated_fused" (Phi-3, GLM, GLM-4: ``gate_up_proj`` whose output
  is chunked gate-first), "plain" (up/down with HF's activation module: Arcee relu2, Apertus xIELU, Starcoder2),
  "none" (no dense MLP: gpt-oss's ``GptOssMLP`` is the MoE block, router + experts, only its experts are patched).
- Attention: "separate" q/k/v projections or one "fused" ``qkv_proj`` split [q, k, v] (Phi-3). QK-norm on the head
  dim before RoPE (Qwen3, Gemma3, Apertus, EXAONE 4), after RoPE (HunYuan dense: ``query_layernorm``), or over the
  whole projection width before the head split (OLMo 2/3).
- RoPE: "half" is the split-halves rotation ``ops.rope`` computes, on the first ``cos.shape[-1]`` dims (partial
  rotary: Phi-3); "half_freqs" is the same rotation of the whole head with cos/sin given once per frequency (width
  head_dim / 2, not duplicated: gpt-oss's ``GptOssRotaryEmbedding`` returns ``freqs.cos()`` and ``_apply_rotary_emb``
  forms ``x1 cos - x2 sin, x2 cos + x1 sin`` on the halves), widened to ``[cos, cos]`` for ``ops.rope``;
  "interleaved" rotates adjacent pairs (GLM, GLM-4, Helium, ERNIE 4.5): HF's function is kept.
  ``rope_if``: layers without RoPE (SmolLM3 ``use_rope`` from ``no_rope_layers``; EXAONE 4 rotates only sliding
  layers when a window is set).
- Sliding window passed to the attention kernel: "config" (``config.sliding_window``: Mistral, Phi-3, Starcoder2),
  "module" (``module.sliding_window``), "module_if_sliding" (EXAONE 4: the window only where ``is_sliding``).
- Attention sinks (``attention_sinks_attr``, gpt-oss ``sinks``: one learned logit per head in the softmax
  denominator): under the eager or sdpa attention implementation (``SINK_IMPLEMENTATIONS``; gpt-oss defaults to
  eager) ``ops.sink_attention`` replaces HF's attention function (SDPA with the sink as an extra key, no
  ``[B, H, S, S]`` scores), with HF's mask for the layer (none for rows without padding or cache: the causal-LM
  forward then skips transformers' masks, the op applies causality and the window); under flex / flash / hub
  kernels the sinks are passed as ``s_aux`` to HF's attention function, which applies them. The projections
  around it are fused either way.
- ``qkv_clip_attr``: OLMoE's ``config.clip_qkv`` (when not None, q, k and v are clamped to [-c, c] after the
  width QK-norm, before the head split; HF clamps in place, the fused attention out of place: same values and
  gradients).
- Attention-logit softcap: Gemma2 only. Final-logit softcap: Gemma2/3 ``final_logit_softcapping``.
- Scalars: the attention scale is always ``module.scaling`` (Granite's ``attention_multiplier``, Gemma's
  ``query_pre_attn_scalar``); Granite's ``embedding_multiplier`` is applied by the base model HF runs;
  ``logits_divisor_attr``: Granite's ``logits = lm_head(h) / logits_scaling``; ``logits_multiplier_attr``:
  HyperCLOVA X's ``lm_head(h) * logits_scaling``.
- ``residual_dropout_attr``: dropout on the attention and MLP outputs (Seed-OSS, Starcoder2).
- Mixture of experts (``experts``): the ``{Prefix}Experts`` module of the MoE block runs ``ops.moe_experts``
  (:mod:`.experts`); "swiglu" reads the family's activation (silu only: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gate/up
  halves), "clamped_swiglu" is gpt-oss's (``GptOssExperts``: transposed ``[E, in, out]`` stacks with biases,
  interleaved gate/up, ``experts_interleaved``; alpha and limit read from the module). The router (gpt-oss's with a
  bias), shared expert (Qwen2-MoE's ``shared_expert``: a gated ``{Prefix}MLP``) and aux loss keep HF's code.
  Families without a dense ``{Prefix}MLP`` class (Mixtral) simply have none to patch.
- Qwen2's and GLM's q/k/v bias and Gemma's embedding scale need no entry: the bias is read from each projection,
  the scale lives in the embedding module HF runs.
"""

from __future__ import annotations

import dataclasses

# transformers attention implementations under which leantune's sink attention (ops.sink_attention) replaces HF's
# attention function for a family with sinks; the others (flex, flash, hub kernels) apply the sinks themselves
SINK_IMPLEMENTATIONS = ("eager", "sdpa")

ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu_tanh", "gelu": "geglu_erf"}


def rope_if_use_rope(module) -> bool:
    """SmolLM3: ``use_rope`` is ``config.no_rope_layers[layer_idx]`` (1: rotate)."""
    return bool(module.use_rope)


def rope_if_sliding(module) -> bool:
    """EXAONE 4: with a window set, only sliding layers rotate; without one, every layer does."""
    return module.sliding_window is None or module.is_sliding


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the table. ``prefix`` names the HF classes ``{prefix}RMSNorm``, ``{prefix}Attention`` and
    ``{prefix}MLP`` (``norm`` False: the family's norms are not RMSNorm and keep HF's forward)."""

    name: str
    modeling_module: str
    prefix: str
    norm: bool = True
    norm_casting: str = "llama"  # ops.rms_norm casting
    norm_offset: float = 0.0  # 1.0 for Gemma's (1 + w)
    norm_eps_attr: str = "variance_epsilon"
    activation_attr: str = "hidden_act"  # config attribute naming the GLU activation
    mlp: str = "gated"  # "gated" | "gated_fused" | "plain" | "none" (the {prefix}MLP class is not a dense MLP)
    mlp_projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")  # in order (gate_up, down when fused)
    act_fn_attr: str = "act_fn"  # the MLP's HF activation module (runs when no fused GLU serves it)
    qkv: str = "separate"  # "separate" (q_proj, k_proj, v_proj) | "fused" (qkv_proj)
    qk_norm: str | None = None  # None | "head" (before RoPE) | "head_after_rope" | "width" (before the head split)
    qk_norm_names: tuple[str, str] = ("q_norm", "k_norm")
    qkv_clip_attr: str | None = None  # config attribute c: q, k, v clamped to [-c, c] after the QK-norm (OLMoE)
    # the decoder layer adds the MLP's output straight to the residual (no post-MLP norm, which would save it):
    # a checkpoint's recomputation may then skip forming it (patch.recompute)
    mlp_output_to_residual: bool = False
    rope: str = "half"  # "half" / "half_freqs" (cos per frequency): ops.rope | "interleaved": HF's function kept
    rope_if: object = None  # None (every layer rotates) or a function(attention module) -> bool
    sliding_window: str | None = None  # None (not passed) | "config" | "module" | "module_if_sliding"
    attn_softcap: bool = False  # passes module.attn_logit_softcapping to the attention kernel
    attention_sinks_attr: str | None = None  # module attribute of per-head sink logits, passed as s_aux (gpt-oss)
    final_softcap_attr: str | None = None  # config attribute of the final-logit softcap
    logits_divisor_attr: str | None = None  # config attribute dividing the logits (Granite)
    logits_multiplier_attr: str | None = None  # config attribute multiplying the logits (HyperCLOVA X)
    residual_dropout_attr: str | None = None  # module attribute: dropout p on attention / MLP outputs
    experts: str | None = None  # None (no MoE) | "swiglu" | "clamped_swiglu": {prefix}Experts -> ops.moe_experts
    experts_interleaved: bool = False  # gate/up as even/odd columns of gate_up_proj (gpt-oss), not halves

    @property
    def rope_fused(self) -> bool:
        """Whether ``ops.rope`` serves the family's rotation (the rope kind)."""
        return self.rope in ("half", "half_freqs")

    @property
    def norm_class(self) -> str | None:
        return f"{self.prefix}RMSNorm" if self.norm else None

    @property
    def attention_class(self) -> str:
        return f"{self.prefix}Attention"

    @property
    def mlp_class(self) -> str | None:
        return None if self.mlp == "none" else f"{self.prefix}MLP"

    @property
    def experts_class(self) -> str | None:
        return f"{self.prefix}Experts" if self.experts else None

    @property
    def attention_projections(self) -> tuple[str, ...]:
        return ("qkv_proj", "o_proj") if self.qkv == "fused" else ("q_proj", "k_proj", "v_proj", "o_proj")

    @property
    def projections(self) -> tuple[str, ...]:
        """Every linear projection of a decoder layer (LoRA targets)."""
        return self.attention_projections + self.mlp_projections

    def kept(self, attn_implementation: str | None = "eager") -> dict[str, str]:
        """The parts of this family's layers that keep HF's forward, and why (for ``leantune_summary``), under the
        model's attention implementation ``attn_implementation`` (the sinks' kernel depends on it)."""
        kept = {}
        if not self.norm:
            kept["norm"] = "LayerNorm, not RMSNorm: HF's forward (no fused LayerNorm op)"
        if not self.rope_fused:
            kept["rope"] = f"{self.rope} rotary pairs: HF's apply_rotary_pos_emb (ops.rope rotates split halves)"
        if self.mlp == "plain":
            kept["mlp activation"] = ("non-gated MLP: HF's activation module; its LoRA projections are fused one "
                                      "by one (ops.lora_linear)")
        if self.attention_sinks_attr and attn_implementation not in SINK_IMPLEMENTATIONS:
            kept["attention kernel"] = (f"attention sinks ({self.attention_sinks_attr}) under attention "
                                        f"implementation {attn_implementation!r}: HF's attention function (it "
                                        "applies the sinks and the sliding window; eager/sdpa would run "
                                        "ops.sink_attention); q/k/v/o LoRA, RoPE and norms around it are fused")
        return kept


def _row(model_type: str, prefix: str, module: str | None = None, **fields) -> tuple[str, Family]:
    module = module or model_type
    return model_type, Family(model_type, f"transformers.models.{module}.modeling_{module}", prefix, **fields)


_GEMMA = {"norm_casting": "gemma", "norm_offset": 1.0, "norm_eps_attr": "eps"}
_GEMMA23 = {**_GEMMA, "activation_attr": "hidden_activation", "final_softcap_attr": "final_logit_softcapping",
            "sliding_window": "module"}
_FUSED_GLU = {"mlp": "gated_fused", "mlp_projections": ("gate_up_proj", "down_proj"), "act_fn_attr": "activation_fn"}
_PLAIN = {"mlp": "plain", "mlp_projections": ("up_proj", "down_proj")}
_OLMO = {"norm_casting": "gemma", "qk_norm": "width"}
# checked in transformers 5.17's decoder layers: ``hidden_states = residual + [dropout / multiplier](mlp(...))``
_TO_RESIDUAL = {"mlp_output_to_residual": True}

FAMILIES: dict[str, Family] = dict([
    _row("llama", "Llama", **_TO_RESIDUAL),
    _row("mistral", "Mistral", sliding_window="config", **_TO_RESIDUAL),
    _row("ministral", "Ministral", sliding_window="module", **_TO_RESIDUAL),
    _row("qwen2", "Qwen2", sliding_window="module", **_TO_RESIDUAL),
    _row("qwen3", "Qwen3", sliding_window="module", qk_norm="head", **_TO_RESIDUAL),
    _row("gemma", "Gemma", **_GEMMA, **_TO_RESIDUAL),
    _row("gemma2", "Gemma2", attn_softcap=True, **_GEMMA23),
    _row("gemma3_text", "Gemma3", "gemma3", qk_norm="head", **_GEMMA23),
    _row("olmo2", "Olmo2", **_OLMO),
    _row("olmo3", "Olmo3", sliding_window="module", **_OLMO),
    _row("smollm3", "SmolLM3", sliding_window="module", rope_if=rope_if_use_rope, **_TO_RESIDUAL),
    _row("phi3", "Phi3", qkv="fused", sliding_window="config", **_FUSED_GLU, **_TO_RESIDUAL),
    _row("granite", "Granite", logits_divisor_attr="logits_scaling", **_TO_RESIDUAL),
    _row("granite_swa", "GraniteSWA", logits_divisor_attr="logits_scaling", sliding_window="module", **_TO_RESIDUAL),
    _row("hyperclovax", "HyperCLOVAX", logits_multiplier_attr="logits_scaling"),
    _row("cwm", "Cwm", sliding_window="module", **_TO_RESIDUAL),
    _row("glm", "Glm", rope="interleaved", **_FUSED_GLU, **_TO_RESIDUAL),
    _row("glm4", "Glm4", rope="interleaved", **_FUSED_GLU),
    _row("helium", "Helium", norm_casting="gemma", rope="interleaved", **_TO_RESIDUAL),
    _row("exaone4", "Exaone4", qk_norm="head", sliding_window="module_if_sliding", rope_if=rope_if_sliding),
    _row("seed_oss", "SeedOss", residual_dropout_attr="residual_dropout", **_TO_RESIDUAL),
    _row("arcee", "Arcee", **_PLAIN),
    _row("apertus", "Apertus", qk_norm="head", **_PLAIN),
    _row("hunyuan_v1_dense", "HunYuanDenseV1", qk_norm="head_after_rope",
         qk_norm_names=("query_layernorm", "key_layernorm"), **_TO_RESIDUAL),
    _row("ernie4_5", "Ernie4_5", rope="interleaved", **_TO_RESIDUAL),
    _row("qwen3_moe", "Qwen3Moe", sliding_window="module", qk_norm="head", experts="swiglu"),
    _row("qwen2_moe", "Qwen2Moe", experts="swiglu"),
    _row("mixtral", "Mixtral", sliding_window="config", experts="swiglu"),
    _row("olmoe", "Olmoe", qk_norm="width", qkv_clip_attr="clip_qkv", sliding_window="config", experts="swiglu"),
    _row("gpt_oss", "GptOss", norm_casting="gemma", rope="half_freqs", sliding_window="module",
         attention_sinks_attr="sinks", mlp="none", mlp_projections=(), experts="clamped_swiglu",
         experts_interleaved=True),
    _row("starcoder2", "Starcoder2", norm=False, mlp="plain", mlp_projections=("c_fc", "c_proj"), act_fn_attr="act",
         sliding_window="config", residual_dropout_attr="residual_dropout"),
])

# Model types known not to fit yet, and what is missing (the warning names it).
NOT_COVERED = {
    "olmo": "LayerNorm without weights and clip_qkv",
    "cohere": "LayerNorm and parallel attention/MLP blocks",
    "cohere2": "LayerNorm and parallel attention/MLP blocks",
    "phi": "LayerNorm and a parallel attention/MLP block with a dense projection",
}


def family_for(model_type: str) -> Family:
    """The table row for ``config.model_type``.

    Raises:
        ValueError: the model type is not in the table (the message lists the supported ones).
    """
    try:
        return FAMILIES[model_type]
    except KeyError:
        missing = NOT_COVERED.get(model_type, "no row in leantune.patch.families")
        raise ValueError(
            f"leantune.patch does not support model_type {model_type!r} ({missing}); supported: "
            f"{', '.join(sorted(FAMILIES))}"
        ) from None
