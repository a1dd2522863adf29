"""Issue 4, QKV: does removing split-K (and so its torch.sum launches) pay off when the host is the bottleneck?

The fused QKV block issues 12 Triton kernels and ~8 split-K partial sums per fwd+bwd; on a slow host the harness
time is the host's issue time (RESULTS.md, third session). This script times the lora_qkv case (fp32 and bf16
adapters) and PEFT in one process, each as: harness time (``do_bench`` of fwd+bwd), CUDA-graph device time, and
host issue time (20 calls behind a GPU sleep), for

- ``split-K``: the library as is (``lora._splits`` picks enough splits to fill the card);
- ``no split``: ``lora._splits`` patched to one split (64 row tiles of 64 rows: fewer programs, no partial sums);
- ``no split, small tiles``: one split with 16-row tiles in the skinny matmuls and 32-column tiles in the
  transposed ones, so that the tile grid alone has more programs (the device time ``no split`` lost came from
  filling half the SMs).

Usage (GPU): ``PYTHONPATH=src python3 benchmarks/qkv_variants.py``. Prints one table.
"""
import importlib

from _host import host_us

bench = importlib.import_module("leantune.bench.ops")
lora = importlib.import_module("leantune.ops.lora")
split_k = lora._splits


def one_split(device, n_tiles, n_inner, block, per_sm):
    return 1, -(-n_inner // block) * block


skinny_matmul, skinny_tn = lora._skinny_matmul, lora._skinny_tn


def small_tiles():
    lora._splits = one_split
    lora._skinny_matmul = lambda *a, **k: skinny_matmul(*a, **{"block_m": 16, **k})
    lora._skinny_tn = lambda *a, **k: skinny_tn(*a, **{"block_k": 32, **k})


def restore():
    lora._splits, lora._skinny_matmul, lora._skinny_tn = split_k, skinny_matmul, skinny_tn


VARIANTS = {"split-K": restore, "no split": lambda: setattr(lora, "_splits", one_split),
            "no split, small tiles": small_tiles}
rows = []
for name in ("lora_qkv", "lora_qkv_bf16"):
    case = bench.CASES[name]()
    for impl, fn in case.impls.items():
        variants = VARIANTS if impl == "leantune" else {"": restore}
        for label, apply in variants.items():
            apply()
            call = bench._fwd_bwd(fn, case.leaves, case.grad_outputs)
            ms, _ = bench.time_and_peak(fn, case)
            graph = bench.graph_ms(fn, case)
            rows.append((case.op, f"{impl} {label}".strip(), ms, graph, host_us(call)))
            restore()
print("| case | impl | fwd+bwd ms | graph ms | host us per call |")
print("|---|---|---|---|---|")
for op, impl, ms, graph, host in rows:
    print(f"| {op} | {impl} | {ms:.3f} | {graph:.3f} | {host:.0f} |")
