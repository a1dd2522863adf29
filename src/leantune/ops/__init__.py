"""leantune's ops: one file per op, each with a Triton path (CUDA, or CPU through the interpreter) and a torch path.

The signatures and semantics are fixed by DESIGN.md's public API contract.
"""

from .cross_entropy import cross_entropy
from .glu import geglu, swiglu
from .linear_cross_entropy import linear_cross_entropy
from .lora import LoraWeights, lora_linear, lora_mlp, lora_qkv
from .rms_norm import rms_norm
from .rope import rope

__all__ = [
    "LoraWeights",
    "cross_entropy",
    "geglu",
    "linear_cross_entropy",
    "lora_linear",
    "lora_mlp",
    "lora_qkv",
    "rms_norm",
    "rope",
    "swiglu",
]
