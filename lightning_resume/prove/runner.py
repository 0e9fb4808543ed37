"""The three runs of ``lightning-resume prove``: start a user's command, kill it from outside, relaunch it.

Run A goes uninterrupted; run B is SIGKILLed, every process its launch started (DDP ranks, data workers), at steps
drawn from A's trace after A's first checkpoint, and relaunched each time as the user's script resumes
(its own ``ckpt_path="last"``; with ``append_on_relaunch`` such as ``--ckpt_path last`` for LightningCLI);
the last launch runs to its end. Each run has a directory of its own as working directory (so relative
checkpoint paths do not meet), its trace (``LIGHTNING_RESUME_TRACE``, read by ``ExactResume``) and its
logs: created here, never one that existed, and after an exact verdict only the checkpoints written in them
are removed. What the trainee writes is read bounded and never through a link (``prove.files``). Every
launch has a timeout. A kill reaches every process the launch started, wherever it went (a torchrun
worker in a session of its own, an orphan: ``prove.reaper``), and only those; what a launch left running
when it ended is named in a ``LeftoverProcessWarning`` and killed. This module starts and kills
processes; the comparison is ``prove.compare``'s, pure.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

from lightning_resume.errors import LeftoverProcessWarning
from lightning_resume.prove import compare, files, reaper
from lightning_resume.prove.trace import DEFAULT_DIGEST_EVERY, DIGEST_EVERY_ENV, TRACE_ENV

CHECKPOINT_SUFFIXES = (".ckpt", ".safetensors", ".distcp", ".pt")
"""Files removed from the run directories after an exact verdict (unless ``keep``)."""

TAIL = 4000
"""Characters of a failed launch's output shown in the error."""


class RunFailed(RuntimeError):
    """A launch could not run as the proof needs (crashed, timed out, wrote no trace, saved no checkpoint)."""

    def __init__(self, what: str, log: Optional[Path] = None) -> None:
        tail = ""
        if log is not None and os.path.lexists(log):  # read from its end, bounded, never through a link
            tail = "\n--- last output of " + str(log) + " ---\n" + files.read_tail(str(log), TAIL)
        super().__init__(what + tail)


@dataclass
class ProveOptions:
    """What to prove and how: the user's ``command`` (argv), ``kills`` relaunches, drawn with ``seed``."""

    command: Sequence[str]
    workdir: Path
    kills: int = 2
    seed: Optional[int] = None
    timeout_s: float = 600.0
    digest_every: int = 10
    append_on_relaunch: Sequence[str] = ()
    keep: bool = False
    env: dict = field(default_factory=dict)


def prove(opts: ProveOptions) -> compare.Verdict:
    """Run A, then B with its kills and relaunches; the verdict of comparing their traces."""
    if not opts.command:
        raise ValueError("prove needs a command to run, after --: e.g. -- python train.py")
    if opts.kills < 1:
        raise ValueError(f"kills={opts.kills} must be at least 1: a run never killed proves nothing")
    workdir = Path(opts.workdir).resolve()
    command = absolute_arguments(opts.command, Path.cwd())
    runs = make_run_directories(workdir)
    a_dir, b_dir = (Path(run.path) for run in runs)
    _launch(command, a_dir, a_dir / "launch-1.log", opts).wait_to_end()
    a = read_trace(a_dir, a_dir / "launch-1.log")
    kill_steps = choose_kill_steps(a, opts.kills, opts.seed)
    moments = kill_moments(a, kill_steps)
    launch = 1
    for step, moment in zip(kill_steps, moments, strict=True):
        args = command if launch == 1 else [*command, *opts.append_on_relaunch]
        running = _launch(args, b_dir, b_dir / f"launch-{launch}.log", opts)
        if not running.kill_at(step, moment):
            break  # it ended before that step: nothing more to kill
        launch += 1
    else:
        args = [*command, *opts.append_on_relaunch]
        _launch(args, b_dir, b_dir / f"launch-{launch}.log", opts).wait_to_end()
    verdict = compare.compare(a, read_trace(b_dir))
    if verdict.exact and not opts.keep:
        remove_checkpoints(runs)
    return verdict


def make_run_directories(workdir: Path) -> tuple[files.RunDirectory, files.RunDirectory]:
    """``workdir/A`` and ``workdir/B``, created here (``workdir`` too if missing): the runs work in them,
    and only what they hold is ever removed. ``RunFailed`` when either exists already."""
    workdir.mkdir(parents=True, exist_ok=True)
    made: list[files.RunDirectory] = []
    try:
        for name in ("A", "B"):
            made.append(files.make_run_directory(str(workdir / name)))
    except files.UnsafeRunFile as err:
        for run in made:
            os.rmdir(run.path)  # made just now, still empty
        raise RunFailed(str(err)) from None
    return made[0], made[1]


