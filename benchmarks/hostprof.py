"""Host (CPU) cost of issuing work on the GPU machine: launch primitives, then one op's forward and backward apart.

The GPU is kept busy with a long sleep kernel while the host issues calls, so the host never waits on a full queue and
the numbers are pure issue time. Usage: PYTHONPATH=src python3 benchmarks/hostprof.py rms_norm
"""
import importlib
import sys
import time

import torch
import triton
import triton.language as tl

bench = importlib.import_module("leantune.bench.ops")


@triton.jit
def _noop(X, n, BLOCK: tl.constexpr):
    pass


def host_us(fn, n=200):
    """Mean host time of ``fn`` in microseconds, issued behind ~1 s of GPU sleep."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


x = torch.empty(16, device="cuda")
print(f"empty triton launch      {host_us(lambda: _noop[(1,)](x, 16, BLOCK=16)):7.1f} us")
print(f"torch.empty              {host_us(lambda: torch.empty(1024, device='cuda')):7.1f} us")
print(f"tensor add               {host_us(lambda: x + x):7.1f} us")

name = sys.argv[1] if len(sys.argv) > 1 else "rms_norm"
case = bench.CASES[name]()
fn = case.impls["leantune"]


def forward_only():
    with torch.no_grad():
        return fn(*case.leaves)


out = fn(*case.leaves)
outs = list(out) if isinstance(out, (tuple, list)) else [out]
grads = case.grad_outputs


def backward_only():
    torch.autograd.backward(outs, grads, retain_graph=True)


call = bench._fwd_bwd(fn, case.leaves, case.grad_outputs)
print(f"{name}: host fwd (no_grad) {host_us(forward_only):8.1f} us, bwd only {host_us(backward_only):8.1f} us, "
      f"fwd+bwd {host_us(call):8.1f} us")
