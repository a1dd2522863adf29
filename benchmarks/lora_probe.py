"""The LoRA low-rank kernels and the FP8 row quantiser on the card, each beside its memory floor (issues #25, #26).

Run on the card (< 1 min): ``PYTHONPATH=src python3 benchmarks/lora_probe.py [--tokens 4096]``.

- ``lowrank add``: ``_lowrank_add_kernel``, base [M, N] bf16 += s * xa @ B^T with fp32 factors (r 16) at the
  Llama-3-8B projection widths (exact FMA dot: tf32x3 was slower at each of 7 tiles on 2026-12-04, RESULTS.md).
- ``glu lowrank``: ``_glu_forward_lowrank_kernel`` at [M, 14336] (the LoRA MLP's gate/up adds and SwiGLU in one
  pass) with the fp32 x fp32 product as exact FMA (``ieee``, DOT_MODE 0) and as three TF32 tensor-core products
  (``tf32x3``, DOT_MODE 3, :func:`leantune.ops._dot.fp32_product_mode`), a few tiles, warps and load orders,
  beside ``glu_forward`` (the GLU alone); "differ": the fraction of stored h values in which the modes disagree.
- ``skinny``: the LoRA branch's skinny products (``skinny_matmul``: xa = x A^T, g = dY B; ``skinny_tn``: dA = g^T x,
  dB = dY^T xa), bf16 activations with fp32 factors (the exact three-way bf16 split), default launch and variants
  (block_m, block_k, warps, programs per SM for the split), each with its torch sum of split partials.
- ``quant``: ``_quantize_rows_kernel`` (activations: ``quantize_rows``; dY with W's scales:
  ``quantize_grad_output``) at the step's widths, default launch and variants (rows, warps, block).
Floors: bytes moved / 4 TB/s. Times are device times: ``REPS`` back-to-back calls captured in one CUDA graph,
the median replay over ``REPS`` (a single call timed between CUDA events also holds the host's launch latency,
which for kernels of < 0.1 ms is most of it: the 2026-12-04 first run of this probe).
"""

from __future__ import annotations

# ruff: noqa: B023  (each lambda is called at once, inside timed, while its loop variables hold)
import argparse
import contextlib
import functools

import torch
import triton
from fp8_probe import floor_ms

from leantune.ops import _dot, fp8
from leantune.ops.glu import glu_forward
from leantune.ops.lora import glu_lowrank, kernels

RANK, REPS = 16, 20


