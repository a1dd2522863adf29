"""leantune: fast, memory-lean LoRA fine-tuning of Hugging Face causal LMs with hand-derived Triton kernels.

Public API (DESIGN.md): ``leantune.ops`` (the kernels) and ``leantune.patch(model)`` / ``leantune.unpatch(model)``.
"""

from . import ops
from .patch import patch, unpatch

__version__ = "0.1.0"
__all__ = ["__version__", "ops", "patch", "unpatch"]
