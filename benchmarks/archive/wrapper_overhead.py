"""Host time of leantune's Python around its Triton launches, measured on the CPU with every launch a no-op.

The op harness on the H200 is partly host-bound (RESULTS.md): the host issues each fwd+bwd more slowly than the GPU
runs it. The Triton launch itself can only be measured there (benchmarks/hostprof.py); everything around it
(validation, autograd, allocation, launch-parameter arithmetic, torch glue ops on small tensors) can be measured
here: this script runs each op's fwd+bwd through the Triton path (interpreter mode so that backend selection
passes) with ``__getitem__`` of every kernel replaced by a no-op. Tiny shapes: the numbers are host time, not work.
Usage: .venv/bin/python benchmarks/wrapper_overhead.py [rms_norm|rope|lora_qkv|lora_mlp ...] [--profile]
"""
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ["LEANTUNE_BACKEND"] = "triton"

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from leantune import ops  # noqa: E402

torch.set_num_threads(1)
launches = [0]


def _noop_getitem(self, grid):
    def launch(*args, **kwargs):
        launches[0] += 1
    return launch


InterpretedFunction.__getitem__ = _noop_getitem


def _cases():
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    gy = torch.randn(64, 256)

    def rms_norm():
        ops.rms_norm(x, w).backward(gy)

    q = torch.randn(2, 16, 8, 64, requires_grad=True)
    k = torch.randn(2, 16, 2, 64, requires_grad=True)
    cos, sin = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    gq, gk = torch.randn(2, 8, 16, 64), torch.randn(2, 2, 16, 64)

    def rope():
        qo, ko = ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        torch.autograd.backward([qo, ko], [gq, gk])

    h = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)

    def proj(out_f, in_f=128, r=8):
        return ops.LoraWeights(torch.randn(out_f, in_f, dtype=torch.bfloat16),
                               torch.randn(r, in_f, requires_grad=True), torch.randn(out_f, r, requires_grad=True),
                               2.0)

    pq, pk, pv = proj(128), proj(32), proj(32)
    gqkv = [torch.randn(64, n, dtype=torch.bfloat16) for n in (128, 32, 32)]

    def lora_qkv():
        torch.autograd.backward(list(ops.lora_qkv(h, pq, pk, pv)), gqkv)

    gate, up, down = proj(192), proj(192), proj(128, 192)
    gm = torch.randn(64, 128, dtype=torch.bfloat16)

    def lora_mlp():
        ops.lora_mlp(h, gate, up, down).backward(gm)

    return {"rms_norm": rms_norm, "rope": rope, "lora_qkv": lora_qkv, "lora_mlp": lora_mlp}


def host_us(fn, n=200, repeats=5):
    """(best of ``repeats`` mean host times in us, Triton launches per call): the minimum filters other load."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        launches[0] = 0
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best, launches[0] / n


def main(argv):
    profile = "--profile" in argv
    cases = _cases()
    names = [a for a in argv if not a.startswith("--")] or list(cases)
    for name in names:
        us, count = host_us(cases[name])
        print(f"{name:10s} fwd+bwd host time without launches: {us:7.1f} us, {count:.0f} Triton launches")
        if profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(lambda fn=cases[name]: [fn() for _ in range(200)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main(sys.argv[1:])
