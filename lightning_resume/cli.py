"""The ``lightning-resume`` command.

Each subcommand lives in its own module under ``lightning_resume.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (a callable taking the parsed
namespace and returning the exit code). This module only assembles them; it holds no command logic.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Optional, Sequence

from lightning_resume import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-resume",
        description="Inspect, verify, prune and plan lightning-resume checkpoints.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
