"""Sweep RMSNorm launch parameters on the GPU (forward and backward timed apart). Run: PYTHONPATH=src python3 ..."""
import importlib
import itertools

import torch
from triton.testing import do_bench

m = importlib.import_module("leantune.ops.rms_norm")

n, h = 16384, 4096
x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
w = (1 + 0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
dy = torch.randn_like(x)
y, rstd = m._forward_triton(x, w, 1e-5, 0.0, False, torch.bfloat16)
gb = lambda nbytes, ms: nbytes / ms / 1e6
print("forward: rows warps ms GB/s")
for rows, warps in itertools.product([1, 2, 4], [4, 8, 16]):
    ms = do_bench(lambda rows=rows, warps=warps: m._forward_triton(x, w, 1e-5, 0.0, False, torch.bfloat16,
                                                                     rows=rows, num_warps=warps),
                  return_mode="median")
    print(f"fwd {rows} {warps} {ms:.4f} {gb(2 * n * h * 2, ms):.0f}")
print("backward: rows warps per_sm stages ms GB/s")
for rows, warps, per_sm, stages in itertools.product([1, 2, 4], [4, 8, 16], [1, 2, 4, 8], [1, 2]):
    try:
        ms = do_bench(lambda rows=rows, warps=warps, per_sm=per_sm, stages=stages: m._backward_triton(
            dy, x, w, rstd, 0.0, False, rows=rows, num_warps=warps, per_sm=per_sm, num_stages=stages),
            return_mode="median")
    except Exception as e:
        print("bwd", rows, warps, per_sm, stages, "fail", type(e).__name__)
        continue
    print(f"bwd {rows} {warps} {per_sm} {stages} {ms:.4f} {gb(3 * n * h * 2, ms):.0f}")
