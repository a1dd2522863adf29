"""Sweep of the NF4 dequantisation kernel's launch shapes on the GPU (14336 x 4096 -> bf16), each checked equal to
bitsandbytes' CUDA dequantisation (the select-tree lookup it also swept is gone: RESULTS.md). Run from the repo root:
PYTHONPATH=src python3 benchmarks/nf4_sweep.py"""
import bitsandbytes.functional as bnb
import torch
from triton.testing import do_bench

from leantune.ops import NF4Weight, nf4

w = (torch.randn(14336, 4096, device="cuda") * 0.02).to(torch.bfloat16)
packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
q = NF4Weight.from_bnb(packed, state)
ref = bnb.dequantize_4bit(packed, state)
out = torch.empty_like(ref)
table = nf4._tables(str(q.device))[0]
floor_ms = w.numel() * (0.5 + 2 + 1 / 64) / 4.27e12 * 1e3
print(f"floor {floor_ms:.4f} ms; bitsandbytes {do_bench(lambda: bnb.dequantize_4bit(packed, state, out=out)):.4f} ms")
print("| blocks per program | warps | ms | % of floor | equal |")
print("|---|---|---|---|---|")
triton_cdiv = lambda a, b: (a + b - 1) // b  # noqa: E731
for blocks in (32, 64, 128, 256):
    for warps in (2, 4, 8):
        def launch(blocks=blocks, warps=warps):
            nf4._dequantize_nf4_kernel[(triton_cdiv(q.n_blocks, blocks),)](
                q.codes, q.absmax_codes, q.nested_absmax, q.nested_code, table, out, q.offset, q.n_blocks,
                BLOCKS=blocks, BLOCKSIZE_=64, NESTED_BLOCKSIZE_=256, num_warps=warps, enable_fp_fusion=False)
        out.fill_(float("nan"))
        launch()
        equal = torch.equal(out, ref)
        ms = do_bench(launch)
        print(f"| {blocks} | {warps} | {ms:.4f} | {100 * floor_ms / ms:.0f}% | {equal} |")
