"""FP8 frozen-GEMM probe at the Llama-3-8B shapes (issue #26): what each piece of the naive FP8 step costs.

Run on the card (< 2 min): ``PYTHONPATH=src python3 benchmarks/fp8_probe.py [--tokens 4096]``.

For each projection shape (out x in) and 4096 tokens it times, median of CUDA-event timings after warm-up:
- ``bf16 y``: ``x @ W^T`` in bf16 (cuBLAS), the baseline;
- ``fp8 y``: ``torch._scaled_mm`` row-wise, x and W already in e4m3 (``ops.fp8.fp8_linear`` with ``x_quantized``);
- ``fp8 dX``: ``ops.fp8.fp8_grad_input`` as the LoRA backward runs it: dY scaled by W's scales and quantised per
  row, the transposed e4m3 weight copy, ``_scaled_mm``; ``dX GEMM`` the ``_scaled_mm`` alone and ``W^T copy`` the
  transposition alone; ``bf16 dX`` ``dY @ W`` in bf16;
- ``quant x``: the unfused per-row activation quantisation (``ops.fp8.quantize_rows``), the pass stage 2 fuses away;
and prints TFLOP/s and the naive step ratio (bf16 y + dX) / (quant x + fp8 y + fp8 dX).
"""

from __future__ import annotations

import argparse

import torch

from leantune.ops import fp8

SHAPES = (("q/o", 4096, 4096), ("k/v", 1024, 4096), ("gate/up", 14336, 4096), ("down", 4096, 14336))


def timed(fn, iters: int = 50, warmup: int = 10) -> float:
    """Median ms of ``fn()`` over ``iters`` CUDA-event timings."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, m = torch.device("cuda"), args.tokens
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {m} tokens; times in ms (TFLOP/s)")
    cols = ("bf16 y", "fp8 y", "quant x", "bf16 dX", "fp8 dX", "dX GEMM", "W^T copy")
    print(f"{'shape':>18} " + " ".join(f"{c:>15}" for c in cols) + f" {'naive/bf16':>11}")
    for label, n_out, n_in in SHAPES:
        w = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16) / n_in ** 0.5
        x = torch.randn(m, n_in, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(m, n_out, device=dev, dtype=torch.bfloat16)
        wq = fp8.quantize_fp8(w)
        xq = fp8.quantize_rows(x)
        gq, gs = fp8.quantize_rows(dy.float() * wq.scale[None, :])
        wt = fp8._transposed(wq)
        ones = fp8._ones_row(n_in, dev)
        ms = {
            "bf16 y": timed(lambda: x @ w.T),
            "fp8 y": timed(lambda: fp8.fp8_linear(x, wq, out_dtype=torch.bfloat16, x_quantized=xq)),
            "quant x": timed(lambda: fp8.quantize_rows(x)),
            "bf16 dX": timed(lambda: dy @ w),
            "fp8 dX": timed(lambda: fp8.fp8_grad_input(dy, wq, out_dtype=torch.bfloat16)),
            "dX GEMM": timed(lambda: torch._scaled_mm(gq, wt.t(), scale_a=gs[:, None], scale_b=ones,
                                                      out_dtype=torch.bfloat16)),
            "W^T copy": timed(lambda: fp8._transposed(wq)),
        }
        flops = 2.0 * m * n_out * n_in
        cells = []
        for c in cols:
            gemm = c in ("bf16 y", "fp8 y", "bf16 dX", "fp8 dX", "dX GEMM")
            cells.append(f"{ms[c]:7.3f}" + (f" ({flops / ms[c] / 1e9:5.0f})" if gemm else " " * 8))
        naive = (ms["bf16 y"] + ms["bf16 dX"]) / (ms["quant x"] + ms["fp8 y"] + ms["fp8 dX"])
        err = ((fp8.fp8_linear(x, wq, out_dtype=torch.float32).double() - (x.double() @ w.double().T)).norm()
               / (x.double() @ w.double().T).norm()).item()
        print(f"{label:>7} {n_out:>5}x{n_in:<5} " + " ".join(f"{c:>15}" for c in cells)
              + f" {naive:10.2f}x  (y rel err {err:.3f})")


if __name__ == "__main__":
    main()
