"""The ``leantune`` command: thin argument parsing over the library.

Subcommands: ``train`` (LoRA fine-tuning), ``demo`` (``train`` with the embedded defaults, a short CPU-sized run
into runs/demo), ``export`` (merge an adapter into a standalone HF folder or a GGUF file), ``chat`` (talk to a run
or a model), ``check`` (13 ops against float64 references), ``bench ops|e2e|max-context|report`` (GPU
benchmarks; ``report`` rebuilds tables anywhere).
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
                        help="TOML file with any of the options below (keys as the option names), or an earlier "
                             "run's run.json (its settings); flags override it (default: none)")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, field.default)
        shown = NONE_DEFAULTS[field.name] if default is None else default
        help_text = f"{field.metadata['help']} (default: {shown})"
        kind = field_type(field.name)[0]
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            metavar = {"gradient_checkpointing": "on|off", "patch": "on|off",
                       "distributed": "auto|ddp|fsdp", "divergence": "stop|warn",
                       "report_to": "NAMES"}.get(field.name, field.metadata.get("metavar", field.name.upper()))
            parser.add_argument(flag, type=kind, default=None, metavar=metavar, help=help_text)


def _config_file(path: str) -> dict:
    """``--config``: a TOML file, or the run.json of an earlier run (its settings, to start a new run with them)."""
    from .errors import LeantuneError
    from .train.config import load_toml
    from .train.run_folder import run_settings

    if not path.endswith(".json"):
        return load_toml(path)
    values = run_settings(Path(path))
    if values is None:
        raise LeantuneError(f"--config {path}: not the run.json of a leantune run (--config takes a TOML file or "
                            "a run's run.json)")
    return values


def _config_from_args(args, defaults: dict):
    from .train.config import FIELDS, TrainConfig, make_config

    file_values = _config_file(args.config) if args.config else {}
    flags = {name: getattr(args, name) for name in FIELDS}
    asked = {**file_values, **{k: v for k, v in flags.items() if v is not None}}
    if asked.get("resume") and "overwrite" not in asked:  # the demo's overwrite default yields to an asked --resume
        defaults = {k: v for k, v in defaults.items() if k != "overwrite"}
    base = TrainConfig(**{**dataclasses.asdict(TrainConfig()), **defaults})
    if asked.get("resume"):  # precedence: defaults < the resumed run's run.json < --config TOML < flags
        from .train.run_folder import resume_base

        base = resume_base(Path(asked.get("output", base.output)), base)
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

    format = args.format or ("gguf" if args.out.lower().endswith(".gguf") else "hf")
    path = export(args.adapter, args.out, overwrite=args.overwrite, format=format, dtype=args.dtype)
    print(f"leantune: wrote the merged model to {path}")
    return 0


def _chat(args) -> int:
    from .train.chat import ChatOptions, chat

    return chat(ChatOptions(adapter=args.adapter, model=args.model, prompt=args.prompt, system=args.system,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, device=args.device))


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
                                       "(with --resume: the run's own run.json) < --config TOML < flags.")
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
    # the output format (issue #28): a GGUF file for llama.cpp / Ollama beside the HF folder
    export.add_argument("--format", choices=("hf", "gguf"), default=None,
                        help="hf: a Hugging Face folder; gguf: one .gguf file (Llama architecture; --out ends in "
                             ".gguf) (default: gguf when --out ends in .gguf, else hf)")
    export.add_argument("--dtype", choices=("f16", "bf16", "q8_0", "f32"), default=None,
                        help="stored weights; q8_0 for gguf only (default: the base's 16-bit dtype, else f32 for "
                             "hf and f16 for gguf)")
    export.set_defaults(func=_export)

    # leantune chat (issue #28): try a run or a model
    chat = sub.add_parser("chat", help="chat with a trained run or a model (chat template, streamed)",
                          description="Generation with the tokenizer's chat template, streamed to stdout: one "
                                      "answer with --prompt, else an interactive loop on stdin (/reset, /exit).")
    chat.add_argument("--adapter", metavar="RUN", default=None,
                      help="a run directory of 'leantune train' or its adapter/ folder, merged as export does")
    chat.add_argument("--model", metavar="PATH", default=None, help="a Hugging Face folder or a .gguf file instead")
    chat.add_argument("--prompt", metavar="TEXT", default=None, help="answer this once and exit (default: "
                                                                        "interactive)")
    chat.add_argument("--system", metavar="TEXT", default=None, help="a system message (default: none)")
    chat.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                      help="longest answer in tokens (default: 256)")
    chat.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="0: greedy; above 0: sampling at that temperature (default: 0)")
    chat.add_argument("--device", default=None, metavar="cpu|cuda", help="(default: cuda when available)")
    chat.set_defaults(func=_chat)

    from .bench.cli import add_commands

    add_commands(sub)  # check and bench
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    from .errors import LeantuneError

    # peft imports bitsandbytes when it is installed (the test extra); on CPUs with AVX512-BF16 it warns at import
    # that an optional kernel download is unavailable, which says nothing about a leantune run
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

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
