"""The kill/resume harness: run ``jobs/trainee.py`` in fresh processes (A uninterrupted, B SIGKILLed from
outside, C resuming B's checkpoint) and compare runs bit for bit. Starting and killing processes is
``lightning_resume.prove.runner``'s (through ``tests/helpers/processes.py``), and every run records the trace
``lightning-resume prove`` compares (one trace per checkpoint directory, so B and the C that resumes its
checkpoints make one killed-and-relaunched run): ``assert_exact_resume`` checks the trainee's own records
and then ``prove``'s verdict on the traces, so every kill-and-resume test here is also a test of ``prove``.
What the trainee trains is its config's."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lightning_resume.prove import compare, runner
from tests.helpers import preloaded, processes
from tests.helpers.compare import assert_bitwise
from tests.helpers.paths import JOBS_DIR

TRAINEE = JOBS_DIR / "trainee.py"


def trace_dir(cfg: dict[str, Any]) -> Path:
    """Where the run of ``cfg`` records its trace: one directory per checkpoint directory, beside the runs."""
    return Path(cfg["out"]).parent / f"trace-{hashlib.sha1(str(cfg['ckpt_dir']).encode()).hexdigest()[:8]}"


def start(cfg: dict[str, Any], workdir: Path) -> preloaded.PreloadedProcess:
    """Start the trainee on ``cfg`` (written to ``<out>/config.json``), its output to ``<out>/stdout.txt``,
    recording its trace (weights digests at every step); forked with torch and Lightning imported
    (``processes.start_preloaded``)."""
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {**runner.trace_environment(trace_dir(cfg), digest_every=1), **(cfg.get("env") or {})}
    script = JOBS_DIR / cfg["job"] if cfg.get("job") else TRAINEE  # a job built on the trainee, with its own model
    return processes.start_preloaded(script, [cfg_path], env=env, cwd=workdir, log=out / "stdout.txt")


def output(cfg: dict[str, Any], tail: Optional[int] = 6000) -> str:
    """The run's output so far (its last ``tail`` characters; all of it with ``tail=None``)."""
    text = (Path(cfg["out"]) / "stdout.txt").read_text()
    return text if tail is None else text[-tail:]


def exit_code(cfg: dict[str, Any], workdir: Path, timeout: float = 240) -> int:
    """Run to its end, whether it succeeds or not: its exit code (what it printed: ``output(cfg)``)."""
    proc = start(cfg, workdir)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        processes.kill(proc)
        raise AssertionError(f"run timed out:\n{output(cfg)}") from None


def run(cfg: dict[str, Any], workdir: Path, timeout: float = 240) -> None:
    """Run to completion; raise with the run's output if it fails."""
    rc = exit_code(cfg, workdir, timeout)
    assert rc == 0, f"run failed with {rc}:\n{output(cfg)}"


def run_until_paused(cfg: dict[str, Any], workdir: Path, timeout: float = 240) -> None:
    """Start a run that blocks at ``cfg['pause_before']``, then SIGKILL it from outside."""
    marker = Path(cfg["out"]) / "paused"
    run_and_kill_when(cfg, workdir, marker.exists, timeout)


def run_and_kill_when(cfg: dict[str, Any], workdir: Path, ready: Callable[[], bool], timeout: float = 240) -> None:
    """Start a run and SIGKILL it as soon as ``ready()`` is true (polled, so the moment is not chosen by the run)."""
    processes.kill_when(start(cfg, workdir), ready, timeout, log=lambda: output(cfg))


def signal_after(cfg: dict[str, Any], workdir: Path, signum: int, after: int = 6, timeout: float = 300) -> int:
    """Start a run, send the trainee ``signum`` once it logged ``after`` micro-batches (or ``timeout`` s
    passed), and wait for it to stop: its exit code."""
    proc = start(cfg, workdir)
    deadline = time.monotonic() + timeout
    while len(steps(cfg["out"])) < after and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signum)
    return proc.wait(timeout=300)


def snapshot_step(ckpt_dir: str) -> int:
    """The step of the one ``last-snapshot-step=*.ckpt`` in ``ckpt_dir`` (a signal's snapshot)."""
    snaps = list(Path(ckpt_dir).glob("last-snapshot-step=*.ckpt"))
    assert len(snaps) == 1, snaps
    return int(torch.load(snaps[0], weights_only=True)["global_step"])


