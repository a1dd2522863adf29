"""Issue #27's log-prob head row on the card: peak memory and time of ``ops.linear_log_probs`` forward + backward at
N = 65,536 tokens, H = 4,096 (the hidden size of the 8B shapes: Llama-3-8B's and Qwen3-8B's), V = 151,936 (Qwen's
vocabulary), bf16, beside the plain torch path (``hidden @ weight.T`` in bf16, ``log_softmax`` in fp32, ``gather``:
[N, V] logits twice over, so it runs at a smaller N, and at the full N it runs out of memory or not).

    PYTHONPATH=src python benchmarks/log_probs_probe.py                      # the card (< 2 min)
    PYTHONPATH=src python benchmarks/log_probs_probe.py --device cpu --n 256 --hidden 32 --vocab 1000 --torch-n 256

Cases (rows): leantune with the gradient of the hidden states only (the lm_head frozen, as under LoRA: the GRPO
case), at the op's default 256 MiB logits chunk, with the entropy returned too (what GRPOTrainer asks under
``patch_trainer``; its gradient not asked for, as without an entropy bonus), at the former 32 MiB default, and with the
weight's gradient too (a trainable lm_head); then the torch path (hidden's gradient) at each ``--torch-n``.

Inputs: hidden [N, H] ~ N(0, 1), weight [V, H] ~ N(0, 0.02^2) (logits of std ~1.3), tokens [N] int64 uniform,
upstream gradient [N] fp32 ~ N(0, 1) on the log-probs (per-token weights, as GRPO's advantages). Columns:

- median ms: wall time of one forward + backward (``torch.autograd.grad``, the gradients returned), CUDA-synchronised,
  median of ``--reps`` (>= 5) after ``--warmup`` calls.
- peak beyond inputs GiB: ``max_memory_allocated`` during one call minus ``memory_allocated`` before it (the inputs
  and the upstream gradient, which are all that is allocated then); the returned gradients are inside it.
- beyond inputs and grads GiB: the same minus the bytes of the returned gradients (dhidden 0.5 GiB at the full
  shape; dweight 1.16 GiB more): the op's own working memory. Issue #27's target (<= 1.5 GiB beyond inputs) is read
  on the first column of the GRPO row.
- logp err, dhidden err: against a float64 computation of the first ``--ref-rows`` rows (a row's log-prob and
  dhidden depend on that row only, so this is exact for those rows): max |logp - logp64| and
  ||dh - dh64|| / ||dh64|| over them.

On the CPU (the dry run for tests) the memory columns are "—" (no allocator statistics) and the dtype is fp32
unless ``--dtype bf16``. The last thing printed is the markdown table; ``--out FILE`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch

from leantune import ops

GIB = 2**30
GRPO_CASE = "with entropy, GRPO's call"  # the row issue #27's target is read on
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _inputs(n, hidden_size, vocab, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g).to(device=device, dtype=dtype)
    weight = (0.02 * torch.randn(vocab, hidden_size, generator=g)).to(device=device, dtype=dtype)
    tokens = torch.randint(0, vocab, (n,), generator=g).to(device)
    upstream = torch.randn(n, generator=g).to(device)
    return hidden, weight, tokens, upstream


def leantune_path(chunk_mib=None, entropy=False):
    chunk = None if chunk_mib is None else int(chunk_mib * 2**20)

    def run(hidden, weight, tokens):
        out = ops.linear_log_probs(hidden, weight, tokens, entropy=entropy, chunk_bytes=chunk)
        return out[0] if entropy else out

    return run


def torch_path(hidden, weight, tokens):
    """The plain path: [N, V] logits in the inputs' dtype, log_softmax in fp32, the tokens' entries."""
    logits = hidden @ weight.T
    return logits.float().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(1)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _call(fn, hidden, weight, tokens, upstream, wrt):
    return torch.autograd.grad(fn(hidden, weight, tokens), wrt, grad_outputs=upstream)


def measure(fn, hidden, weight, tokens, upstream, wrt, device, reps, warmup) -> dict:
    """Median ms of forward + backward and the peak above what is allocated before a call (module docstring)."""
    for _ in range(warmup):
        _call(fn, hidden, weight, tokens, upstream, wrt)
    row = {"peak_gib": None, "working_gib": None}
    if device == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = _call(fn, hidden, weight, tokens, upstream, wrt)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        del grads
        row.update(peak_gib=peak / GIB, working_gib=(peak - grad_bytes) / GIB, grads_gib=grad_bytes / GIB)
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        grads = _call(fn, hidden, weight, tokens, upstream, wrt)
        _sync(device)
        times.append(time.perf_counter() - start)
        del grads
    row["ms"] = 1e3 * statistics.median(times)
    return row


def reference(hidden, weight, tokens, upstream, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log-probs and dhidden of the first ``rows`` rows."""
    h = hidden[:rows].double().requires_grad_()
    logp = (h @ weight.double().T).log_softmax(-1).gather(-1, tokens[:rows, None]).squeeze(1)
    (dh,) = torch.autograd.grad(logp, h, grad_outputs=upstream[:rows].double())
    return logp.detach(), dh


