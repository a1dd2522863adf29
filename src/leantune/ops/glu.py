"""SwiGLU / GeGLU (stub: being written)."""


def swiglu(gate, up):
    raise NotImplementedError("ops.swiglu is not written yet")


def geglu(gate, up, approximate="tanh"):
    raise NotImplementedError("ops.geglu is not written yet")
