"""Where the host time of one fwd+bwd call goes (cProfile over 200 calls), plus micro-costs of launch primitives."""
import cProfile
import importlib
import pstats
import sys
import time

import torch
import triton
import triton.language as tl

bench = importlib.import_module("leantune.bench.ops")


@triton.jit
def _noop(X, n, BLOCK: tl.constexpr):
    pass


def per_call_us(fn, n=2000):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


x = torch.empty(16, device="cuda")
print(f"empty triton launch      {per_call_us(lambda: _noop[(1,)](x, 16, BLOCK=16)):7.1f} us")
print(f"torch.empty              {per_call_us(lambda: torch.empty(1024, device='cuda')):7.1f} us")
print(f"tensor add               {per_call_us(lambda: x + x):7.1f} us")
name = sys.argv[1] if len(sys.argv) > 1 else "rms_norm"
case = bench.CASES[name]()
call = bench._fwd_bwd(case.impls["leantune"], case.leaves, case.grad_outputs)
print(f"{name} fwd+bwd host        {per_call_us(call, 300):7.1f} us")
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    call()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