def errors(fn, hidden, weight, tokens, upstream, ref) -> tuple[float, float]:
    """(max |logp - logp64|, ||dh - dh64|| / ||dh64||) over the reference rows (the whole batch runs: the op's
    chunking is what is checked)."""
    logp64, dh64 = ref
    rows = logp64.shape[0]
    h = hidden.detach().requires_grad_()
    logp = fn(h, weight.detach(), tokens)
    (dh,) = torch.autograd.grad(logp, h, grad_outputs=upstream)
    logp_err = (logp[:rows].double() - logp64).abs().max().item()
    dh_err = ((dh[:rows].double() - dh64).norm() / dh64.norm()).item()
    return logp_err, dh_err


def _run_case(name, fn, n, wants_weight, args, device, dtype, note=""):
    row = {"path": name, "n": n, "grads": "hidden+weight" if wants_weight else "hidden", "note": note}
    try:
        hidden, weight, tokens, upstream = _inputs(n, args.hidden, args.vocab, dtype, device, args.seed)
        row["inputs_gib"] = sum(t.numel() * t.element_size() for t in (hidden, weight, tokens, upstream)) / GIB
        ref = reference(hidden, weight, tokens, upstream, min(args.ref_rows, n))
        row["logp_err"], row["dhidden_err"] = errors(fn, hidden, weight, tokens, upstream, ref)
        del ref
        hidden.requires_grad_()
        weight.requires_grad_(wants_weight)
        wrt = (hidden, weight) if wants_weight else (hidden,)
        row.update(measure(fn, hidden, weight, tokens, upstream, wrt, device, args.reps, args.warmup))
        row["status"] = "ok"
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc).splitlines()[0][:200])
    finally:
        hidden = weight = tokens = upstream = None  # noqa: F841 (freed before the next case)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    def num(value, fmt):
        return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    lines = ["| path | N | grads | median ms | inputs GiB | peak beyond inputs GiB | beyond inputs and grads GiB "
             "| logp err vs fp64 | dhidden rel err vs fp64 | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["path"] + (f" ({r['note']})" if r.get("note") else "")
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['n']:,} | {r['grads']} | | {num(r.get('inputs_gib'), '.2f')} | | | | | "
                         f"{r['status']}: {r.get('error', '')[:60]} |")
            continue
        lines.append(f"| {name} | {r['n']:,} | {r['grads']} | {r['ms']:.1f} | {r['inputs_gib']:.2f} | "
                     f"{num(r['peak_gib'], '.3f')} | {num(r['working_gib'], '.3f')} | {r['logp_err']:.2e} | "
                     f"{r['dhidden_err']:.2e} | ok |")
    return "\n".join(lines)


def verdict(grpo: dict) -> str:
    """Issue #27's line: the GRPO row's peak beyond inputs against 1.5 GiB."""
    if grpo["status"] != "ok" or grpo["peak_gib"] is None:
        return f"#27 target (<= 1.5 GiB beyond inputs, N {grpo['n']:,}): not measured ({grpo['status']}, no CUDA peak)"
    met = "met" if grpo["peak_gib"] <= 1.5 else "NOT met"
    return (f"#27 target (<= 1.5 GiB beyond inputs, N {grpo['n']:,}, GRPO's call): {grpo['peak_gib']:.3f} GiB, {met}")


def _positive_ints(text):
    values = [int(v) for v in text.split(",") if v.strip()]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=65536, help="tokens (rows)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size H")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary V")
    p.add_argument("--torch-n", type=_positive_ints, default=[8192, 65536], help="N of the torch path's rows")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ref-rows", type=int, default=1024, help="rows checked against float64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    for name in ("n", "hidden", "vocab", "reps", "ref_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU (use --device cpu for the dry run)")
    dtype = DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp64 reference and the fp32 paths untouched by TF32
    cases = [("leantune", leantune_path(), args.n, False, "256 MiB chunks (the default)"),
             ("leantune", leantune_path(entropy=True), args.n, False, GRPO_CASE),
             ("leantune", leantune_path(chunk_mib=32), args.n, False, "32 MiB chunks"),
             ("leantune", leantune_path(), args.n, True, "trainable lm_head")]
    cases += [("torch", torch_path, n, False, "") for n in args.torch_n]
    rows = []
    for name, fn, n, wants_weight, note in cases:
        rows.append(_run_case(name, fn, n, wants_weight, args, args.device, dtype, note))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "dtype": str(dtype), "device": args.device,
                                              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                                              "torch": torch.__version__}, indent=1))
    print(f"\nops.linear_log_probs, H {args.hidden}, V {args.vocab:,}, {dtype}, {args.device}")
    print(verdict(next(r for r in rows if r["note"] == GRPO_CASE)))
    print(table(rows))
    return 0 if all(r["status"] in ("ok", "oom") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
