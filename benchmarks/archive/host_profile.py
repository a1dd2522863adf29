"""Where the host time of one fwd+bwd call goes: cProfile of leantune's call at its benchmark shape on the GPU machine.

The GPU is kept busy with a sleep kernel so the host never waits on the device; calls are few enough (``--calls``)
that CUDA's launch queue never fills (a full queue blocks the host and would be counted as host time). Also counts
the CUDA runtime calls that block the host (synchronize, memcpy to host) with the torch profiler.
Usage: PYTHONPATH=src python3 benchmarks/host_profile.py rms_norm,rope,lora_qkv [--calls 20] [--top 25]
"""
import argparse
import cProfile
import importlib
import io
import pstats

import torch
from _host import host_us
from torch.profiler import ProfilerActivity, profile

bench = importlib.import_module("leantune.bench.ops")
parser = argparse.ArgumentParser()
parser.add_argument("ops")
parser.add_argument("--calls", type=int, default=20)
parser.add_argument("--top", type=int, default=25)
parser.add_argument("--impl", default="leantune")
args = parser.parse_args()

for name in args.ops.split(","):
    case = bench.CASES[name]()
    call = bench._fwd_bwd(case.impls[args.impl], case.leaves, case.grad_outputs)
    for _ in range(2):
        call()
    issue_us = host_us(call, args.calls, int(1e9))
    torch.cuda._sleep(int(1e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
    blocking = {e.key: e.count // 3 for e in tprof.key_averages()
                if any(s in e.key for s in ("Synchronize", "Memcpy", "item", "_local_scalar_dense"))}
    print(f"== {name} [{args.impl}]: host {issue_us:.1f} us per fwd+bwd; blocking calls per fwd+bwd: {blocking}")
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).strip_dirs().sort_stats("tottime")
    stats.print_stats(args.top)
    body = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(body) if "ncalls" in line)
    print("\n".join(body[start:]).replace(" " * 6, " "))
