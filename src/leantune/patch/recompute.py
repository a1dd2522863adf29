"""Whether code runs inside the recomputation of torch's non-reentrant activation checkpoint.

``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (transformers' gradient checkpointing with
``use_reentrant=False``, leantune's default) re-runs a layer's forward in backward only to rebuild the tensors the
forward saved; the forward's result is thrown away, and with early stop (torch's default) the re-run ends as soon as
the last saved tensor is rebuilt. A fused op whose output only feeds ops that save nothing can then skip forming
that output (``ops.lora_mlp(output=False)``: the down projection of the last MLP of a pre-norm layer).

The re-run is recognised by the saved-tensor hooks it runs under: torch pushes ``_recomputation_hook`` around it
(torch/utils/checkpoint.py, unchanged in form from torch 2.1 to 2.13). Anything else (no hooks, the forward's
``_checkpoint_hook``, leantune's offload hooks, the reentrant checkpoint, torch.compile tracing) reads as not
recomputing, so a torch that renames the class only loses the saving. Only a re-run that stops early counts: with
early stop off (``torch.utils.checkpoint.set_checkpoint_early_stop(False)`` or ``checkpoint(..., early_stop=False)``)
the rest of the layer runs too, and its forward hooks would see an output never formed. The frame's flag is read
from the pack hook's closure; where it cannot be read, the re-run reads as not recomputing.
"""

from __future__ import annotations

import inspect

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
            and getattr(pack, "__qualname__", "").startswith(_RECOMPUTE_HOOK) and _stops_early(pack))


def _stops_early(pack) -> bool:
    """Whether the checkpoint frame a ``_recomputation_hook`` pack hook serves has early stop on (False when the
    frame cannot be found: the hook's closure holds ``target_frame_ref``, a weak reference to the frame)."""
    pack = inspect.unwrap(pack)  # torch 2.13 wraps it in torch._dynamo.disable
    try:
        cells = dict(zip(pack.__code__.co_freevars, pack.__closure__ or ()))
        frame = cells["target_frame_ref"].cell_contents()
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return getattr(frame, "early_stop", False) is True