def read_trace(run: Path, log: Optional[Path] = None) -> dict[int, list[dict]]:
    """The trace of the run in ``run`` (``compare.read_trace``); ``RunFailed`` naming a trace file that is not
    one (a link, a FIFO, a line too long or malformed) instead of reading it."""
    try:
        return compare.read_trace(run / "trace")
    except (files.UnsafeRunFile, compare.TraceFormatError) as err:
        raise RunFailed(f"{run.name}: its trace cannot be read: {err}", log) from None


def absolute_arguments(command: Sequence[str], cwd: Path) -> list[str]:
    """``command`` with each argument that names an existing file or directory (relative to ``cwd``) made
    absolute, since every run works in a directory of its own (``python train.py`` keeps working)."""
    out = []
    for arg in command:
        path = cwd / arg
        named = not os.path.isabs(arg) and not arg.startswith("-") and path.exists()
        out.append(os.path.abspath(path) if named else arg)  # not resolve(): a venv's python is a link to keep
    return out


def kill_moments(a: dict[int, list[dict]], kill_steps: Sequence[int]) -> list[str]:
    """Where in the loop each kill lands: inside a training step (``"batch"``: a few ms after a micro-batch
    ended, while the next one runs) or, every other kill when the uninterrupted run validated at or after
    that step, inside a validation (``"val_start"``: as soon as one begins)."""
    validations = [r["step"] for r in a.get(0, []) if r.get("kind") == "val_start"]
    return [
        "val_start" if i % 2 and any(v >= step for v in validations) else "batch" for i, step in enumerate(kill_steps)
    ]


def choose_kill_steps(a: dict[int, list[dict]], kills: int, seed: Optional[int]) -> list[int]:
    """``kills`` increasing steps at which B is killed: drawn among the steps A trained after its first
    checkpoint (a kill before any checkpoint would only restart the run). ``RunFailed`` when A wrote no
    trace or saved no checkpoint."""
    records = a.get(0, [])
    if not records:
        raise RunFailed(
            "the uninterrupted run wrote no trace: its Trainer has no ExactResume callback (add ExactResume() to"
            " its callbacks), or it never started training"
        )
    saved = [r["step"] for r in records if r.get("kind") == "saved"]
    if not saved:
        raise RunFailed(
            "the uninterrupted run saved no checkpoint before its end, so a killed run has nothing to resume"
            " from: add a checkpoint callback (ModelCheckpoint(every_n_train_steps=...)) or train longer"
        )
    later = sorted({r["step"] for r in records if r.get("kind") == "batch" and r["step"] > saved[0]})
    if not later:
        raise RunFailed("the uninterrupted run trained no step after its first checkpoint: nothing to kill")
    rng = random.Random(seed)
    return sorted(rng.sample(later, min(kills, len(later))))


@dataclass
class _Running:
    proc: subprocess.Popen
    trace: Path
    log: Path
    timeout_s: float
    offsets: dict  # trace file -> where the next poll reads (at first its size: earlier launches' are not ours)
    token: str  # in the launch's environment: its processes are found wherever they went (``prove.reaper``)
    subreaper_before: bool = False  # put back once the launch is over

    def wait_to_end(self) -> None:
        try:
            code = self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RunFailed(f"{self.log.parent.name}: no end within {self.timeout_s:.0f} s", self.log) from None
        self._collect_leftovers()
        if code != 0:
            raise RunFailed(f"{self.log.parent.name}: {self.log.name} exited with {code}", self.log)

    def kill_at(self, step: int, moment: str = "batch") -> bool:
        """SIGKILL the launch (``kill``) once any rank recorded a ``moment`` record (``kill_moments``) of
        step ``step`` or later (a few ms later, drawn, so the kill lands mid-step or mid-validation);
        ``False`` when the launch ended before reaching it."""
        deadline = time.monotonic() + self.timeout_s
        while not self._reached(step, moment):
            if self.proc.poll() is not None:
                self._collect_leftovers()
                if self.proc.returncode != 0:
                    raise RunFailed(f"{self.log.name} exited with {self.proc.returncode}", self.log)
                return False
            if time.monotonic() > deadline:
                self.kill()
                raise RunFailed(f"{self.log.name}: step {step} not reached within {self.timeout_s:.0f} s", self.log)
            time.sleep(0.01)
        time.sleep(random.random() * 0.02)
        self.kill()
        return True

    def _reached(self, step: int, moment: str) -> bool:
        try:
            return _reached(self.trace, step, self.offsets, moment)
        except files.UnsafeRunFile as err:
            self.kill()
            raise RunFailed(f"{self.log.name}: its trace cannot be read: {err}", self.log) from None

    def kill(self) -> None:
        """SIGKILL the launch's group, then every process it started wherever it went (a worker in a session
        of its own, an orphan), and reap them."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        stuck = reaper.kill_launch(self.proc.pid, self.token)
        self.proc.wait(timeout=60)
        reaper.set_subreaper(self.subreaper_before)
        _warn_leftovers(self.log, stuck, "could not be killed")

    def _collect_leftovers(self) -> None:
        """Once the launch's root ended: kill and name what it left running (and reap what ended)."""
        left = reaper.leftovers(self.proc.pid, self.token)
        reaper.kill_launch(self.proc.pid, self.token)
        reaper.set_subreaper(self.subreaper_before)
        _warn_leftovers(self.log, left, "were still running after it ended; killed")


