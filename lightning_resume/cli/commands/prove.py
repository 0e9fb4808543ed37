"""``lightning-resume prove [options] -- COMMAND...``: prove that your training script resumes bit for bit.

Runs COMMAND uninterrupted (A), then again (B), SIGKILLing every process it started at random steps once a
checkpoint exists and relaunching it each time the way the script resumes (its own ``ckpt_path="last"``;
``--lightning-cli`` appends ``--ckpt_path last`` to the relaunches), and compares A and B step by step on
every rank from the traces ``ExactResume`` records (docs/prove.md). Exit 0: EXACT; 1: DIFFERS (with the first
difference, its likely cause and the fix); 2: the runs could not be made (a crash, a timeout, no
``ExactResume`` or no checkpoint in the script), with the failing launch's output.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_resume.prove import compare
from lightning_resume.prove.runner import ProveOptions, RunFailed, prove

OK, DIFFERS, COULD_NOT_RUN = 0, 1, 2


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lightning-resume-prove-"))
    opts = ProveOptions(
        command=command,
        workdir=workdir,
        kills=args.kills,
        seed=args.seed,
        timeout_s=args.timeout,
        digest_every=args.digest_every,
        append_on_relaunch=["--ckpt_path", "last"] if args.lightning_cli else [],
        keep=args.keep,
    )
    try:
        verdict = prove(opts)
    except RunFailed as err:
        if args.json:
            print(json.dumps({"verdict": "COULD_NOT_RUN", "error": str(err), "workdir": str(workdir)}))
        else:
            print(f"COULD NOT RUN: {err}\n(logs in {workdir})", file=sys.stderr)
        return COULD_NOT_RUN
    if args.json:
        print(json.dumps({**compare.to_json(verdict), "workdir": str(workdir)}))
    else:
        print(compare.render(verdict))
        print(f"logs and traces: {workdir}")
    return OK if verdict.exact else DIFFERS


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "prove",
        help="prove a training script resumes bit for bit: run, kill, relaunch, compare",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--kills", type=int, default=2, help="how many times the second run is killed (default 2)")
    p.add_argument("--seed", type=int, help="seed of the kill steps (default: new ones each time)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each launch may take (default 600)")
    p.add_argument("--digest-every", type=int, default=10, help="weights/optimizer digests every K steps")
    p.add_argument("--workdir", help="where the runs, their logs and traces go (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints after an exact verdict")
    p.add_argument("--lightning-cli", action="store_true", help="relaunch with --ckpt_path last appended")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    p.set_defaults(func=run)
