"""A pytest entry point for users' own suites: prove that a training command resumes bit for bit.

    from lightning_resume.testing import assert_resumes_exactly

    def test_training_resumes_exactly(tmp_path):
        assert_resumes_exactly(["python", "train.py", "--max_steps", "40"], kills=2, workdir=tmp_path)

The same three runs and comparison as ``lightning-resume prove`` (``lightning_resume.prove``); a run that
differs raises ``AssertionError`` with the first difference, its likely cause and the fix; a run that could
not be made raises it with the failing launch's output.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from lightning_resume.prove import compare
from lightning_resume.prove.runner import ProveOptions, RunFailed, prove


def assert_resumes_exactly(
    command: Sequence[str],
    kills: int = 2,
    seed: Optional[int] = None,
    workdir: Union[str, Path, None] = None,
    timeout: float = 600.0,
    lightning_cli: bool = False,
    digest_every: int = 10,
    keep: bool = False,
) -> Any:
    """Run ``command`` uninterrupted and killed ``kills`` times, and compare; return the verdict when exact."""
    opts = ProveOptions(
        command=list(command),
        workdir=Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="lightning-resume-prove-")),
        kills=kills,
        seed=seed,
        timeout_s=timeout,
        digest_every=digest_every,
        append_on_relaunch=["--ckpt_path", "last"] if lightning_cli else [],
        keep=keep,
    )
    try:
        verdict = prove(opts)
    except RunFailed as err:
        raise AssertionError(f"could not run the proof: {err}") from None
    if not verdict.exact:
        raise AssertionError(compare.render(verdict))
    return verdict