def _warn_leftovers(log: Path, left: Sequence[reaper.Leftover], what: str) -> None:
    if left:
        named = "; ".join(map(str, left))
        message = f"{log}: {len(left)} process(es) of this launch {what}: {named}"
        warnings.warn(message, LeftoverProcessWarning, stacklevel=2)


def start_process(
    command: Sequence[str], cwd: Union[str, Path], env: Mapping[str, str], log: Optional[Path] = None
) -> subprocess.Popen:
    """``command`` in a new session (so a kill of its group reaches every process it starts: DDP ranks, data
    workers), stdout and stderr together into ``log``, or a text pipe without one."""
    with open(log, "w") if log is not None else contextlib.nullcontext(subprocess.PIPE) as out:
        return subprocess.Popen(  # the child holds its own descriptor of the log
            list(command), cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``start_process`` gave ``proc``, and reap it (only groups started here are killed)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def trace_environment(trace: Path, digest_every: int = DEFAULT_DIGEST_EVERY) -> dict[str, str]:
    """The variables that make ``ExactResume`` record its trace into ``trace``."""
    return {TRACE_ENV: str(trace), DIGEST_EVERY_ENV: str(digest_every)}


def _launch(command: Sequence[str], cwd: Path, log: Path, opts: ProveOptions) -> _Running:
    trace = cwd / "trace"
    trace.mkdir(mode=0o700, exist_ok=True)  # in a run directory made here (``make_run_directories``)
    env = {**os.environ, **opts.env, **trace_environment(trace, opts.digest_every)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    offsets = {path.name: files.offset_of(str(path)) for path in trace.glob("trace-rank*.jsonl")}
    token = env[reaper.LAUNCH_ENV] = reaper.new_token()
    before = reaper.set_subreaper(True)  # an orphaned worker comes back to us, not to init
    return _Running(start_process(command, cwd, env, log), trace, log, opts.timeout_s, offsets, token, before)


def _reached(trace: Path, step: int, offsets: dict, kind: str = "batch") -> bool:
    """Some rank has recorded, in this launch, a ``kind`` record of step ``step`` or later. Reads only the
    whole lines appended since the last poll (``offsets`` moves past them), bounded (``files.Follower``)."""
    marker = f'"{kind}"'.encode()
    found = False
    for path in trace.glob("trace-rank*.jsonl"):
        follower = files.Follower(str(path), offsets.get(path.name, 0))
        for line in follower.poll():
            found = found or (marker in line and _is_at_least(line, kind, step))
        offsets[path.name] = follower.offset
    return found


def _is_at_least(line: bytes, kind: str, step: int) -> bool:
    try:
        record = json.loads(line)
        return record.get("kind") == kind and int(record.get("step", -1)) >= step
    except (ValueError, TypeError, AttributeError):
        return False  # a torn line, or not a record: the comparison names it


def remove_checkpoints(runs: Sequence[files.RunDirectory]) -> None:
    """Checkpoint files and sharded checkpoint directories the runs wrote in their own directories (made by
    ``make_run_directories``, so nothing in them existed before); traces, logs and anything outside stay."""
    for run in runs:
        files.remove_created(run, CHECKPOINT_SUFFIXES)
