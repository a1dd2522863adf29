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

``fp8 dX``, ``quant x`` and ``W^T copy`` are the Triton backend's paths (the kernels of ops/fp8.py). Beside them, the
torch chains they replaced (sixth session: quant x 0.242 ms at 4096 x 4096, W^T copy 0.347 ms at 14336 x 4096):
``quant x torch`` (``_quantize_rows_torch``), ``dY quant`` (the fused kernel, ``quantize_grad_output``) against
``dY quant torch`` (``dy.float() * s_w`` then the torch quantisation), ``W^T torch`` (``copy_`` of the transposed
view) and ``dX torch`` (``fp8 dX`` built from those torch pieces), with the memory floors (bytes moved / 4 TB/s)
and a bit-for-bit check of each kernel against its torch chain on the card. ``--sweep`` also times launch variants
of the two kernels (block, rows, warps).

Groups (q/k/v, gate/up: projections of one x): ``separate`` is the per-projection dX path (one ``fp8_grad_input``
each, summed in bf16), ``grouped`` :func:`ops.fp8_group.fp8_grad_input_group` (one quantisation over the side-by-side
dY's, one ``_scaled_mm`` of reduction length sum out_j), with its parts ``quant`` (``quantize_grad_outputs``) and
``W^T`` (the stacked transposed codes), and a bit-for-bit check of the group quantisation against its torch chain.
"""

from __future__ import annotations

import argparse

import torch

from leantune.ops import fp8, fp8_group, glu, glu_fp8
from leantune.ops.lora import glu_lowrank

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


BANDWIDTH = 4.0e12  # bytes/s, the H200's HBM3e at ~83% of its 4.8 TB/s peak: what the floors use


def floor_ms(n_bytes: float) -> float:
    return n_bytes / BANDWIDTH * 1e3


def same(got, ref) -> bool:
    """Codes (NaN aside) and scales equal bit for bit."""
    (q, s), (q_ref, s_ref) = got, ref
    return torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def kernels(m: int, dev: torch.device, sweep: bool) -> None:
    """The Triton kernels beside the torch chains they replaced, per shape, with floors and a bit-exact check."""
    print(f"\nkernels (ms; floor = bytes / {BANDWIDTH / 1e12:.0f} TB/s in brackets)")
    print(f"{'shape':>18} " + " ".join(f"{c:>17}" for c in KERNEL_COLUMNS) + "  bit-exact")
    for label, n_out, n_in in SHAPES:
        kernel_row(label, n_out, n_in, m, dev, sweep)


KERNEL_COLUMNS = ("quant x", "quant x torch", "dY quant", "dY quant torch", "W^T copy", "W^T torch")


def kernel_row(label: str, n_out: int, n_in: int, m: int, dev: torch.device, sweep: bool) -> None:
    w = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16) / n_in ** 0.5
    x = torch.randn(m, n_in, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n_out, device=dev, dtype=torch.bfloat16)
    wq = fp8.quantize_fp8(w)
    workspace = torch.empty((n_in, n_out), dtype=fp8.E4M3, device=dev)
    ms = {
        "quant x": timed(lambda: fp8.quantize_rows(x)),
        "quant x torch": timed(lambda: fp8._quantize_rows_torch(x)),
        "dY quant": timed(lambda: fp8.quantize_grad_output(dy, wq)),
        "dY quant torch": timed(lambda: fp8._quantize_rows_torch(dy.float() * wq.scale[None, :])),
        "W^T copy": timed(lambda: fp8._transposed(wq)),
        "W^T torch": timed(lambda: workspace.copy_(wq.qweight.t())),
    }
    # bytes: bf16 read + e4m3 written per element and 4 per row scale (+ 4 per column multiplier); 1 + 1 per weight
    quant_x, quant_dy = floor_ms(m * n_in * 3 + 4 * m), floor_ms(m * n_out * 3 + 4 * (m + n_out))
    floors = dict(zip(KERNEL_COLUMNS, (quant_x, quant_x, quant_dy, quant_dy, floor_ms(2 * n_out * n_in),
                                       floor_ms(2 * n_out * n_in))))
    exact = (same(fp8.quantize_rows(x), fp8._quantize_rows_torch(x))
             and same(fp8.quantize_grad_output(dy, wq), fp8._quantize_rows_torch(dy.float() * wq.scale[None, :]))
             and torch.equal(fp8._transposed(wq).view(torch.uint8), wq.qweight.view(torch.uint8).t()))
    cells = [f"{ms[c]:7.3f} ({floors[c]:6.3f})" for c in KERNEL_COLUMNS]
    print(f"{label:>7} {n_out:>5}x{n_in:<5} " + " ".join(f"{c:>17}" for c in cells) + f"  {exact}")
    if sweep:
        variants = [(f"quant x warps={warps} rows={rows}",
                     lambda warps=warps, rows=rows: fp8._quantize_rows_triton(x, rows=rows, num_warps=warps))
                    for warps in (4, 8, 16) for rows in (1, 2)]
        variants.append(("quant x loop 4096", lambda: fp8._quantize_rows_triton(x, block=4096)))
        variants += [(f"W^T block={block} warps={warps}",
                      lambda block=block, warps=warps: fp8._transposed(wq, block=block, num_warps=warps))
                     for block, warps in ((32, 4), (64, 4), (64, 8), (128, 8), (128, 16))]
        print("          " + ", ".join(f"{name} {timed(fn):.3f}" for name, fn in variants))


GROUPS = (("q/k/v", (4096, 1024, 1024), 4096), ("gate/up", (14336, 14336), 4096))


def groups(m: int, dev: torch.device) -> None:
    """A group's dX as one e4m3 GEMM against the per-projection GEMMs and their bf16 sum."""
    print(f"\ngroups (ms): {'separate':>9} {'grouped':>8} {'quant':>7} {'W^T':>7}  bit-exact")
    for label, outs, n_in in GROUPS:
        ws = [fp8.quantize_fp8(torch.randn(n, n_in, device=dev, dtype=torch.bfloat16) / n_in ** 0.5) for n in outs]
        dys = [torch.randn(m, n, device=dev, dtype=torch.bfloat16) for n in outs]

        def separate():
            dx = fp8.fp8_grad_input(dys[0], ws[0], out_dtype=torch.bfloat16)
            for dy, w in zip(dys[1:], ws[1:]):
                dx.add_(fp8.fp8_grad_input(dy, w, out_dtype=torch.bfloat16))
            return dx

        ms = [timed(separate), timed(lambda: fp8_group.fp8_grad_input_group(dys, ws, out_dtype=torch.bfloat16)),
              timed(lambda: fp8_group.quantize_grad_outputs(dys, ws)), timed(lambda: fp8_group._transposed_group(ws))]
        ref = fp8._quantize_rows_torch(torch.cat([dy.float() * w.scale[None, :] for dy, w in zip(dys, ws)], dim=1))
        exact = same(fp8_group.quantize_grad_outputs(dys, ws), ref)
        print(f"{label:>11}   " + " ".join(f"{t:8.3f}" for t in ms) + f"  {exact}")


def glu_dy(m: int, dev: torch.device, sweep: bool) -> None:
    """The LoRA MLP's gate/up dY codes: GLU backward then the group's quantisation pass, against the GLU backward
    that writes the codes itself (``glu_fp8.glu_backward_fp8``, the default; ``LEANTUNE_FP8_FUSED_DY=0`` is the
    former)."""
    n = 14336
    ws = [fp8.quantize_fp8(torch.randn(n, 4096, device=dev, dtype=torch.bfloat16) / 64.0) for _ in range(2)]
    dh, gate, up = (torch.randn(m, n, device=dev, dtype=torch.bfloat16) for _ in range(3))

    def separate():
        d_gate, d_up = glu.glu_backward(dh, gate, up, "swiglu")
        return fp8_group.quantize_grad_outputs([d_gate, d_up], ws)

    def fused():
        return glu_fp8.glu_backward_fp8(dh, gate, up, "swiglu", ws[0].scale, ws[1].scale)[2]

    ms = [timed(separate), timed(lambda: glu.glu_backward(dh, gate, up, "swiglu")), timed(fused)]
    exact = same(fused(), separate())
    # bytes: separate reads dh, gate, up, writes d_gate, d_up (10 B a column pair), reads them again (4), writes codes
    # (2); fused 12
    print(f"\ngate/up dY codes [{m}, 2 x {n}] (ms): separate {ms[0]:.3f} (GLU bwd {ms[1]:.3f}), fused {ms[2]:.3f} "
          f"(floor {floor_ms(12.0 * m * n):.3f}), bit-exact {exact}")
    if sweep:
        def variant(block, warps):
            return timed(lambda: glu_fp8._backward_fp8_triton(dh, gate, up, "swiglu", ws[0].scale, ws[1].scale,
                                                              False, block=block, num_warps=warps))

        print("          " + ", ".join(f"block {b} w{w} {variant(b, w):.3f}"
                                       for b in (1024, 2048, 4096) for w in (4, 8, 16)))


def glu_h_codes(m: int, dev: torch.device) -> None:
    """The LoRA MLP's forward h codes (down's FP8 input): the tiled low-rank GLU kernel, then the row quantiser
    reading h twice (before 2026-12-07), against the kernel writing its tiles' row absmaxes and a quantiser that
    reads h once (``glu_lowrank``, the default)."""
    n, r = 14336, 16
    gate, up = (torch.randn(m, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    xa_g, xa_u = (torch.randn(m, r, device=dev) for _ in range(2))
    b_g, b_u = (torch.randn(n, r, device=dev) * 0.01 for _ in range(2))

    def run(fp8_out):
        return glu_lowrank._forward_lowrank_triton(gate, up, xa_g, b_g, 0.5, xa_u, b_u, 0.5, "swiglu",
                                                   torch.bfloat16, fp8_out)

    def before():
        return fp8._quantize_rows_triton(run(False))

    ms = [timed(before), timed(lambda: run(False)), timed(lambda: run(True))]
    h, codes = run(True)
    exact = same(codes, fp8._quantize_rows_triton(h))
    # bytes: kernel reads gate, up, writes them and h (10 B a column); quantiser reads h twice (4) writes codes (1)
    print(f"\nLoRA GLU h codes [{m}, {n}] (ms): kernel + row quantiser {ms[0]:.3f} (kernel {ms[1]:.3f}), "
          f"with tile absmaxes {ms[2]:.3f} (floor {floor_ms(13.0 * m * n):.3f}), bit-exact {exact}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--sweep", action="store_true", help="also time launch variants of the kernels")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, m = torch.device("cuda"), args.tokens
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {m} tokens; times in ms (TFLOP/s)")
    cols = ("bf16 y", "fp8 y", "quant x", "bf16 dX", "fp8 dX", "dX torch", "dX GEMM", "W^T copy")
    print(f"{'shape':>18} " + " ".join(f"{c:>15}" for c in cols) + f" {'naive/bf16':>11} {'(torch)':>8}")
    for label, n_out, n_in in SHAPES:
        w = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16) / n_in ** 0.5
        x = torch.randn(m, n_in, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(m, n_out, device=dev, dtype=torch.bfloat16)
        wq = fp8.quantize_fp8(w)
        xq = fp8.quantize_rows(x)
        gq, gs = fp8.quantize_rows(dy.float() * wq.scale[None, :])
        wt = fp8._transposed(wq)
        ones = fp8._ones_row(n_in, dev)
        workspace = torch.empty((n_in, n_out), dtype=fp8.E4M3, device=dev)

        def dx_torch():  # the pre-kernel fp8_grad_input: fp32 dY product, torch quantisation, torch transpose copy
            g = fp8._quantize_rows_torch(dy.float() * wq.scale[None, :])
            return fp8._scaled_mm(*g, workspace.copy_(wq.qweight.t()).t(), ones, torch.bfloat16)

        ms = {
            "bf16 y": timed(lambda: x @ w.T),
            "fp8 y": timed(lambda: fp8.fp8_linear(x, wq, out_dtype=torch.bfloat16, x_quantized=xq)),
            "quant x": timed(lambda: fp8.quantize_rows(x)),
            "bf16 dX": timed(lambda: dy @ w),
            "fp8 dX": timed(lambda: fp8.fp8_grad_input(dy, wq, out_dtype=torch.bfloat16)),
            "dX torch": timed(dx_torch),
            "quant x torch": timed(lambda: fp8._quantize_rows_torch(x)),
            "dX GEMM": timed(lambda: torch._scaled_mm(gq, wt.t(), scale_a=gs[:, None], scale_b=ones,
                                                      out_dtype=torch.bfloat16)),
            "W^T copy": timed(lambda: fp8._transposed(wq)),
        }
        flops = 2.0 * m * n_out * n_in
        cells = []
        for c in cols:
            gemm = c in ("bf16 y", "fp8 y", "bf16 dX", "fp8 dX", "dX torch", "dX GEMM")
            cells.append(f"{ms[c]:7.3f}" + (f" ({flops / ms[c] / 1e9:5.0f})" if gemm else " " * 8))
        naive = (ms["bf16 y"] + ms["bf16 dX"]) / (ms["quant x"] + ms["fp8 y"] + ms["fp8 dX"])
        naive_torch = (ms["bf16 y"] + ms["bf16 dX"]) / (ms["quant x torch"] + ms["fp8 y"] + ms["dX torch"])
        err = ((fp8.fp8_linear(x, wq, out_dtype=torch.float32).double() - (x.double() @ w.double().T)).norm()
               / (x.double() @ w.double().T).norm()).item()
        print(f"{label:>7} {n_out:>5}x{n_in:<5} " + " ".join(f"{c:>15}" for c in cells)
              + f" {naive:10.2f}x {naive_torch:7.2f}x  (y rel err {err:.3f})")
    kernels(m, dev, args.sweep)
    groups(m, dev)
    glu_dy(m, dev, args.sweep)
    glu_h_codes(m, dev)


if __name__ == "__main__":
    main()
