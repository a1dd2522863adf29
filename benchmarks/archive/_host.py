"""Host issue time of a GPU call, shared by the host-time scripts in this folder (run as ``python3 benchmarks/X.py``,
which puts this folder on the import path)."""
import time

import torch


def host_us(fn, n: int = 20, sleep_cycles: int = int(2e9)) -> float:
    """Mean host time of ``fn()`` in microseconds: ``n`` calls issued behind a GPU sleep kernel, so the host never
    waits on the device. Keep ``n`` x kernels per call under CUDA's ~1024-entry launch queue: a full queue blocks
    the host and its wait would be counted."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us
