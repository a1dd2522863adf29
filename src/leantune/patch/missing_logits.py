"""The ``logits`` of a patched causal-LM forward in training when the caller is a TRL trainer that reads them.

``leantune.patch(model)`` forms no logits in training (``logits`` is None; the loss comes from
``ops.linear_cross_entropy``). TRL 1.14 and earlier have no fused LM head: their SFTTrainer computes its loss
(``loss_type="nll"``) and its entropy and token-accuracy metrics from ``outputs.logits`` in training, so after a
bare patch it failed with ``TypeError: 'NoneType' object is not subscriptable``, with no hint of the fix. For such a
caller (a frame of a ``trl.`` module up the stack, and a TRL without ``add_fused_lm_head``) the field holds
:data:`MISSING` instead: any use of it (indexing, attributes, arithmetic, torch functions, ``len``, iteration)
raises a ``TypeError`` naming the fixes. Every other caller keeps None, the documented contract (code that tests
``logits is None`` is unchanged). :func:`leantune.integrations.trl.patch_trainer` makes the forward form the logits
for such a trainer, so this never shows under it.
"""

from __future__ import annotations

import sys

FIX = ("leantune.patch(model) forms no logits in training (its loss comes from ops.linear_cross_entropy), and this "
       "caller reads outputs.logits (TRL <= 1.14 has no fused LM head). Call "
       "leantune.integrations.trl.patch_trainer(trainer) after building the trainer (it forms the logits for it), "
       "or patch with leantune.patch(model, loss=False)")
FRAMES = 24  # how far up the stack a TRL frame is looked for (trainer -> PEFT -> accelerate -> the forward: ~12)


class MissingLogits:
    """Stands in for logits that were not formed: falsy, and every use raises ``TypeError(FIX)``."""

    __slots__ = ()

    def __repr__(self):
        return "<leantune: logits not formed in training>"

    def __bool__(self):
        return False

    def _fail(self, *args, **kwargs):
        raise TypeError(FIX)

    __getitem__ = __len__ = __iter__ = __float__ = __array__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __neg__ = _fail

    def __getattr__(self, name):
        if name.startswith("__"):  # copy/pickle protocol lookups: absent, as on a plain object
            raise AttributeError(name)
        raise TypeError(FIX)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(FIX)


MISSING = MissingLogits()


_lacks: list[bool] = []  # the answer once TRL is imported (it cannot change in a process)


def _trl_lacks_fused_head() -> bool:
    if not _lacks:
        module = sys.modules.get("trl.trainer.utils")
        if module is None:  # TRL not imported (yet): no TRL trainer is calling
            return False
        _lacks.append(not hasattr(module, "add_fused_lm_head"))
    return _lacks[0]


def logits_for_caller(depth: int = 2):
    """None, or :data:`MISSING` when a caller up the stack (from ``depth`` frames above this call) is a ``trl.``
    module and the installed TRL has no fused LM head (<= 1.14). A walk of at most :data:`FRAMES` frames, only on the
    training path that forms no logits."""
    if not _trl_lacks_fused_head():
        return None
    frame = sys._getframe(depth)
    for _ in range(FRAMES):
        if frame is None:
            return None
        if frame.f_globals.get("__name__", "").startswith("trl."):
            return MISSING
        frame = frame.f_back
    return None
