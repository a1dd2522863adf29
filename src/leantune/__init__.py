"""leantune: fast, memory-lean LoRA fine-tuning of Hugging Face causal LMs with hand-derived Triton kernels.

Public API (docs/design.md, "Public op contract"): ``leantune.ops`` (the kernels), ``leantune.patch(model)`` /
``leantune.unpatch(model)`` (``leantune.is_patched(model)`` tells; the name ``leantune.patch`` is the function, so
reach the subpackage's other names with ``from leantune.patch import ...``), ``leantune.quantize(model, "nf4")``
(frozen decoder linear weights in NF4; ``"fp8"``, ``"nf4-fp8"``) and ``leantune.dequantize(model)`` (back to dense
``nn.Linear`` layers, e.g. to merge or save).
"""

from . import ops
from .patch import is_patched, patch, unpatch
from .quantize import dequantize, quantize

__version__ = "0.1.0"
__all__ = ["__version__", "dequantize", "is_patched", "ops", "patch", "quantize", "unpatch"]
