"""Benchmarks (GPU) and the op self-check (any machine).

Modules, each importing only those listed before it: ``harness`` (budget, child processes, ceilings, model config,
table cells), ``flops`` (FLOPs per token, MFU / HFU), ``check`` (``leantune check``), ``report`` (tables and charts
from result JSON, any machine), ``op_cases`` and ``ops`` (``bench ops``), ``step`` (the child process of one
training-step run), ``e2e`` and ``max_context`` (their parents), ``cli`` (the ``check`` and ``bench`` commands).
"""
