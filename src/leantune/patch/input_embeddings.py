"""The input embeddings of a patched causal LM's forward, without the gradient transformers forces on them where
nothing needs it (see :func:`input_embeddings`; docs/design.md, "Memory model")."""

from __future__ import annotations

import torch
from torch import nn

from ._model import checkpoint_reentrant

# the forward hooks transformers' enable_input_require_grads and PEFT register on the input embeddings
_REQUIRES_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


def input_embeddings(base, input_ids, hidden_states_out: bool):
    """``base``'s input embeddings of ``input_ids`` (its embedding module and hooks), without a gradient nothing
    reads.

    transformers' ``gradient_checkpointing_enable`` (and PEFT) hook the embedding layer to mark its output as
    requiring grad, which reentrant checkpointing needs: a checkpointed layer whose inputs do not require grad gives
    its adapters no gradient. Non-reentrant checkpointing (leantune's, the default of transformers 5) needs no such
    thing, and there the forced tensor only costs: autograd holds it for the whole step (the first layer's input
    stays on the card even when checkpoints are offloaded: [tokens, hidden], 8 KiB per token at Llama-3-8B) and
    fills a [tokens, hidden] gradient. The forced leaf (requires grad, no graph behind it: no trainable embedding)
    is detached only where leantune can tell that nothing reads that gradient or needs the leaf:
    :func:`_detach_is_safe`. The loss and every parameter's gradient are unchanged."""
    embeddings = base.get_input_embeddings()
    if (torch.compiler.is_compiling() and not hidden_states_out and not embeddings._forward_pre_hooks
            and _detach_is_safe(base, embeddings) and not _trainable(embeddings)):
        # traced, the hook's requires_grad_ on an intermediate is refused: skip it, as the detach below would
        return embeddings.forward(input_ids)
    embeds = embeddings(input_ids)
    if (embeds.requires_grad and embeds.grad_fn is None and not hidden_states_out
            and _detach_is_safe(base, embeddings)):
        return embeds.detach()
    return embeds


def _detach_is_safe(base: nn.Module, embeddings: nn.Module) -> bool:
    """The embedding module's only forward hooks are the requires-grad ones (no caller's hook keeps the output to
    read its gradient, e.g. for saliency), transformers' gradient checkpointing is on and non-reentrant in every
    module that has it on, and no torch ``checkpoint_wrapper`` (which may be reentrant) is in the model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if any(getattr(hook, "__name__", None) not in _REQUIRES_GRAD_HOOKS for hook in embeddings._forward_hooks.values()):
        return False
    checkpointed = False
    for module in base.modules():  # runs every forward: attributes read from __dict__ (a missing attribute through
        # nn.Module.__getattr__ raises inside getattr, ~1 us a module: 4.7 ms a forward at 2,663 modules, the 8B's)
        if isinstance(module, CheckpointWrapper):
            return False
        attrs = module.__dict__
        func = attrs.get("_gradient_checkpointing_func")
        if func is None or not attrs.get("gradient_checkpointing",
                                         getattr(type(module), "gradient_checkpointing", False)):
            continue
        if checkpoint_reentrant(func) is not False:  # reentrant, or a function leantune cannot read
            return False
        checkpointed = True
    return checkpointed


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())
