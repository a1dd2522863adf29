"""leantune's ops: one file per op, each with a Triton path (CUDA, or CPU through the interpreter) and a torch path.

The signatures and semantics are fixed by docs/design.md, "Public op contract". Every backward is derived by hand and
is once-differentiable: first gradients work under ``create_graph=True``, a gradient of a gradient raises
RuntimeError ("trying to differentiate twice") rather than silently dropping the second-order terms.

``backend(device)`` names the implementation the ops pick for tensors on a device and ``backend_choice()`` the
validated ``LEANTUNE_BACKEND`` setting, so callers (the CLI) check the setting up front without private names.
"""

from ._loss import deferred_error_flags, raise_deferred_errors
from ._runtime import backend, backend_choice
from .cross_entropy import cross_entropy
from .distillation import linear_distillation_loss
from .fp8 import FP8Weight, dequantize_blocks, dequantize_fp8, fp8_gemms, quantize_fp8, requantize_blocks
from .glu import geglu, swiglu
from .linear_cross_entropy import linear_cross_entropy
from .log_probs import linear_log_probs
from .lora import DoraWeights, LoraWeights, dora_linear, lora_linear, lora_mlp, lora_qkv
from .moe import ExpertWeights, moe_experts
from .nf4 import NF4Weight, dequantize_nf4, quantize_nf4
from .nf4_fp8 import dequantize_nf4_fp8, with_fp8_compute
from .rms_norm import rms_norm
from .rope import rope
from .sink_attention import sink_attention

__all__ = [
    "DoraWeights",
    "ExpertWeights",
    "FP8Weight",
    "LoraWeights",
    "NF4Weight",
    "backend",
    "backend_choice",
    "cross_entropy",
    "deferred_error_flags",
    "dora_linear",
    "dequantize_blocks",
    "dequantize_fp8",
    "dequantize_nf4",
    "dequantize_nf4_fp8",
    "fp8_gemms",
    "geglu",
    "linear_cross_entropy",
    "linear_distillation_loss",
    "linear_log_probs",
    "lora_linear",
    "lora_mlp",
    "lora_qkv",
    "moe_experts",
    "quantize_fp8",
    "requantize_blocks",
    "quantize_nf4",
    "raise_deferred_errors",
    "rms_norm",
    "rope",
    "sink_attention",
    "swiglu",
    "with_fp8_compute",
]
