"""Host (CPU) cost of issuing work on the GPU machine: launch primitives, then one op's forward and backward apart.

The GPU is kept busy with a long sleep kernel while the host issues calls, so the host never waits on a full queue and
the numbers are pure issue time. Also: the JIT launch cost with few and many arguments against a direct launch of
the compiled kernel, each op's forward and backward host time and do_bench of fwd+bwd, and the peers' host time for
the same call. Op calls are issued 20 at a time: CUDA's launch queue (~1024 entries) must not fill, or the host
blocks and the wait is counted (the 2026-11-30 run used 200 and overstated ops of > 5 kernels, e.g. lora_qkv).
Usage: PYTHONPATH=src python3 benchmarks/hostprof.py rms_norm,rope,lora_qkv   (cases of leantune.bench.ops)
"""
import importlib
import sys

import torch
import triton
import triton.language as tl
from _host import host_us

bench = importlib.import_module("leantune.bench.ops")


@triton.jit
def _noop(X, n, BLOCK: tl.constexpr):
    pass


@triton.jit
def _noop16(X0, X1, X2, X3, X4, X5, X6, X7, n0, n1, n2, n3, n4, n5, n6, n7, BLOCK: tl.constexpr):
    pass


@triton.jit
def _noop16c(X0, X1, X2, X3, X4, X5, X6, X7, n0, n1, n2, n3, n4, n5, n6, n7, A: tl.constexpr, B: tl.constexpr,
             C: tl.constexpr, D: tl.constexpr, E: tl.constexpr, F: tl.constexpr, BLOCK: tl.constexpr):
    pass


x = torch.empty(16, device="cuda")
xs = [torch.empty(16, device="cuda") for _ in range(8)]
ns = [17 * (i + 1) for i in range(8)]
print(f"empty triton launch      {host_us(lambda: _noop[(1,)](x, 16, BLOCK=16)):7.1f} us")
print(f"  8 tensors + 8 ints     {host_us(lambda: _noop16[(1,)](*xs, *ns, BLOCK=16)):7.1f} us")
many_constexprs = host_us(lambda: _noop16c[(1,)](*xs, *ns, A=1, B=2, C=3, D=4, E=5, F=6, BLOCK=16))
print(f"  + 6 more constexprs    {many_constexprs:7.1f} us")
try:  # the CompiledKernel launched without the binder: a lower bound for any launch wrapper
    compiled = _noop16[(1,)](*xs, *ns, BLOCK=16)
    stream = torch.cuda.current_stream().cuda_stream

    def direct():
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *xs, *ns, 16)

    print(f"  same, CompiledKernel.run {host_us(direct):7.1f} us")
except Exception as exc:  # the launcher's calling convention changes between Triton versions
    print(f"  CompiledKernel.run not measured: {type(exc).__name__}: {exc}")
print(f"torch.empty              {host_us(lambda: torch.empty(1024, device='cuda')):7.1f} us")
print(f"tensor add               {host_us(lambda: x + x):7.1f} us")


def profile(name):
    case = bench.CASES[name]()
    fn = case.impls["leantune"]

    def forward_only():
        with torch.no_grad():
            return fn(*case.leaves)

    out = fn(*case.leaves)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]

    def backward_only():
        torch.autograd.backward(outs, case.grad_outputs, retain_graph=True)

    call = bench._fwd_bwd(fn, case.leaves, case.grad_outputs)
    print(f"{name} [leantune]: host fwd (no_grad) {host_us(forward_only):7.1f} us, bwd only "
          f"{host_us(backward_only):7.1f} us, fwd+bwd {host_us(call):7.1f} us; do_bench fwd+bwd "
          f"{triton.testing.do_bench(call):.3f} ms")
    for impl, other in case.impls.items():  # the peers' host time for the same call (compile: after its warmup)
        if impl == "leantune":
            continue
        try:
            peer = bench._fwd_bwd(other, case.leaves, case.grad_outputs)
            print(f"{name} [{impl}]: host fwd+bwd {host_us(peer):7.1f} us; "
                  f"do_bench {triton.testing.do_bench(peer):.3f} ms")
        except Exception as exc:
            print(f"{name} [{impl}]: not measured ({type(exc).__name__}: {str(exc)[:120]})")


for name in (sys.argv[1] if len(sys.argv) > 1 else "rms_norm").split(","):
    profile(name)
