"""``lightning-resume verify FILE|DIR``: check everything a checkpoint holds; exit 1 naming what is bad.

A file is checked whole (every checksum, the tree); a sharded checkpoint directory is checked whole
(its commit marker and the digest of every shard it lists). A directory of checkpoints has each one
checked, and the newest that verifies is named: what ``ckpt_path="last"`` would resume from. The
checks are ``lightning_resume.io.verify``'s, the same the plugin, retention and "last" resolution run.

A ``torch.save`` file is loaded as ``fit`` would load it: weights-only by default, so an intact file that
holds pickled objects (``save_hyperparameters()`` over an ``nn.Module``) is reported as such, naming them
and the fixes (exit 1: ``fit`` would not load it either); with ``--no-weights-only`` (a file you trust, as
``fit(..., weights_only=False)``) it is unpickled in full, running the code it names.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_resume.errors import UNPICKLING_FIXES, PickledCheckpointError
from lightning_resume.io.resolve import candidates, newest_verified, progress
from lightning_resume.io.verify import problem, verify
from lightning_resume.sharded.marker import is_sharded_checkpoint
from lightning_resume.storage import files as storage


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify", help="verify a checkpoint (file or sharded directory) or every checkpoint in a directory"
    )
    p.add_argument("target", help="a checkpoint file, a sharded checkpoint directory, or a directory of checkpoints")
    add_weights_only_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def add_weights_only_option(p: argparse.ArgumentParser) -> None:
    """``--weights-only`` (default) / ``--no-weights-only``: how a ``torch.save`` file is read, as
    ``trainer.fit(..., weights_only=...)`` reads it."""
    p.add_argument(
        "--weights-only",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read torch.save files weights-only (default: no code runs). --no-weights-only unpickles them in full,"
        " running the code they name, as trainer.fit(..., weights_only=False) does: only for files you trust",
    )


def targets(target: str) -> list[str]:
    """The checkpoints ``target`` names: itself (a file or a sharded directory), or the checkpoints of a
    directory of them (``io.resolve.candidates``, the rule "last" resolution and retention use)."""
    if not storage.exists(target) and not storage.is_dir(target):  # an object-store prefix is no object
        raise FileNotFoundError(f"{target}: no such file or directory")
    if not storage.is_dir(target) or is_sharded_checkpoint(target):
        return [target]
    return [e.path for e in candidates(target)]


def check(path: str, weights_only: bool) -> dict[str, Any]:
    """One checkpoint's result: ``ok``, else ``error``; a file that is intact but holds pickled objects a
    weights-only load refuses also has ``needs_weights_only_false``, naming them."""
    pickled: list[PickledCheckpointError] = []

    def checked(p: str) -> None:
        try:
            verify(p, weights_only=weights_only)
        except PickledCheckpointError as err:
            pickled.append(err)
            raise

    why = problem(path, check=checked)
    result: dict[str, Any] = {"path": path, "ok": why is None, "error": why}
    if pickled:
        result["needs_weights_only_false"] = list(pickled[0].globals)
    return result


def _line(result: dict[str, Any]) -> str:
    if result["ok"]:
        return f"OK    {result['path']}"
    if "needs_weights_only_false" in result:
        names = ", ".join(result["needs_weights_only_false"])
        return f"PICKLED {result['path']}: intact, but loads only with weights_only=False: it holds {names}"
    return f"FAIL  {result['error']}"


def run(args: argparse.Namespace) -> int:
    paths = targets(args.target)
    if not paths:
        raise FileNotFoundError(
            f"{args.target}: no checkpoints in this directory (*.ckpt, *.safetensors files or sharded directories)"
        )
    results = [check(p, args.weights_only) for p in paths]
    good = {r["path"] for r in results if r["ok"]}
    by_progress = lambda path: progress(path, args.weights_only)  # training progress, read as fit reads it
    newest = newest_verified(good, verify=lambda path: None, key=by_progress) if len(paths) > 1 else None
    ok = all(r["ok"] for r in results)
    if args.json:
        print(json.dumps({"results": results, "ok": ok, "newest_verified": newest}, indent=2))
    else:
        for r in results:
            print(_line(r))
        if any("needs_weights_only_false" in r for r in results):
            print(UNPICKLING_FIXES)
        if newest is not None:
            print(f"newest verified: {newest}")
    return 0 if ok else 1
