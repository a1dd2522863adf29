"""RoPE (stub: being written)."""


def rope(q, k, cos, sin):
    raise NotImplementedError("ops.rope is not written yet")
