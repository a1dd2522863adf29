"""CPU cost of one fwd+bwd call (host time to enqueue) vs the GPU time, for ops at their benchmark shapes."""
import importlib
import sys
import time

import torch
from triton.testing import do_bench

bench = importlib.import_module("leantune.bench.ops")
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["rms_norm"]
for name in names:
    case = bench.CASES[name]()
    for impl, fn in case.impls.items():
        if fn is None or impl == "eager":
            continue
        call = bench._fwd_bwd(fn, case.leaves, case.grad_outputs)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        # host time: enqueue 50 calls back to back behind a long GPU sleep so the GPU never throttles the host
        torch.cuda._sleep(2_000_000_000 // 1000 * 50)
        t0 = time.perf_counter()
        for _ in range(50):
            call()
        host_us = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        # GPU time with launch gaps removed: CUDA graph replay is not possible for every impl; use do_bench median
        ms = do_bench(call, return_mode="median")
        print(f"{name:<24}{impl:<16} host {host_us:8.1f} us/call   do_bench {ms * 1e3:8.1f} us")
        if True:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call()
                torch.cuda.synchronize()
            events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
            print(f"    kernels total {sum(e.device_time_total for e in events) / 10:8.1f} us/call")
            for evt in events[:12]:
                if evt.device_time_total > 0:
                    per_call = evt.device_time_total / 10
                    print(f"    kernel {evt.key[:60]:<60} {per_call:8.1f} us/call  x{evt.count // 10}")
