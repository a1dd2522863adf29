"""gpt-oss attention with sinks on the card: transformers' eager function (with its eager mask) vs ops.sink_attention
(no mask on full layers, its own band on sliding ones), forward + backward of one layer call at the gpt-oss-20b
attention shape (H 64, Hkv 8, D 64, window 128), bf16, per layer type and sequence length.

    PYTHONPATH=src python benchmarks/sink_attention_probe.py                 # S = 2048, 4096, 8192 (< 2 min)
    PYTHONPATH=src python benchmarks/sink_attention_probe.py --seq 128 --cpu  # a smoke run on the CPU

Columns: median ms of forward + backward (CUDA events around single calls, 10 after warm-up), the peak memory
allocated above the inputs during the call, and the agreement of the outputs (relative error of leantune's against
an fp32 eager reference, beside HF's bf16 eager against the same). HF's eager at 8192 may run out of memory: then
the row says OOM. Nothing here has run on the card yet (docs/design.md, gpt-oss: the predictions).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leantune import ops

HEADS, KV_HEADS, DIM, WINDOW, BATCH = 64, 8, 64, 128, 1


class _Module(torch.nn.Module):
    """What transformers' eager_attention_forward reads of the attention module."""

    def __init__(self, sinks):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.num_key_value_groups = HEADS // KV_HEADS


def _inputs(seq, device, dtype, rounded):
    """Draws in fp32, rounded to ``rounded`` (the run's dtype), held in ``dtype``: the fp32 reference sees the
    run's values."""
    torch.manual_seed(0)
    shapes = [(BATCH, HEADS, seq, DIM), (BATCH, KV_HEADS, seq, DIM), (BATCH, KV_HEADS, seq, DIM), (HEADS,)]
    q, k, v, sinks = (torch.randn(shape, device=device).to(rounded).to(dtype) for shape in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), sinks


def _calls(seq, window, device, dtype, rounded=None):
    from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function
    from transformers.models.gpt_oss import modeling_gpt_oss

    q, k, v, sinks = _inputs(seq, device, dtype, rounded or dtype)
    module = _Module(sinks.clone()).to(device)
    function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    mask = eager_mask(BATCH, seq, seq, mask_function=function, dtype=dtype, device=device)
    sinks.requires_grad_()
    scaling = DIM ** -0.5

    def hf():
        return modeling_gpt_oss.eager_attention_forward(module, q, k, v, mask, scaling=scaling)[0]

    def ours():
        return ops.sink_attention(q, k, v, sinks, scaling=scaling, sliding_window=window)

    return hf, ours, (q, k, v)


def _timed(fn, device, reps=10):
    def step():
        fn().float().sum().backward()

    for _ in range(2):
        step()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            step()
        return (time.perf_counter() - start) / reps * 1e3
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _peak_mib(fn, device):
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn().float().sum().backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (smoke run; fp32)")
    args = parser.parse_args()
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    print(f"gpt-oss-20b attention: H {HEADS}, Hkv {KV_HEADS}, D {DIM}, window {WINDOW}, B {BATCH}, {dtype}, {device}")
    print("| S | layer | HF eager ms | ours ms | HF peak MiB | ours peak MiB | HF rel err | ours rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in args.seq:
        for window in (WINDOW, None):
            hf, ours, _ = _calls(seq, window, device, dtype)
            ours_err = hf_err = float("nan")
            try:
                with torch.no_grad():  # the agreement against an fp32 eager reference (itself may not fit)
                    ref = _calls(seq, window, device, torch.float32, dtype)[0]()
                    ours_err, hf_err = _rel(ours(), ref), _rel(hf(), ref)
                    del ref
            except torch.OutOfMemoryError:
                pass
            try:
                hf_ms, hf_peak = _timed(hf, device), _peak_mib(hf, device)
            except torch.OutOfMemoryError:
                hf_ms, hf_peak = "OOM", "OOM"
            ours_ms, ours_peak = _timed(ours, device), _peak_mib(ours, device)
            fmt = (lambda x: x if isinstance(x, str) else f"{x:.2f}")
            print(f"| {seq} | {'sliding' if window else 'full'} | {fmt(hf_ms)} | {fmt(ours_ms)} | {fmt(hf_peak)} | "
                  f"{fmt(ours_peak)} | {hf_err:.2e} | {ours_err:.2e} |")
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
