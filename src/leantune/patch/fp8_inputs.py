"""The e4m3 GEMM inputs a patched RMSNorm hands to the FP8 projections that read its output (issue #26).

HF's decoder layer (not patched) calls the norm and then the attention or MLP module with the norm's output: the
link between them is that output tensor. A norm whose output feeds an FP8 group (q/k/v through ``ops.lora_qkv``,
gate/up through ``ops.lora_mlp``) runs ``ops.rms_norm(..., fp8_out=True)``, which writes y's per-token codes in
its own kernel pass, and records y -> (codes, scales); the consumer hands them to the op (``x_quantized``), which
then skips its separate quantisation pass. Which norms those are is learnt at the first forward: every patched
norm output records its norm (weakly), and a consumer holding FP8 weights that finds no codes for its input marks
that norm, which writes codes from its next forward on. The first forward (and a norm output that reaches no FP8
group: OLMo 2's post-norms, QK-norms) keeps the separate pass. Both paths give the same codes bit for bit
(tests/test_fp8_fused.py), so a checkpointed recompute that takes the other path recomputes the same values.
Entries are weak (they die with y) and taken once. Under torch.compile nothing is recorded (the separate pass).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import ops

_FLAG = "_leantune_fp8_out"
_codes = WeakIdKeyDictionary()  # norm output -> (codes, scales)
_producers = WeakIdKeyDictionary()  # norm output -> weakref to the norm that wrote it (no codes)


def wanted(norm) -> bool:
    """Whether ``norm``'s output has fed an FP8 group: it should write its e4m3 side output."""
    return norm.__dict__.get(_FLAG, False) and not torch.compiler.is_compiling()


def record(y, norm, quantized) -> None:
    """Remember ``y``'s codes (``quantized``: (codes, scales)) or, without them, the norm that wrote it."""
    if torch.compiler.is_compiling():
        return
    if quantized is not None:
        _codes[y] = quantized
    else:
        _producers[y] = weakref.ref(norm)


def take(x, weights):
    """The (codes, scales) recorded for ``x`` when a weight of ``weights`` (LoraWeights/DoraWeights) is an
    ``ops.FP8Weight`` or an NF4 weight with FP8 compute (``ops.fp8_gemms``), else None; with FP8 weights and no
    codes, the norm that wrote ``x`` (if any) is asked to write them from its next forward on."""
    if torch.compiler.is_compiling() or not any(ops.fp8_gemms(getattr(w, "weight", None)) for w in weights):
        return None
    quantized = _codes.pop(x, None)
    if quantized is None:
        norm = _producers.pop(x, lambda: None)()
        if norm is not None:
            norm.__dict__[_FLAG] = True
    return quantized
