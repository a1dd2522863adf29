"""The ``leantune`` command: thin argument parsing over the library.

Subcommands: ``train`` (LoRA fine-tuning), ``demo`` (``train`` with the embedded defaults, a short CPU-sized run
into runs/demo), ``export`` (merge an adapter into a standalone HF folder), ``check`` (every op against a float64
reference), ``bench ops|e2e|max-context|report`` (GPU benchmarks; ``report`` rebuilds tables anywhere).
User errors print one line, ``leantune: error: ...``, to stderr without a traceback and exit 1 (2 for a
command-line syntax error). A training run stopped by Ctrl-C or SIGTERM saves a checkpoint and exits 128 + the
signal's number (130, 143), as a shell reports a process ended by that signal; a second signal aborts at once, with
the same rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

# Demo defaults: measured to finish within 10 minutes on 2 CPU cores including the one-time GGUF conversion,
# with the held-out loss falling (see README). Everything else is TrainConfig's default.
DEMO_DEFAULTS = {
    "output": "runs/demo",
    "seq_len": 256,
    "batch_size": 4,
    "grad_accum": 1,
    "max_steps": 40,
    "lr": 1e-3,
    "warmup_steps": 2,
    "eval_every": 20,
    "eval_size": 16,
    "save_every": 20,
    "max_examples": 600,
    "overwrite": True,
}


def _check(args) -> int:
    import torch

    from .bench.check import run_check
    from .errors import LeantuneError
    from .ops import _runtime

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
        _runtime.backend(where)  # LEANTUNE_BACKEND=triton on the CPU needs the interpreter
    except RuntimeError as exc:
        raise LeantuneError(str(exc)) from None
    return 0 if run_check(device) else 1


class _UsageError(Exception):
    """A command-line syntax error (unknown flag, ``--max-steps 2.7``, ...), reported like every other user error."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``leantune: error: ...`` line (exit 2) instead of usage + message, and
    options are never abbreviated (``--out`` of ``export`` must not silently mean ``--output`` of ``train``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise _UsageError(f"{message} (see {self.prog} --help)")


def _add_train_options(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """One flag per TrainConfig field; the flag's own default is None (= not given), the help shows the real one."""
    from .train.config import NONE_DEFAULTS, TrainConfig, field_type

    parser.add_argument("--config", metavar="TOML", default=None,
                        help="TOML file with any of the options below (keys as the option names); flags override it "
                             "(default: none)")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, field.default)
        shown = NONE_DEFAULTS[field.name] if default is None else default
        help_text = f"{field.metadata['help']} (default: {shown})"
        kind = field_type(field.name)[0]
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            metavar = "on|off" if field.name in ("gradient_checkpointing", "patch") else field.name.upper()
            parser.add_argument(flag, type=kind, default=None, metavar=metavar, help=help_text)


def _config_from_args(args, defaults: dict):
    from .train.config import FIELDS, TrainConfig, load_toml, make_config

    file_values = load_toml(args.config) if args.config else {}
    flags = {name: getattr(args, name) for name in FIELDS}
    asked = {**file_values, **{k: v for k, v in flags.items() if v is not None}}
    if asked.get("resume") and "overwrite" not in asked:  # the demo's overwrite default yields to an asked --resume
        defaults = {k: v for k, v in defaults.items() if k != "overwrite"}
    base = TrainConfig(**{**dataclasses.asdict(TrainConfig()), **defaults})
    return make_config(file_values, flags, base=base)


def _train(args) -> int:
    from .train import train

    config = _config_from_args(args, args.defaults)
    result = train(config)
    if not result.interrupted:
        return 0
    return 128 + (result.stop_signal or signal.SIGINT)  # 130 after Ctrl-C, 143 after SIGTERM, as a shell reports


def _export(args) -> int:
    from .train import export

    path = export(args.adapter, args.out, overwrite=args.overwrite)
    print(f"leantune: wrote the merged model to {path}")
    return 0


def _check_bench_args(args) -> None:
    """Every bench value checked before anything runs or is written: --out a folder (or absent), --budget-s and the
    sizes positive, the model configs readable (ops, e2e and max-context would otherwise fail in a child process
    after the parent has written its files)."""
    import math

    from .errors import LeantuneError
    from .train.loop import nearest_existing

    existing = nearest_existing(Path(args.out))
    if not existing.is_dir():
        raise LeantuneError(f"--out {args.out}: {existing} exists and is not a directory")
    budget = getattr(args, "budget_s", None)
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise LeantuneError(f"--budget-s must be a positive number of seconds, got {budget}")
    for name, low in (("seq", 1), ("batch", 1), ("layers", 1), ("steps", 1), ("warmup", 0)):
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise LeantuneError(f"--{name} must be >= {low}, got {value}")
    tflops = getattr(args, "matmul_tflops", None)
    if tflops is not None and not (math.isfinite(tflops) and tflops > 0):
        raise LeantuneError(f"--matmul-tflops must be a positive number, got {tflops}")
    configs = _comma(args.configs) if getattr(args, "configs", None) else []
    configs += [args.config] if getattr(args, "config", None) else []
    if configs:
        from .bench.e2e import load_config

        for config in configs:
            load_config(config)


def _bench_ops(args) -> int:
    from .bench.e2e import require_cuda
    from .bench.ops import CASES, run_isolated

    names = _comma(args.ops)
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        from .errors import LeantuneError

        raise LeantuneError(f"unknown op(s) {', '.join(unknown) or '(none given)'}; expected some of "
                            f"{', '.join(CASES)}")
    _check_bench_args(args)
    require_cuda()
    if not run_isolated(names, args.impls, Path(args.out), args.budget_s):
        from .errors import LeantuneError

        raise LeantuneError(f"no op produced a result (the ops_*.log files in {args.out} say why)")
    return 0


def _bench_e2e(args) -> int:
    from .bench.e2e import require_cuda, run_e2e
    from .bench.report import write_report

    impls, gcs = _impls(args.impls), _gc_list(args.gc)
    _check_bench_args(args)
    require_cuda()
    results = run_e2e(_comma(args.configs), impls, gcs, Path(args.out), seq=args.seq, batch=args.batch,
                      warmup=args.warmup, steps=args.steps, seed=args.seed, layers=args.layers,
                      budget_s=args.budget_s, matmul_tflops=args.matmul_tflops)
    write_report(Path(args.out), compare_ratios=args.compare)
    return _none_ok([r.get("status") for r in results], args.out)


def _bench_max_context(args) -> int:
    from .bench.e2e import check_range, require_cuda, run_max_context
    from .bench.report import write_report

    impls = _impls(args.impls)
    check_range(args.lo, args.hi, args.step)
    _check_bench_args(args)
    require_cuda()
    results = run_max_context(args.config, impls, Path(args.out), lo=args.lo, hi=args.hi, step=args.step,
                              seed=args.seed, layers=args.layers, budget_s=args.budget_s)
    write_report(Path(args.out), compare_ratios=args.compare)
    # a probe that ran out of memory is an answer; only crashes and timeouts everywhere mean nothing was measured
    return _none_ok(["ok" if d.get("status") in ("ok", "nonfinite", "oom") else d.get("status")
                     for r in results for d in r["probe_details"]], args.out)


def _none_ok(statuses: list, out: str) -> int:
    """Exit status of a bench run: 0 when at least one run measured something, else the error (logs in --out)."""
    if "ok" in statuses:
        return 0
    from .errors import LeantuneError

    raise LeantuneError(f"no run produced a measurement ({', '.join(map(str, statuses)) or 'none ran'}); the "
                        f"logs in {out} say why")


def _bench_report(args) -> int:
    from .bench.report import write_report

    write_report(Path(args.out), compare_ratios=args.compare)
    return 0


def _comma(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _impls(text: str) -> list[str]:
    from .bench.e2e import IMPLS
    from .errors import LeantuneError

    impls = _comma(text)
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        raise LeantuneError(f"unknown implementation(s) {', '.join(bad) or '(none)'}; expected some of "
                            f"{', '.join(IMPLS)}")
    return impls


def _gc_list(text: str) -> list[bool]:
    from .errors import LeantuneError

    values = _comma(text)
    if not values or any(v not in ("on", "off") for v in values):
        raise LeantuneError(f"--gc takes on, off or on,off; got {text!r}")
    return [v == "on" for v in values]


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="GPU benchmarks: ops, e2e, max-context (CUDA only); report (anywhere)",
                           description="Benchmarks of leantune vs HF+PEFT (+Liger) on a CUDA GPU. Every "
                                       "configuration runs in its own process; results accumulate as JSON in --out.")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    all_impls = "hf+peft,hf+peft+liger,leantune"

    def common(p, budget=True, writes="JSON per run, results.md, PNGs"):
        p.add_argument("--out", default="bench-results", metavar="DIR",
                       help=f"output directory: {writes} (default: bench-results)")
        if budget:
            p.add_argument("--budget-s", type=float, default=540.0, metavar="S",
                           help="wall-clock budget of this invocation; no run starts that is not expected to end "
                                "within it (default: 540)")

    from .bench.ops import CASES

    ops = bsub.add_parser("ops", help="every op fwd+bwd, leantune vs eager / torch.compile / Liger / CCE",
                          description="Each op's fwd+bwd at Llama-3-8B shapes against its peers in the same run "
                                      "(CUDA only; the timing method is in benchmarks/RESULTS.md): time, "
                                      "CUDA-graph device time, floor, extra peak and saved bytes. Each op runs in "
                                      "its own process.")
    ops.add_argument("--ops", default="rms_norm,rope,swiglu",
                     help=f"comma list of ops, from: {', '.join(CASES)} (default: rms_norm,rope,swiglu)")
    ops.add_argument("--impls", default=None,
                     help="comma list of implementations to run, e.g. leantune,torch.compile,liger,eager,"
                          "'peft eager' (default: all of each op's)")
    common(ops, writes="ops_NAME.json and .log per op, merged ops.json and ops.md")
    ops.set_defaults(func=_bench_ops)

    e2e = bsub.add_parser("e2e", help="LoRA training steps of random-init models: tokens/s, peak GiB, MFU/HFU")
    e2e.add_argument("--configs", required=True, metavar="DIRS",
                     help="comma list of model folders (or config.json files), random init (required)")
    e2e.add_argument("--impls", default=all_impls, help=f"comma list (default: {all_impls})")
    e2e.add_argument("--gc", default="on,off", metavar="on|off|on,off",
                     help="gradient checkpointing settings to run (default: on,off)")
    e2e.add_argument("--seq", type=int, default=None, help="sequence length (default: 4096 for 8B-class, 8192 below)")
    e2e.add_argument("--batch", type=int, default=None, help="batch size (default: 1 for 8B-class, 2 below)")
    e2e.add_argument("--warmup", type=int, default=2, help="untimed steps after the agreement step (default: 2)")
    e2e.add_argument("--steps", type=int, default=5, help="timed steps (default: 5)")
    e2e.add_argument("--seed", type=int, default=0, help="seed of weights, adapters and tokens (default: 0)")
    e2e.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (default: the config's)")
    e2e.add_argument("--matmul-tflops", type=float, default=None, metavar="TF",
                     help="bf16 matmul ceiling to use instead of measuring it (default: measured once per call)")
    e2e.add_argument("--compare", action="store_true", help="print ratios vs hf+peft (default: False)")
    common(e2e)
    e2e.set_defaults(func=_bench_e2e)

    mc = bsub.add_parser("max-context", help="longest batch-1 sequence whose GC-on LoRA step fits (bisection)")
    mc.add_argument("--config", required=True, metavar="DIR", help="model folder or config.json (required)")
    mc.add_argument("--impls", default=all_impls, help=f"comma list (default: {all_impls})")
    mc.add_argument("--lo", type=int, default=4096, help="shortest length to consider (default: 4096)")
    mc.add_argument("--hi", type=int, default=262144, help="longest length to consider (default: 262144)")
    mc.add_argument("--step", type=int, default=4096, help="lengths are multiples of this (default: 4096)")
    mc.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    mc.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (default: the config's)")
    mc.add_argument("--compare", action="store_true", help="print ratios vs hf+peft (default: False)")
    common(mc)
    mc.set_defaults(func=_bench_max_context)

    report = bsub.add_parser("report", help="rebuild results.md and the PNGs from the JSON in --out (any machine)")
    report.add_argument("--compare", action="store_true", help="print ratios vs hf+peft (default: False)")
    common(report, budget=False)
    report.set_defaults(func=_bench_report)


def _version() -> str:
    """The installed distribution's version (no import of the package's heavy modules), else the source's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("leantune")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        from . import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="leantune", description=__doc__.replace("``", ""),  # no RST markup in --help
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"leantune {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="LoRA fine-tuning of a causal LM (defaults: the embedded model and data)",
                           description="LoRA fine-tuning of a Hugging Face causal LM. Precedence: defaults < "
                                       "--config TOML < flags.")
    _add_train_options(train, {})
    train.set_defaults(func=_train, defaults={})

    demo = sub.add_parser("demo", help="short training run of the embedded defaults into runs/demo (replaces the "
                                       "previous demo)",
                          description="'leantune train' with demo defaults sized for 2 CPU cores and 10 minutes; "
                                      "every train option can still be given.")
    _add_train_options(demo, DEMO_DEFAULTS)
    demo.set_defaults(func=_train, defaults=DEMO_DEFAULTS)

    export = sub.add_parser("export", help="merge a trained adapter into a standalone HF model folder")
    export.add_argument("--adapter", required=True, metavar="DIR",
                        help="a run directory of 'leantune train' or its adapter/ folder (required)")
    export.add_argument("--out", required=True, metavar="DIR", help="output folder for the merged model (required)")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (default: False)")
    export.set_defaults(func=_export)

    check = sub.add_parser("check", help="run every op once against a float64 reference and print the errors")
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    check.set_defaults(func=_check)

    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .errors import LeantuneError

    try:
        args = build_parser().parse_args(argv)  # imports torch (the bench options): a second in which Ctrl-C may come
    except _UsageError as exc:
        print(f"leantune: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("leantune: aborted", file=sys.stderr)
        return 128 + signal.SIGINT
    from .ops import backend_choice

    try:
        backend_choice()  # before any command runs (the ops would raise it mid-run)
    except ValueError as exc:
        print(f"leantune: error: {exc}", file=sys.stderr)
        return 1
    try:
        return args.func(args)
    except LeantuneError as exc:
        print(f"leantune: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # a plain Ctrl-C outside a run, or a run's second signal (Aborted)
        print("leantune: aborted", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