def uninterrupted(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run A: the whole fit in ``workdir/A``, checkpoints in ``A/ckpt``; its config."""
    a = dict(cfg, out=str(workdir / "A"), ckpt_dir=str(workdir / "A" / "ckpt"))
    run(a, workdir)
    return a


def killed(cfg: dict[str, Any], workdir: Path, pause: int) -> dict[str, Any]:
    """Run B in ``workdir/B``, SIGKILLed from outside before micro-batch ``pause``; its config."""
    b = dict(cfg, out=str(workdir / "B"), ckpt_dir=str(workdir / "B" / "ckpt"), pause_before=pause)
    run_until_paused(b, workdir)
    return b


def resumed(cfg: dict[str, Any], workdir: Path, ckpt_dir: str, resume: str = "last", **extra: Any) -> dict[str, Any]:
    """Run C in ``workdir/C``, a fresh process resuming ``fit(ckpt_path=resume)`` from ``ckpt_dir``; its config."""
    c = dict(cfg, out=str(workdir / "C"), ckpt_dir=ckpt_dir, resume=resume, **extra)
    run(c, workdir)
    return c


def three_runs(cfg: dict[str, Any], workdir: Path, pause: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A uninterrupted, B killed before micro-batch ``pause``, C resuming B's "last": A's and C's configs."""
    a = uninterrupted(cfg, workdir)
    b = killed(cfg, workdir, pause)
    return a, resumed(cfg, workdir, b["ckpt_dir"])


def steps(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = Path(out) / f"steps-rank{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def assert_same_final_state(a_out: Path, c_out: Path, ranks: int = 1) -> None:
    """Every rank's final state (``final.pt`` for rank 0, ``final-rank<R>.pt`` for the others) bitwise equal."""
    for rank in range(ranks):
        name = "final.pt" if rank == 0 else f"final-rank{rank}.pt"
        a = torch.load(Path(a_out) / name, weights_only=True)
        c = torch.load(Path(c_out) / name, weights_only=True)
        assert_bitwise(a, c, "final" if rank == 0 else f"final (rank {rank})")


def assert_exact_resume(
    a_out: Path, c_out: Path, resumed_after: Optional[int], ranks: int = 1, compare_saves: bool = False
) -> None:
    """C continues A bit for bit: C's micro-batches are A's after the first ``resumed_after`` ones
    (same samples, same loss bits, no batch repeated or skipped), and the final state is bitwise equal."""
    for rank in range(ranks):
        a, c = steps(a_out, rank), steps(c_out, rank)
        assert c, f"resumed run trained nothing (rank {rank})"
        n = len(a) - len(c)
        if resumed_after is not None:
            assert n == resumed_after, f"rank {rank}: resumed after {n} micro-batches, expected {resumed_after}"
        for i, (x, y) in enumerate(zip(a[n:], c)):
            assert x == y, f"rank {rank}: micro-batch {n + i} differs:\n uninterrupted {x}\n resumed       {y}"
    assert_same_final_state(a_out, c_out, ranks)
    assert_prove_says_exact(a_out, c_out, ("files",) if compare_saves else TRAINING_ONLY)


TRAINING_ONLY = ("saved", "files")
"""What ``assert_exact_resume`` leaves out of ``prove``'s comparison by default: the saves and the checkpoint
files, which legitimately differ where a run is preempted (its own snapshot is one save the uninterrupted run
did not make) or snapshots on the wall clock, and which other tests check (test_exact_same_files, retention).
``compare_saves=True`` compares every save too, with the weights and optimizer state it held."""


def prove_verdict(a_out: Path, c_out: Path, ignore: tuple = TRAINING_ONLY) -> Optional[compare.Verdict]:
    """``lightning-resume prove``'s verdict on the traces of A and of B-then-C (``None`` when either recorded none)."""
    a_cfg, c_cfg = (json.loads((Path(out) / "config.json").read_text()) for out in (a_out, c_out))
    a, killed_then_resumed = compare.read_trace(trace_dir(a_cfg)), compare.read_trace(trace_dir(c_cfg))
    return compare.compare(a, killed_then_resumed, ignore=ignore) if a and killed_then_resumed else None


def assert_prove_says_exact(a_out: Path, c_out: Path, ignore: tuple = TRAINING_ONLY) -> None:
    """``lightning-resume prove``'s verdict on the traces of A and of B-then-C (when both recorded one), on
    everything training computed: batches, RNG streams, losses, learning rates, weights and optimizer state
    at every step, validation metrics."""
    a_cfg, c_cfg = (json.loads((Path(out) / "config.json").read_text()) for out in (a_out, c_out))
    a, killed_then_resumed = compare.read_trace(trace_dir(a_cfg)), compare.read_trace(trace_dir(c_cfg))
    if a and killed_then_resumed:
        verdict = compare.compare(a, killed_then_resumed, ignore=ignore)
        assert verdict.exact, "prove's comparison of the traces:\n" + compare.render(verdict)


def assert_ranks_disjoint(out: Path, epoch: int = 0, ranks: int = 2) -> None:
    """Each rank trained its own shard: within ``epoch`` no sample was trained on two ranks."""
    seen = [{i for s in steps(out, r) if s["epoch"] == epoch for i in s.get("ids", ())} for r in range(ranks)]
    assert all(seen), f"a rank trained nothing in epoch {epoch}"
    for r in range(1, ranks):
        assert seen[0].isdisjoint(seen[r]), f"ranks 0 and {r} trained the same samples in epoch {epoch}"
