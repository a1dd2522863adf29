"""LoRA projections (stub: being written)."""

from typing import NamedTuple


class LoraWeights(NamedTuple):
    weight: object
    lora_A: object
    lora_B: object
    scaling: float
    bias: object = None


def lora_linear(*args, **kwargs):
    raise NotImplementedError


def lora_qkv(*args, **kwargs):
    raise NotImplementedError


def lora_mlp(*args, **kwargs):
    raise NotImplementedError
