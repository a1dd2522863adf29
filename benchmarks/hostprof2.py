"""Host time of forward and backward apart, with the GPU kept busy (no blocking); sync detection; graph replay."""
import importlib
import sys
import time

import torch
from triton.testing import do_bench

bench = importlib.import_module("leantune.bench.ops")
name = sys.argv[1] if len(sys.argv) > 1 else "rms_norm"
case = bench.CASES[name]()
fn = case.impls["leantune"]
leaves, gos = case.leaves, case.grad_outputs


def host_us(f, n=100):
    f()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU spin so the host never waits on a full queue
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def fwd():
    with torch.no_grad():
        return fn(*leaves)


out = fn(*leaves)
outs = list(out) if isinstance(out, (tuple, list)) else [out]


def bwd():
    torch.autograd.backward(outs, gos, retain_graph=True)


call = bench._fwd_bwd(fn, leaves, gos)
print(f"host fwd (no_grad) {host_us(fwd):8.1f} us  fwd+bwd {host_us(call):8.1f} us  bwd only {host_us(bwd):8.1f} us")
torch.cuda.set_sync_debug_mode("warn")
call()
torch.cuda.set_sync_debug_mode(0)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        call()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    call()
print(f"graph replay {do_bench(g.replay, return_mode='median') * 1e3:8.1f} us   do_bench eager "
      f"{do_bench(call, return_mode='median') * 1e3:8.1f} us")
