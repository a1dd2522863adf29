"""DoRA's column scalings at the Llama-3-8B shape: the torch calls they replace against the Triton kernels, and what
a training step (7 DoRA projections x 32 layers, checkpointing on) should save.

Per [N, out] tensor (N = --rows, out in 1024 / 4096 / 14336, bf16, fp32 g, rank 16 fp32 adapters):
- forward / recompute: old = low-rank add (``lowrank_add_triton``) then ``torch.mul(u, g, out=y)``;
  new = ``lowrank_add_scale_triton`` (u and y in one pass);
- MLP backward's gate/up rebuild: old = ``torch.mul``; new = ``column_scale``;
- backward: old = ``column_dot`` (dm) then ``torch.mul(dy, g, out=...)`` (dY'); new = ``scale_column_dot``.
Each line gives ms per call (median of CUDA-event timings) and the GB/s of the bytes the call must move. The step
projection counts per layer: every projection twice in forward (forward and recompute) and once in backward, gate
and up once more for the rebuild (the 8B profile's 736 = 32 x (2 x 7 + 2 + 7) torch muls).

    python benchmarks/dora_scale_probe.py                       # on the card, ~20 s
    TRITON_INTERPRET=1 python benchmarks/dora_scale_probe.py --device cpu --rows 70 --widths 130,300 --reps 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leantune.ops.lora import column_kernels, kernels

LAYERS = 32
PROJECTIONS = {"q": 4096, "k": 1024, "v": 1024, "o": 4096, "gate": 14336, "up": 14336, "down": 4096}


def timed(fn, reps, device):
    """Median ms of ``reps`` calls (CUDA events on the card, wall clock elsewhere), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(rows, width, rank, reps, device):
    """{name: ms per call} for one [rows, width] projection output."""
    bf16 = torch.bfloat16
    u = torch.randn(rows, width, device=device).to(bf16)
    dy = torch.randn(rows, width, device=device).to(bf16)
    xa = torch.randn(rows, rank, device=device)
    lora_B = torch.randn(width, rank, device=device) * 0.02
    g = torch.rand(width, device=device) + 0.5
    y = torch.empty_like(u)

    def old_forward():
        kernels.lowrank_add_triton(u, xa, lora_B.T, 2.0, bf16, None, 0, 0.0, None)
        torch.mul(u, g, out=y)

    def old_backward():
        column_kernels.column_dot(dy, u)
        torch.mul(dy, g, out=y)

    return {
        "fwd_old": timed(old_forward, reps, device),
        "fwd_new": timed(lambda: kernels.lowrank_add_scale_triton(u, xa, lora_B.T, 2.0, bf16, g), reps, device),
        "mul_old": timed(lambda: torch.mul(u, g, out=y), reps, device),
        "mul_new": timed(lambda: column_kernels.column_scale(u, g, out=y), reps, device),
        "bwd_old": timed(old_backward, reps, device),
        "bwd_new": timed(lambda: column_kernels.scale_column_dot(dy, u, g), reps, device),
    }


# bytes per element each call must move (bf16 = 2): the add reads u and writes it (+ y); the scale reads and writes;
# the backward reads dY and u (+ writes dY'); the old backward reads dY and u for dm, then dY again for dY'
BYTES = {"fwd_old": 8, "fwd_new": 6, "mul_old": 4, "mul_new": 4, "bwd_old": 8, "bwd_new": 6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=4096, help="N = batch x sequence (default: 4096)")
    parser.add_argument("--widths", default="1024,4096,14336", help="output widths to time (default: 8B's)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    widths = [int(w) for w in args.widths.split(",")]
    results = {w: measure(args.rows, w, args.rank, args.reps, device) for w in widths}
    print(f"| out | {' | '.join(f'{k} ms (GB/s)' for k in BYTES)} |")
    print(f"|---|{'---|' * len(BYTES)}")
    for w, r in results.items():
        cells = [f"{r[k]:.4f} ({BYTES[k] * args.rows * w / r[k] / 1e6:.0f})" for k in BYTES]
        print(f"| {w} | {' | '.join(cells)} |")
    if all(w in results for w in set(PROJECTIONS.values())):
        old = new = 0.0
        for name, w in PROJECTIONS.items():
            r = results[w]
            rebuild = name in ("gate", "up")
            old += 2 * r["fwd_old"] + r["bwd_old"] + (r["mul_old"] if rebuild else 0.0)
            new += 2 * r["fwd_new"] + r["bwd_new"] + (r["mul_new"] if rebuild else 0.0)
        print(f"\nper step ({LAYERS} layers x {len(PROJECTIONS)} projections): old {LAYERS * old:.1f} ms, "
              f"new {LAYERS * new:.1f} ms, saving {LAYERS * (old - new):.1f} ms "
              "(old includes the low-rank adds and column dots that the new kernels absorb)")


if __name__ == "__main__":
    main()
