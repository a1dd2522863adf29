"""Host cost of a Triton launch, Triton's JIT path against leantune's bound path (ops/_launch.py), on one GPU.

    PYTHONPATH=src python benchmarks/launch_probe.py [--calls 200] [--launches 200]

1. Per routed kernel: the first launch each op makes at a small shape is recorded, then replayed ``--launches``
   times through ``kernel.fn[grid](...)`` (Triton's ``JITFunction.run``) and through ``kernel[grid](...)`` (bound):
   host us per launch (host clock over the replays, no synchronisation in between; shapes are small, so the GPU keeps
   up and the queue never fills) and device us per launch (CUDA events around the same replays queued behind a GPU
   sleep, so the host's pace is out of the measurement).
2. RoPE fwd+bwd at Llama-3-8B's shape (B4 S4096 32/8 heads D128 bf16, q/k cloned from leaves in the call, as
   ``leantune bench ops`` does): median ms over ``--calls`` calls with the host in the loop (CUDA events around each
   call, an L2 flush before each, as ``triton.testing.do_bench``), normal and bound taken in alternating rounds (the
   lent hosts' speed drifts); also the median host issue ms (until the call returns, before synchronising).
A probe that raises prints its exception and the rest go on. Runs in well under 2 minutes on the H200.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
import traceback

import torch

from leantune import ops
from leantune.ops import _launch

ROUNDS = 4  # alternating normal / bound rounds for the RoPE timing


def _leaf(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_()


def _op_calls():
    """Small-shape calls that reach every routed kernel (fwd+bwd)."""
    n, h, i, v, r = 256, 512, 1024, 2048, 16
    q, k = _leaf(1, 8, n, 64), _leaf(1, 2, n, 64)
    cos, sin = torch.randn(1, n, 64, device="cuda").bfloat16(), torch.randn(1, n, 64, device="cuda").bfloat16()
    x, w = _leaf(n, h), _leaf(h)
    g, u = _leaf(n, i), _leaf(n, i)
    logits, labels = _leaf(n, v), torch.randint(0, v, (n,), device="cuda")
    a, b, wt = _leaf(r, h, scale=0.02), _leaf(h, r, scale=0.02), _leaf(h, h, scale=0.02).detach()
    mlp = [ops.LoraWeights(_leaf(i, h, scale=0.02).detach(), _leaf(r, h, scale=0.02), _leaf(i, r, scale=0.02), 2.0)
           for _ in range(2)]
    down = ops.LoraWeights(_leaf(h, i, scale=0.02).detach(), _leaf(r, i, scale=0.02), _leaf(h, r, scale=0.02), 2.0)

    def fwd_bwd(out, leaves):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])

    return {
        "rope": lambda: fwd_bwd(ops.rope(q, k, cos, sin), [q, k]),
        "rms_norm": lambda: fwd_bwd(ops.rms_norm(x, w, 1e-5), [x, w]),
        "swiglu": lambda: fwd_bwd(ops.swiglu(g, u), [g, u]),
        "cross_entropy": lambda: fwd_bwd(ops.cross_entropy(logits, labels), [logits]),
        "lora_linear+dropout": lambda: fwd_bwd(ops.lora_linear(x, wt, a, b, 2.0, dropout=0.1), [x, a, b]),
        "lora_mlp": lambda: fwd_bwd(ops.lora_mlp(x, mlp[0], mlp[1], down), [x, mlp[0].lora_A, down.lora_B]),
    }


def _record_launches(call) -> list[tuple]:
    """(bound kernel, grid, args, kwargs) of the first launch of each bound kernel during ``call()``."""
    seen, records = set(), []
    original = _launch.BoundKernel._launch

    def recording(self, grid, *args, **kwargs):
        if id(self) not in seen:
            seen.add(id(self))
            records.append((self, grid, args, kwargs))
        return original(self, grid, *args, **kwargs)

    _launch.BoundKernel._launch = recording
    try:
        call()
    finally:
        _launch.BoundKernel._launch = original
    torch.cuda.synchronize()
    return records


def _per_launch(launch, n: int) -> tuple[float, float]:
    """(host us, device us) per launch over ``n`` launches."""
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        launch()
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)  # the GPU waits while the host queues the launches: events time the GPU alone
    start.record()
    for _ in range(n):
        launch()
    end.record()
    torch.cuda.synchronize()
    return host_us, start.elapsed_time(end) / n * 1e3


def probe_kernels(n: int) -> None:
    print(f"\n## host and device us per launch ({n} launches each; small shapes)")
    print(f"| {'kernel':34s} | {'from op':20s} | JIT host us | bound host us | saved us | JIT dev us | bound dev us |")
    print("|---|---|---|---|---|---|---|")
    for op, call in _op_calls().items():
        try:
            call()  # compile and bind outside the measurement
            records = _record_launches(call)
        except Exception:
            print(f"| (op {op} failed) |")
            traceback.print_exc()
            continue
        for kernel, grid, args, kwargs in records:
            name = kernel.fn.fn.__name__
            try:
                jit = _per_launch(lambda: kernel.fn[grid](*args, **kwargs), n)
            except Exception as exc:
                print(f"| {name:34s} | {op:20s} | JIT path failed: {exc!r} |")
                continue
            try:
                fast = _per_launch(lambda: kernel[grid](*args, **kwargs), n)
            except Exception as exc:
                print(f"| {name:34s} | {op:20s} | {jit[0]:11.1f} | bound path failed: {exc!r} |")
                traceback.print_exc()
                continue
            print(f"| {name:34s} | {op:20s} | {jit[0]:11.1f} | {fast[0]:13.1f} | {jit[0] - fast[0]:8.1f} "
                  f"| {jit[1]:10.1f} | {fast[1]:12.1f} |")


def probe_rope(calls: int) -> None:
    b, s, hq, hk, d = 4, 4096, 32, 8, 128
    q, k = _leaf(b, hq, s, d), _leaf(b, hk, s, d)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    freqs = torch.arange(s, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    grads = [torch.randn_like(q), torch.randn_like(k)]
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def call():
        q.grad = k.grad = None
        torch.autograd.backward(ops.rope(q.clone(), k.clone(), cos, sin), grads)

    def timed(n):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        issue = []
        for start, end in events:
            flush.zero_()
            start.record()
            t0 = time.perf_counter()
            call()
            issue.append((time.perf_counter() - t0) * 1e3)
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events], issue

    results = {"JIT path": ([], []), "bound": ([], [])}
    for enabled in (False, True):
        _launch.ENABLED = enabled
        for _ in range(5):
            call()
    torch.cuda.synchronize()
    try:
        for _ in range(ROUNDS):
            for label, enabled in (("JIT path", False), ("bound", True)):
                _launch.ENABLED = enabled
                ms, issue = timed(max(1, calls // ROUNDS))
                results[label][0].extend(ms)
                results[label][1].extend(issue)
    finally:
        _launch.ENABLED = True  # the probe measures the bound path from here on
    print(f"\n## RoPE fwd+bwd B{b} S{s} {hq}/{hk}h D{d} bf16, host in the loop ({calls} calls per path, "
          f"{ROUNDS} alternating rounds; target <= 0.45 ms)")
    print("| path | median ms | min ms | p90 ms | host issue ms (median) |")
    print("|---|---|---|---|---|")
    for label, (ms, issue) in results.items():
        ms = sorted(ms)
        print(f"| {label} | {statistics.median(ms):.3f} | {ms[0]:.3f} | {ms[int(0.9 * (len(ms) - 1))]:.3f} "
              f"| {statistics.median(issue):.3f} |")
    try:
        from triton.testing import do_bench

        _launch.ENABLED = True
        print(f"do_bench median (bound path, as `leantune bench ops`): {do_bench(call, return_mode='median'):.3f} ms")
    except Exception:
        traceback.print_exc()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--launches", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_probe needs a CUDA GPU")
    rope_module = importlib.import_module("leantune.ops.rope")
    if not isinstance(rope_module._rope_kernel, _launch.BoundKernel):
        raise SystemExit("kernels are not bound (TRITON_INTERPRET set?)")
    print(f"torch {torch.__version__}, triton {importlib.import_module('triton').__version__}, "
          f"{torch.cuda.get_device_name()}")
    for probe, arg in ((probe_kernels, args.launches), (probe_rope, args.calls)):
        try:
            probe(arg)
        except Exception:
            print(f"{probe.__name__} failed:")
            traceback.print_exc()


if __name__ == "__main__":
    main()
