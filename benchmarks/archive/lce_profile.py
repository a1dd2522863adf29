"""Issue 3, fast mode: where the whole op's time goes, against the sum of its steps timed one by one.

benchmarks/lce_dw.py timed one 512-token chunk's four steps at 82.8 ms for 32 chunks; `bench ops` times the op at
93.4 ms. This script runs the `bench ops` case (same inputs, same harness call) for leantune and torch.compile under
the CUDA profiler and prints, per fwd+bwd: wall time, summed kernel time, the idle gap between them, and the
kernels by total time. A background `nvidia-smi` log (SM clock, power) shows whether the card clocks down under
the sustained GEMMs.

Usage (GPU): ``PYTHONPATH=src python3 benchmarks/lce_profile.py [OUT_DIR]``
"""
import collections
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_table(prof, calls):
    totals = collections.Counter()
    counts = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            counts[ev.name] += 1
    return {name: (us / calls / 1e3, counts[name] // calls) for name, us in totals.items()}


def main(out_dir):
    from triton.testing import do_bench

    from leantune.bench.ops import _fwd_bwd, case_linear_cross_entropy

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader", "-lms", "100"],
                           stdout=open(f"{out_dir}/smi.csv", "w"), stderr=subprocess.DEVNULL)
    case = case_linear_cross_entropy()
    lines = []
    for name in ("leantune", "torch.compile"):
        call = _fwd_bwd(case.impls[name], case.leaves, case.grad_outputs)
        call()
        torch.cuda.synchronize()
        t0 = time.time()
        ms = do_bench(call, warmup=100, rep=500, return_mode="median")
        t1 = time.time()
        calls = 3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        table = kernel_table(prof, calls)
        busy = sum(v[0] for v in table.values())
        lines.append(f"{name}: do_bench {ms:.2f} ms (window {t0 - smi_t0:.1f}-{t1 - smi_t0:.1f} s); "
                     f"kernels {busy:.2f} ms per call")
        for kname, (kms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:8]:
            lines.append(f"    {kms:8.2f} ms  x{n:<4d} {kname[:110]}")
        prof.export_chrome_trace(f"{out_dir}/{name.replace('.', '_')}_trace.json")
        for t in case.leaves:
            t.grad = None
    smi.terminate()
    smi.wait()
    rows = [r.split(", ") for r in open(f"{out_dir}/smi.csv").read().splitlines() if r.count(",") == 3]
    clocks = sorted(int(r[1].split()[0]) for r in rows)
    power = sorted(float(r[2].split()[0]) for r in rows)
    if clocks:
        lines.append(f"SM clock MHz min/median/max {clocks[0]}/{clocks[len(clocks) // 2]}/{clocks[-1]}; "
                     f"power W median/max {power[len(power) // 2]:.0f}/{power[-1]:.0f} ({len(rows)} samples)")
    print("\n".join(lines))


if __name__ == "__main__":
    smi_t0 = time.time()
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