def timed(fn, replays: int = 10) -> float:
    """Device ms per call of ``fn``: REPS calls in one CUDA graph, median of ``replays`` replays / REPS."""
    for _ in range(3):  # compile and bind outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPS)
    return sorted(times)[len(times) // 2]


@contextlib.contextmanager
def product_mode(mode: int):
    """Force the DOT_MODE of the fp32 x fp32 low-rank products (the launchers read it per call)."""
    saved = _dot.fp32_product_mode
    _dot.fp32_product_mode = lambda out_dtype: mode
    try:
        yield
    finally:
        _dot.fp32_product_mode = saved


MODES = (("ieee", _dot.DOT_IEEE), ("tf32x3", _dot.DOT_TF32X3))


def lowrank_add(m: int, dev) -> None:
    print(f"\nlowrank add, base bf16 [{m}, N] += xa @ B^T, fp32 factors r {RANK}, exact FMA dot (ms)")
    for n in (1024, 4096, 14336):
        base = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        xa = torch.randn(m, RANK, device=dev)
        bt = torch.randn(RANK, n, device=dev) * 0.05
        ms = timed(functools.partial(kernels.lowrank_add_triton, base, xa, bt, 2.0, torch.bfloat16, None, 0, 0.0, None))
        print(f"  N {n:>5}: {ms:.4f} (floor {floor_ms(4 * m * n):.4f})")


def glu(m: int, dev, width: int = 14336) -> None:
    print(f"\nglu lowrank [{m}, {width}] swiglu, fp32 factors r {RANK} (ms)")
    gate = torch.randn(m, width, device=dev, dtype=torch.bfloat16)
    up = torch.randn(m, width, device=dev, dtype=torch.bfloat16)
    xa_g, xa_u = torch.randn(m, RANK, device=dev), torch.randn(m, RANK, device=dev)
    b_g, b_u = torch.randn(width, RANK, device=dev) * 0.05, torch.randn(width, RANK, device=dev) * 0.05
    hs = {}
    for label, mode in MODES:
        with product_mode(mode):
            hs[label] = glu_lowrank.glu_forward_lowrank(gate.clone(), up.clone(), xa_g, b_g, 1.0, xa_u, b_u, 1.0,
                                                        "swiglu")
    print(f"  modes differ in {(hs['ieee'] != hs['tf32x3']).float().mean().item():.2e} of the h values")
    print(f"  glu_forward alone {timed(lambda: glu_forward(gate, up, 'swiglu')):.4f} "
          f"(floor {floor_ms(6 * m * width):.4f}); lowrank floor {floor_ms(10 * m * width):.4f}")
    for label, mode in MODES:
        cells = []
        for block_n, block_i, warps, first in ((64, 128, 8, False), (64, 128, 4, False), (64, 128, 4, True),
                                               (64, 128, 8, True), (128, 128, 8, True), (32, 128, 4, True),
                                               (64, 64, 4, True), (32, 256, 4, True), (128, 64, 4, True)):
            with product_mode(mode):
                ms = timed(lambda: glu_lowrank.glu_forward_lowrank(
                    gate, up, xa_g, b_g, 1.0, xa_u, b_u, 1.0, "swiglu", block_n=block_n, block_i=block_i,
                    num_warps=warps, base_first=first))
            cells.append(f"{block_n}x{block_i} w{warps}{' first' if first else ''} {ms:.4f}")
        print(f"  {label:>6}: " + ", ".join(cells))


SKINNY_VARIANTS = ((64, 128, 4, 4), (64, 256, 4, 4), (128, 128, 8, 4), (64, 128, 4, 8), (32, 256, 4, 4),
                   (64, 128, 8, 2), (128, 256, 8, 2))


def skinny(m: int, dev) -> None:
    print(f"\nskinny products, bf16 [{m}, K] activations, fp32 factors r {RANK} (ms; floor in brackets;"
          " variants block_m x block_k w warps s programs per SM)")
    for k in (4096, 14336):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, RANK, device=dev) * 0.05
        lhs = torch.randn(m, RANK, device=dev)
        for label, fn in (("matmul", kernels.skinny_matmul), ("tn", kernels.skinny_tn)):
            args = (a, b) if label == "matmul" else (lhs, a)
            cells = []
            for block_m, block_k, warps, per_sm in SKINNY_VARIANTS:
                try:
                    ms = f"{timed(functools.partial(fn, *args, block_m=block_m, block_k=block_k, num_warps=warps,
                                                    per_sm=per_sm)):.4f}"
                except triton.runtime.errors.OutOfResources:  # the tile does not fit this card's shared memory
                    ms = "n/a"
                cells.append(f"{block_m}x{block_k} w{warps} s{per_sm} {ms}")
            print(f"  {label:>6} K {k:>5} (floor {floor_ms(2 * m * k):.4f}): " + ", ".join(cells))


def quant(m: int, dev) -> None:
    print(f"\nquant [{m}, C] bf16 (ms; floor in brackets)")
    for n in (1024, 4096, 14336):
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        wq = fp8.quantize_fp8(torch.randn(n, 64, device=dev))
        cells = [f"x {timed(lambda: fp8.quantize_rows(x)):.4f}",
                 f"dY {timed(lambda: fp8.quantize_grad_output(x, wq)):.4f}"]
        variants = [(rows, warps, None) for rows in (1, 2, 4, 8) if rows * n <= 16384 for warps in (2, 4, 8, 16)]
        variants += [(rows, warps, block) for block in (1024, 2048, 4096, 8192) if block < n for rows in (1, 2)
                     for warps in (4, 8)]
        for rows, warps, block in variants:
            ms = timed(lambda: fp8._quantize_rows_triton(x, wq.scale, rows=rows, num_warps=warps, block=block))
            cells.append(f"dY r{rows} w{warps}" + (f" b{block}" if block else "") + f" {ms:.4f}")
        print(f"  C {n:>5} (floor {floor_ms(3 * m * n):.4f}): " + ", ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens")
    lowrank_add(args.tokens, dev)
    glu(args.tokens, dev)
    skinny(args.tokens, dev)
    quant(args.tokens, dev)


if __name__ == "__main__":
    main()
