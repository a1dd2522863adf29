"""LoRA projections with hand-derived backward: ``lora_linear``, ``lora_qkv``, ``lora_mlp``, ``dora_linear``.

The package, read top down:

- :mod:`.api`: the public functions, their input checks and the two autograd nodes, with the derivation (forward,
  backward, what is saved, dtypes) in its docstring.
- :mod:`.passes`: the forward and backward passes of a group of projections that read one input.
- :mod:`.kernels`: the Triton kernels of the LoRA branch (dropout, low-rank add, skinny products) and launchers.
- :mod:`.dora`: DoRA (``dora_linear``, and ``lora_qkv`` with DoRA projections) through the same passes, with its
  derivation; :mod:`.dora_mlp`: ``lora_mlp``'s DoRA node.
- :mod:`.glu_lowrank`: the LoRA MLP's fused forward pass (gate/up low-rank terms added inside the GLU).
"""

from .api import LoraGroupFunction, LoraMLPFunction, LoraWeights, lora_linear, lora_mlp, lora_qkv
from .dora import DoraGroupFunction, DoraWeights, dora_linear, dora_weight_norm
from .glu_lowrank import glu_forward_lowrank
from .passes import dropout_mask, dropout_seeds

__all__ = ["DoraGroupFunction", "DoraWeights", "LoraGroupFunction", "LoraMLPFunction", "LoraWeights", "dora_linear",
           "dora_weight_norm", "dropout_mask", "dropout_seeds", "glu_forward_lowrank", "lora_linear", "lora_mlp",
           "lora_qkv"]
