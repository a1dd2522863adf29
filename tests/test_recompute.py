"""patch.recompute: a non-reentrant checkpoint's recomputation is recognised, and nothing else is."""

import torch
from torch.utils.checkpoint import checkpoint

from leantune.patch.recompute import in_checkpoint_recompute


def _seen_in(use_reentrant: bool) -> list[bool]:
    seen = []

    def layer(x):
        seen.append(in_checkpoint_recompute())
        return (x.sin() * 2).cos()

    x = torch.randn(5, requires_grad=True)
    checkpoint(layer, x, use_reentrant=use_reentrant).sum().backward()
    return seen


def test_recompute_is_recognised_only_in_the_non_reentrant_recomputation():
    assert not in_checkpoint_recompute()
    assert _seen_in(use_reentrant=False) == [False, True]  # forward, then the recomputation in backward
    assert _seen_in(use_reentrant=True) == [False, False]  # reentrant: backward runs through the recomputed outputs
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # other hooks (e.g. offload's)
        assert not in_checkpoint_recompute()
    assert not in_checkpoint_recompute()


def test_recompute_without_early_stop_is_not_recognised():
    # the rest of the layer then runs too (its hooks would see an output the skip never formed)
    seen = []

    def layer(x):
        seen.append(in_checkpoint_recompute())
        return (x.sin() * 2).cos()

    x = torch.randn(5, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False, early_stop=False).sum().backward()
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert seen == [False, False, False, False]
