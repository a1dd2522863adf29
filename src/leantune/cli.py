"""The ``leantune`` command: thin argument parsing over the library."""

from __future__ import annotations

import argparse
import sys


def _check(args) -> int:
    from .bench.check import run_check

    return 0 if run_check(args.device) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leantune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run every op once against a float64 reference and print the errors")
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    check.set_defaults(func=_check)
    demo = sub.add_parser("demo", help="the embedded default job (for now: the op check)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
