"""The ``check`` and ``bench`` commands of ``leantune``: their options, the checks of their values, their handlers.

``add_commands(subparsers)`` registers both on the ``leantune`` parser. Nothing heavy is imported here at module
level: torch, transformers and the benchmark modules load inside the handlers, so ``leantune --help`` stays fast.
Every value is checked before anything runs or is written; a bad one is a LeantuneError (one ``leantune: error:``
line).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ..errors import LeantuneError
from .harness import OP_NAMES

ALL_IMPLS = "hf+peft,hf+peft+liger,leantune"


# ------------------------------------------------------------------------------------------------------------ check
def _check(args) -> int:
    import torch

    from .. import ops
    from .check import run_check

    device = args.device if args.device is not None else "cuda" if torch.cuda.is_available() else "cpu"
    try:
        where = torch.device(device)
    except RuntimeError:
        where = None
    if where is None or where.type not in ("cpu", "cuda"):
        raise LeantuneError(f"--device must be cpu or cuda, got {device!r}")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise LeantuneError(f"--device {device}: no CUDA device is visible")
    if where.index is not None and where.index >= torch.cuda.device_count():
        raise LeantuneError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    try:
        ops.backend(where)  # LEANTUNE_BACKEND=triton on the CPU needs the interpreter
    except (RuntimeError, ValueError) as exc:
        raise LeantuneError(str(exc)) from None
    return 0 if run_check(device) else 1


# ------------------------------------------------------------------------------------------------- option values
def _comma(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _impls(text: str) -> list[str]:
    from .build import known_impl
    from .step import IMPLS

    impls = _comma(text)
    bad = [i for i in impls if not known_impl(i)]
    if bad or not impls:
        raise LeantuneError(f"unknown implementation(s) {', '.join(bad) or '(none)'}; expected some of "
                            f"{', '.join(IMPLS)} (a tiled one may name its tile: leantune+offload+tiled2048)")
    return impls


def _gc_list(text: str) -> list[bool]:
    values = _comma(text)
    if not values or any(v not in ("on", "off") for v in values):
        raise LeantuneError(f"--gc takes on, off or on,off; got {text!r}")
    return [v == "on" for v in values]


def _check_bench_args(args) -> None:
    """Every bench value checked before anything runs or is written: --out a folder (or absent), --budget-s and the
    sizes positive, the model configs readable (ops, e2e and max-context would otherwise fail in a child process
    after the parent has written its files)."""
    out = Path(args.out).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())  # where --out would be created
    if not existing.is_dir():
        raise LeantuneError(f"--out {args.out}: {existing} exists and is not a directory")
    budget = getattr(args, "budget_s", None)
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise LeantuneError(f"--budget-s must be a positive number of seconds, got {budget}")
    for name, low in (("seq", 1), ("batch", 1), ("layers", 1), ("steps", 1), ("warmup", 0), ("repeat", 1),
                      ("profile_steps", 0)):
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise LeantuneError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    cap = getattr(args, "memory_cap_gib", None)
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        raise LeantuneError(f"--memory-cap-gib must be a positive number of GiB, got {cap}")
    tflops = getattr(args, "matmul_tflops", None)
    if tflops is not None and not (math.isfinite(tflops) and tflops > 0):
        raise LeantuneError(f"--matmul-tflops must be a positive number, got {tflops}")
    configs = _comma(args.configs) if getattr(args, "configs", None) else []
    configs += [args.config] if getattr(args, "config", None) else []
    if configs:
        from .harness import load_config

        for config in configs:
            load_config(config)


def _none_ok(statuses: list, out: str) -> int:
    """Exit status of a bench run: 0 when at least one run measured something, else the error (logs in --out)."""
    if "ok" in statuses:
        return 0
    raise LeantuneError(f"no run produced a measurement ({', '.join(map(str, statuses)) or 'none ran'}); the "
                        f"logs in {out} say why")


# ---------------------------------------------------------------------------------------------------------- bench
def _bench_ops(args) -> int:
    from .harness import require_cuda
    from .ops import CASES, run_isolated

    names = _comma(args.ops)
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        raise LeantuneError(f"unknown op(s) {', '.join(unknown) or '(none given)'}; expected some of "
                            f"{', '.join(CASES)}")
    _check_bench_args(args)
    require_cuda()
    if not run_isolated(names, args.impls, Path(args.out), args.budget_s):
        raise LeantuneError(f"no op produced a result (the ops_*.log files in {args.out} say why)")
    return 0


def _bench_e2e(args) -> int:
    from .e2e import run_e2e
    from .harness import require_cuda
    from .report import write_report

    impls, gcs = _impls(args.impls), _gc_list(args.gc)
    _check_bench_args(args)
    if args.nproc < 1 or (args.nproc > 1 and args.distributed == "none"):
        raise LeantuneError(f"--nproc must be >= 1, and above 1 needs --distributed ddp or fsdp (got --nproc "
                            f"{args.nproc} --distributed {args.distributed})")
    require_cuda()
    import torch

    if args.distributed != "none" and args.nproc > torch.cuda.device_count():
        raise LeantuneError(f"--nproc {args.nproc}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    results = run_e2e(_comma(args.configs), impls, gcs, Path(args.out), seq=args.seq, batch=args.batch,
                      warmup=args.warmup, steps=args.steps, seed=args.seed, layers=args.layers,
                      budget_s=args.budget_s, matmul_tflops=args.matmul_tflops, nproc=args.nproc,
                      distributed=args.distributed, memory_cap_gib=args.memory_cap_gib, repeat=args.repeat,
                      profile_steps=args.profile_steps, dora=args.dora)
    write_report(Path(args.out), compare_ratios=args.compare)
    return _none_ok([r.get("status") for r in results], args.out)


def _bench_max_context(args) -> int:
    from .harness import check_range, require_cuda
    from .max_context import run_max_context
    from .report import write_report

    impls = _impls(args.impls)
    check_range(args.lo, args.hi, args.step)
    _check_bench_args(args)
    require_cuda()
    results = run_max_context(args.config, impls, Path(args.out), lo=args.lo, hi=args.hi, step=args.step,
                              seed=args.seed, layers=args.layers, budget_s=args.budget_s,
                              memory_cap_gib=args.memory_cap_gib)
    write_report(Path(args.out), compare_ratios=args.compare)
    # a probe that ran out of memory is an answer; only crashes and timeouts everywhere mean nothing was measured
    return _none_ok(["ok" if d.get("status") in ("ok", "nonfinite", "oom") else d.get("status")
                     for r in results for d in r["probe_details"]], args.out)


def _bench_cpu(args) -> int:
    for name, low in (("batch", 1), ("seq", 1), ("steps", 1), ("warmup", 0), ("threads", 1)):
        if getattr(args, name) < low:
            raise LeantuneError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise LeantuneError(f"--model {args.model}: expected a Hugging Face model folder holding config.json")
    if args.json is not None and Path(args.json).is_dir():
        raise LeantuneError(f"--json {args.json} is a directory; expected a file path")
    from ..assets import smollm2_path
    from .cpu import format_result, run_cpu_bench

    model = args.model if args.model is not None else smollm2_path()
    result = run_cpu_bench(model, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
                           threads=args.threads, seed=args.seed)
    print(format_result(result))
    if args.json is not None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def _bench_report(args) -> int:
    from .report import write_report

    write_report(Path(args.out), compare_ratios=args.compare)
    return 0


# ------------------------------------------------------------------------------------------------------ the parsers
def _common(p: argparse.ArgumentParser, budget: bool = True, writes: str = "JSON per run, results.md, PNGs") -> None:
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help=f"output directory: {writes} (default: bench-results)")
    if budget:
        p.add_argument("--budget-s", type=float, default=540.0, metavar="S",
                       help="wall-clock budget of this invocation; no run starts that is not expected to end "
                            "within it (default: 540)")


def add_commands(sub) -> None:
    """Register ``check`` and ``bench ops|e2e|max-context|cpu|report`` on ``sub`` (the ``leantune`` parser's
    subparsers); each sets ``func`` to its handler, which returns the exit status."""
    check = sub.add_parser("check", help="run 13 ops (norm, RoPE, GLUs, losses, LoRA, DoRA, log-probs, "
                                         "distillation, MoE experts) once against float64 references and print the "
                                         "errors")
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    check.set_defaults(func=_check)

    bench = sub.add_parser("bench", help="benchmarks: ops, e2e, max-context (CUDA); cpu (CPU); report (anywhere)",
                           description="Benchmarks of leantune vs HF+PEFT (+Liger): ops, e2e and max-context on a "
                                       "CUDA GPU, cpu on the CPU. Every configuration runs in its own process; "
                                       "GPU results accumulate as JSON in --out.")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    ops = bsub.add_parser("ops", help="every op fwd+bwd, leantune vs eager / torch.compile / Liger / CCE",
                          description="Each op's fwd+bwd at Llama-3-8B shapes against its peers in the same run "
                                      "(CUDA only; the timing method is in benchmarks/RESULTS.md): time, "
                                      "CUDA-graph device time, floor, extra peak and saved bytes. Each op runs in "
                                      "its own process.")
    ops.add_argument("--ops", default="rms_norm,rope,swiglu",
                     help=f"comma list of ops, from: {', '.join(OP_NAMES)} (default: rms_norm,rope,swiglu)")
    ops.add_argument("--impls", default=None,
                     help="comma list of implementations to run, e.g. leantune,torch.compile,liger,eager,"
                          "'peft eager' (default: all of each op's)")
    _common(ops, writes="ops_NAME.json and .log per op, merged ops.json and ops.md")
    ops.set_defaults(func=_bench_ops)

    e2e = bsub.add_parser("e2e", help="LoRA training steps of random-init models: tokens/s, peak GiB, MFU/HFU")
    e2e.add_argument("--configs", required=True, metavar="DIRS",
                     help="comma list of model folders (or config.json files), random init (required)")
    e2e.add_argument("--impls", default=ALL_IMPLS, help=f"comma list (default: {ALL_IMPLS})")
    e2e.add_argument("--gc", default="on,off", metavar="on|off|on,off",
                     help="gradient checkpointing settings to run (default: on,off)")
    e2e.add_argument("--seq", type=int, default=None, help="sequence length (default: 4096 for 8B-class, 8192 below)")
    e2e.add_argument("--batch", type=int, default=None, help="batch size (default: 1 for 8B-class, 2 below)")
    e2e.add_argument("--warmup", type=int, default=2, help="untimed steps after the agreement step (default: 2)")
    e2e.add_argument("--steps", type=int, default=20,
                     help="timed steps per run: step ms median, min, p90 and host issue ms over them (default: 20)")
    e2e.add_argument("--repeat", type=int, default=1, metavar="K",
                     help="run each implementation's child K times in this call, interleaved; the report shows "
                          "each run and the worst and median of runs (default: 1)")
    e2e.add_argument("--profile-steps", type=int, default=3, metavar="N",
                     help="steps after the timed ones under torch.profiler: GPU-busy fraction and kernels per step "
                          "(0: no profiled pass) (default: 3)")
    e2e.add_argument("--seed", type=int, default=0, help="seed of weights, adapters and tokens (default: 0)")
    e2e.add_argument("--nproc", type=int, default=1, help="GPUs per run, one process each, launched by torchrun "
                     "(needs --distributed; seq x batch is per GPU) (default: 1)")
    e2e.add_argument("--distributed", default="none", choices=("none", "ddp", "fsdp"),
                     help="engine of a multi-process run (default: none, one plain process)")
    e2e.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (default: the config's)")
    e2e.add_argument("--matmul-tflops", type=float, default=None, metavar="TF",
                     help="bf16 matmul ceiling to use instead of measuring it (default: measured once per call)")
    e2e.add_argument("--memory-cap-gib", type=float, default=None, metavar="GIB",
                     help="cap each process's CUDA memory at this many GiB (a smaller card) (default: none)")
    e2e.add_argument("--compare", action="store_true", help="print ratios vs hf+peft (default: False)")
    e2e.add_argument("--dora", action="store_true",
                     help="PEFT's DoRA adapters (use_dora=True) instead of plain LoRA in every run (default: False)")
    _common(e2e)
    e2e.set_defaults(func=_bench_e2e)

    mc = bsub.add_parser("max-context", help="longest batch-1 sequence whose GC-on LoRA step fits (bisection)")
    mc.add_argument("--config", required=True, metavar="DIR", help="model folder or config.json (required)")
    mc.add_argument("--impls", default=ALL_IMPLS, help=f"comma list (default: {ALL_IMPLS})")
    mc.add_argument("--lo", type=int, default=4096, help="shortest length to consider (default: 4096)")
    mc.add_argument("--hi", type=int, default=262144, help="longest length to consider (default: 262144)")
    mc.add_argument("--step", type=int, default=4096, help="lengths are multiples of this (default: 4096)")
    mc.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    mc.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (default: the config's)")
    mc.add_argument("--memory-cap-gib", type=float, default=None, metavar="GIB",
                    help="cap each probe's CUDA memory at this many GiB (a smaller card) (default: none)")
    mc.add_argument("--compare", action="store_true", help="print ratios vs hf+peft (default: False)")
    _common(mc)
    mc.set_defaults(func=_bench_max_context)

    cpu = bsub.add_parser("cpu", help="a LoRA step on the CPU, HF+PEFT vs leantune-patched: time and peak RSS",
                          description="One fp32 LoRA training step (r16 on every linear layer, AdamW) of HF+PEFT and "
                                      "of the leantune-patched model, each side in its own process, timed in "
                                      "alternating steps; prints the medians, the ratios, each side's peak RSS and "
                                      "the agreement of loss and LoRA gradients. CPU only.")
    cpu.add_argument("--model", default=None, metavar="DIR",
                     help="Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)")
    cpu.add_argument("--batch", type=int, default=4, help="sequences per step (default: 4)")
    cpu.add_argument("--seq", type=int, default=256, help="tokens per sequence (default: 256)")
    cpu.add_argument("--steps", type=int, default=5, help="timed steps per side (default: 5)")
    cpu.add_argument("--warmup", type=int, default=1, help="untimed steps after the agreement step (default: 1)")
    cpu.add_argument("--threads", type=int, default=1, help="torch intra-op threads per side (default: 1)")
    cpu.add_argument("--seed", type=int, default=0, help="seed of adapters and tokens (default: 0)")
    cpu.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON here (default: none)")
    cpu.set_defaults(func=_bench_cpu)

    report = bsub.add_parser("report", help="rebuild results.md and the PNGs from the JSON in --out (any machine)")
    report.add_argument("--compare", action="store_true", help="print ratios vs hf+peft (default: False)")
    _common(report, budget=False)
    report.set_defaults(func=_bench_report)
