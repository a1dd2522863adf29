"""The family table: what differs between the supported transformers model families, as data.

Every family runs the same replacement forwards (:mod:`leantune.patch.forwards`); a row here says which HF classes
to patch and the few numbers and switches that differ. A new family that differs only in data is one new row.

Sources (transformers 5.17, ``models/<family>/modeling_<family>.py``):
- RMSNorm casting: Llama/Mistral/Qwen2/Qwen3 ``weight * x_hat.to(dtype)``; Gemma2/Gemma3 ``(x_hat * (1 + w)).to(dtype)``
  (HF PR 29402). The epsilon lives in ``variance_epsilon`` (Llama style) or ``eps`` (Gemma style).
- GLU activation: ``config.hidden_act`` (Llama style) or ``config.hidden_activation`` (Gemma); ``silu`` -> SwiGLU,
  ``gelu_pytorch_tanh`` -> GeGLU with tanh GELU, ``gelu`` -> GeGLU with erf GELU.
- Final-logit softcap: Gemma2/Gemma3 ``config.final_logit_softcapping`` (Gemma2 default 30; None disables).
- Attention-logit softcap passed to the attention kernel: Gemma2 only (Gemma3 keeps the attribute but does not pass it).
- Sliding window passed to the attention kernel: Mistral reads ``config.sliding_window``; Qwen2/Qwen3/Gemma2/Gemma3 the
  per-layer ``module.sliding_window``; Llama passes none.
- q/k RMSNorm on the head dim before RoPE: Qwen3, Gemma3.
- Gemma's embedding scale sqrt(H) and Qwen2's q/k/v bias need no entry: the embedding (or base-model forward) HF already
  runs keeps the scale, and the bias is read from each projection.
"""

from __future__ import annotations

import dataclasses

ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu_tanh", "gelu": "geglu_erf"}


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the table; ``prefix`` names the HF classes ``{prefix}RMSNorm``, ``{prefix}Attention`` and
    ``{prefix}MLP``."""

    name: str
    modeling_module: str
    prefix: str
    norm_casting: str = "llama"  # ops.rms_norm casting
    norm_offset: float = 0.0  # 1.0 for Gemma's (1 + w)
    norm_eps_attr: str = "variance_epsilon"
    activation_attr: str = "hidden_act"  # config attribute naming the GLU activation
    final_softcap_attr: str | None = None  # config attribute of the final-logit softcap
    sliding_window: str | None = None  # None (not passed), "config" or "module": where the attention reads it
    attn_softcap: bool = False  # passes module.attn_logit_softcapping to the attention kernel
    qk_norm: bool = False  # RMSNorm q_norm / k_norm on the head dim before RoPE

    @property
    def norm_class(self) -> str:
        return f"{self.prefix}RMSNorm"

    @property
    def attention_class(self) -> str:
        return f"{self.prefix}Attention"

    @property
    def mlp_class(self) -> str:
        return f"{self.prefix}MLP"


_GEMMA = {
    "norm_casting": "gemma", "norm_offset": 1.0, "norm_eps_attr": "eps", "activation_attr": "hidden_activation",
    "final_softcap_attr": "final_logit_softcapping", "sliding_window": "module",
}

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "transformers.models.llama.modeling_llama", "Llama"),
    "mistral": Family("mistral", "transformers.models.mistral.modeling_mistral", "Mistral", sliding_window="config"),
    "qwen2": Family("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2", sliding_window="module"),
    "qwen3": Family("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3", sliding_window="module",
                    qk_norm=True),
    "gemma2": Family("gemma2", "transformers.models.gemma2.modeling_gemma2", "Gemma2", attn_softcap=True, **_GEMMA),
    "gemma3_text": Family("gemma3_text", "transformers.models.gemma3.modeling_gemma3", "Gemma3", qk_norm=True,
                          **_GEMMA),
}


def family_for(model_type: str) -> Family:
    """The table row for ``config.model_type``.

    Raises:
        ValueError: the model type is not in the table (the message lists the supported ones).
    """
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"leantune.patch does not support model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None
