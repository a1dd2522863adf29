"""The ``leantune`` command: thin argument parsing over the library.

Subcommands: ``train`` (LoRA fine-tuning), ``demo`` (``train`` with the embedded defaults, a short CPU-sized run
into runs/demo), ``export`` (merge an adapter into a standalone HF folder), ``check`` (every op against a float64
reference). User errors print one line, ``leantune: error: ...``, to stderr and exit 1 without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing

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
    from .bench.check import run_check

    return 0 if run_check(args.device) else 1


def _field_type(field: dataclasses.Field):
    hint = field.type if not isinstance(field.type, str) else eval(field.type, {}, {})
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _add_train_options(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """One flag per TrainConfig field; the flag's own default is None (= not given), the help shows the real one."""
    from .train.config import NONE_DEFAULTS, TrainConfig

    parser.add_argument("--config", metavar="TOML", default=None,
                        help="TOML file with any of the options below (keys as the option names); flags override it")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, field.default)
        shown = NONE_DEFAULTS[field.name] if default is None else default
        help_text = f"{field.metadata['help']} (default: {shown})"
        kind = _field_type(field)
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            metavar = "on|off" if field.name in ("gradient_checkpointing", "patch") else field.name.upper()
            parser.add_argument(flag, type=kind, default=None, metavar=metavar, help=help_text)


def _config_from_args(args, defaults: dict):
    from .train.config import FIELDS, TrainConfig, load_toml, make_config

    file_values = load_toml(args.config) if args.config else {}
    flags = {name: getattr(args, name) for name in FIELDS}
    base = TrainConfig(**{**dataclasses.asdict(TrainConfig()), **defaults})
    return make_config(file_values, flags, base=base)


def _train(args) -> int:
    from .train import train

    config = _config_from_args(args, args.defaults)
    result = train(config)
    return 130 if result.interrupted else 0


def _export(args) -> int:
    from .train import export

    path = export(args.adapter, args.out, overwrite=args.overwrite)
    print(f"leantune: wrote the merged model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leantune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="LoRA fine-tuning of a causal LM (defaults: the embedded model and data)",
                           description="LoRA fine-tuning of a Hugging Face causal LM. Precedence: defaults < "
                                       "--config TOML < flags.")
    _add_train_options(train, {})
    train.set_defaults(func=_train, defaults={})

    demo = sub.add_parser("demo", help="short training run of the embedded defaults into runs/demo (replaces the "
                                       "previous demo)",
                          description="`leantune train` with demo defaults sized for 2 CPU cores and 10 minutes; "
                                      "every train option can still be given.")
    _add_train_options(demo, DEMO_DEFAULTS)
    demo.set_defaults(func=_train, defaults=DEMO_DEFAULTS)

    export = sub.add_parser("export", help="merge a trained adapter into a standalone HF model folder")
    export.add_argument("--adapter", required=True, metavar="DIR",
                        help="a run directory of `leantune train` or its adapter/ folder (required)")
    export.add_argument("--out", required=True, metavar="DIR", help="output folder for the merged model (required)")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (default: False)")
    export.set_defaults(func=_export)

    check = sub.add_parser("check", help="run every op once against a float64 reference and print the errors")
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    check.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .train.config import LeantuneError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LeantuneError as exc:
        print(f"leantune: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("leantune: aborted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
