"""Whether code runs inside the recomputation of torch's non-reentrant activation checkpoint.

``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (transformers' gradient checkpointing with
``use_reentrant=False``, leantune's default) re-runs a layer's forward in backward only to rebuild the tensors the
forward saved; the forward's result is thrown away, and with early stop (torch's default) the re-run ends as soon as
the last saved tensor is rebuilt. A fused op whose output only feeds ops that save nothing can then skip forming
that output (``ops.lora_mlp(output=False)``: the down projection of the last MLP of a pre-norm layer).

The re-run is recognised by the saved-tensor hooks it runs under: torch pushes ``_recomputation_hook`` around it
(torch/utils/checkpoint.py, unchanged in form from torch 2.1 to 2.13). Anything else (no hooks, the forward's
``_checkpoint_hook``, leantune's offload hooks, the reentrant checkpoint, torch.compile tracing) reads as not
recomputing, so a torch that renames the class only loses the saving.
"""

from __future__ import annotations

import torch

_RECOMPUTE_HOOK = "_recomputation_hook."


def in_checkpoint_recompute() -> bool:
    """True inside a non-reentrant checkpoint's recomputation (its pack hook is the innermost saved-tensor hook)."""
    if torch.compiler.is_compiling():
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return False
    pack = hooks[0]
    return (getattr(pack, "__module__", None) == "torch.utils.checkpoint"
            and getattr(pack, "__qualname__", "").startswith(_RECOMPUTE_HOOK))
