"""The ``lightning-resume`` command: assembles the subcommands and turns their errors into exit codes.

Each subcommand lives in its own module under ``lightning_resume.cli.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (a callable taking the parsed
namespace and returning the exit code). A command raises on failure; ``main`` prints ``error: ...``
to stderr and exits with the same code in every subcommand:

- 0: done, every check passed;
- 1: a check failed: a checkpoint is corrupt or unsafe, or does not fit (``CHECK_FAILED``);
- 2: usage, or input that could not be read (missing file, bad option, unknown format).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Optional, Sequence

from lightning_resume._compat import check_versions
from lightning_resume.cli import commands
from lightning_resume.errors import (
    CheckpointCorruptError,
    LightningResumeError,
    ResumeMismatchError,
    UnsafeCheckpointError,
)

OK, CHECK_FAILED, USAGE = 0, 1, 2
FAILED_CHECKS = (CheckpointCorruptError, UnsafeCheckpointError, ResumeMismatchError)
"""Errors that mean "the checkpoint is bad" (exit 1), as opposed to "the request is" (exit 2)."""


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
    """Run one subcommand; return its exit code (argparse exits with 2 on a usage error itself)."""
    args = build_parser().parse_args(argv)
    check_versions()
    try:
        return int(args.func(args) or OK)
    except FAILED_CHECKS as err:
        print(f"error: {err}", file=sys.stderr)
        return CHECK_FAILED
    except (LightningResumeError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
