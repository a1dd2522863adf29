"""``leantune_summary``, the dict :func:`leantune.patch` leaves on the HF model: what it configured, with the parts
that change after it (which loss head ran how often, which layers leantune.quantize holds) re-read at each access."""

from __future__ import annotations

import collections
import weakref

from torch import nn

from ._model import instance_forward
from .forwards import LOSS_CALLS_ATTR, is_leantune_forward
from .lora_status import quantized_kind
from .offload import offloader_of

LEANTUNE_FORWARD_LOSS = "ops.linear_cross_entropy (leantune's causal-LM forward)"


class PatchSummary(dict):
    """``leantune_summary``: a dict whose ``loss_runs`` is re-read at each access from what is installed now and
    what ran (leantune's loss-call counters), not only from what :func:`patch` configured: a wrapper forward put on
    after ``patch`` (TRL's fused LM head, built after a bare ``leantune.patch``) serves its own calls with its own
    head, and the summary then says so with the count of leantune's losses. ``quantized`` (and the note on it in
    ``fused``) and ``offload_checkpoints`` are re-read too: ``leantune.quantize`` or ``disable_offloaded_checkpoints``
    after ``patch`` shows. Copies (``copy.deepcopy``, pickle,
    ``dict(summary)`` of ``items()``) are plain dicts holding the values as of the copy."""

    def __init__(self, hf: nn.Module, data: dict):
        super().__init__(data)
        self._hf = weakref.ref(hf)

    def _live(self, key, value):
        hf = self._hf()
        if hf is None:
            return value
        if key == "loss_runs":
            return _loss_runs_now(hf, value)
        if key == "offload_checkpoints":  # enable/disable_offloaded_checkpoints may run after patch
            return offloader_of(hf) is not None
        if key == "quantized":  # leantune.quantize may run after patch (either order works)
            return quantized_counts(hf)
        if key == "fused":
            return _with_quantized_note(value, quantized_counts(hf))
        return value

    def __getitem__(self, key):
        return self._live(key, super().__getitem__(key))

    def get(self, key, default=None):
        return self[key] if key in self else default

    def items(self):
        return [(k, self._live(k, v)) for k, v in super().items()]

    def values(self):
        return [v for _, v in self.items()]

    def __repr__(self):
        return repr(dict(self.items()))

    def __eq__(self, other):  # as read, loss_runs included
        if isinstance(other, PatchSummary):
            other = dict(other.items())
        return dict(self.items()) == other if isinstance(other, dict) else NotImplemented

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None

    def __reduce__(self):
        return dict, (dict(self.items()),)


def _loss_runs_now(hf: nn.Module, configured: str) -> str:
    """``loss_runs`` from what ran: a loss head that reports its own runs (``leantune_runs``: leantune's TRL head),
    or a foreign wrapper put on after :func:`patch` in front of leantune's forward, with leantune's loss count."""
    # leantune's TRL head may sit under accelerate's mixed-precision wrappers (Trainer.train with bf16=True)
    describe = getattr(instance_forward(hf, lambda f: callable(getattr(f, "leantune_runs", None))), "leantune_runs",
                       None)
    if callable(describe):
        return describe(configured)
    forward = hf.__dict__.get("forward")
    calls = hf.__dict__.get(LOSS_CALLS_ATTR, 0)
    if configured.startswith(LEANTUNE_FORWARD_LOSS) and (forward is None or is_leantune_forward(forward)):
        # only calls with labels run it: a loss a caller forms from the returned logits (or hidden states) is its own
        return (f"{configured}; ran so far: {calls} losses (calls with labels; a loss the caller computes from the "
                "returned logits or hidden states is the caller's)")
    if configured != LEANTUNE_FORWARD_LOSS or forward is None or is_leantune_forward(forward):
        return configured
    return (f"the instance forward {forward_name(forward)}'s own head for its own calls (put on after leantune.patch; "
            f"for TRL's fused_lm_head=True calls that is TRL's chunked head: leantune.integrations.trl.patch_trainer"
            f"(trainer) makes them leantune's); ops.linear_cross_entropy only where it calls leantune's causal-LM "
            f"forward: {calls} losses so far")


_QUANTIZED_NOTE = ("frozen weights of leantune.quantize (fp8: e4m3 codes, the frozen GEMMs in FP8; nf4: dequantised "
                   "per GEMM; nf4-fp8: NF4 codes dequantised to e4m3, the GEMMs in FP8), layers: ")


def _with_quantized_note(fused: list[str], quantized: dict[str, int]) -> list[str]:
    """``fused`` with a note on the quantised layers ``quantized`` counts (none: ``fused`` as it is)."""
    if not quantized:
        return fused
    return [*fused, _QUANTIZED_NOTE + ", ".join(f"{kind} {n}" for kind, n in quantized.items())]


def quantized_counts(model: nn.Module) -> dict[str, int]:
    """How many of the model's linear layers hold leantune.quantize's codes, by kind ("fp8", "nf4", "nf4-fp8")."""
    counts = collections.Counter(kind for m in model.modules() if (kind := quantized_kind(m)) is not None)
    return dict(sorted(counts.items()))


def forward_name(fn) -> str:
    """Where a wrapper forward was written (``functools.wraps`` copies the wrapped forward's name; the code keeps its
    own), e.g. ``trl.trainer.utils._fused_forward``."""
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is not None:
        return f"{getattr(func, '__globals__', {}).get('__name__', '?')}.{code.co_name}"
    return type(fn).__qualname__
