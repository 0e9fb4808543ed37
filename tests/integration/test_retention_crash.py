"""SIGKILL between save and prune, and in the middle of a prune; then resume: nothing the policy keeps is lost."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from lightning_resume.io.verify import problem as verify_problem
from lightning_resume.retention.checkpoint import RetentionCheckpoint
from lightning_resume.retention.naming import rolling_name
from lightning_resume.retention.policy import RetentionPolicy
from tests.helpers.filesystem import listing
from tests.helpers.models import tiny_fit
from tests.helpers.paths import REPO_ROOT

REPO = str(REPO_ROOT)

# The kill hook lives only in this test's script: a subclass that SIGKILLs itself at a chosen point.
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    import lightning
    from lightning_resume.retention.checkpoint import RetentionCheckpoint
    from lightning_resume.retention.policy import RetentionPolicy
    from tests.helpers.models import TinyData, TinyModel, tiny_trainer

    dirpath, max_steps, keep_last, kill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    what, _, at = kill.partition(":")

    class Killed(RetentionCheckpoint):
        removed = 0

        def _save_checkpoint(self, trainer, filepath):
            super()._save_checkpoint(trainer, filepath)
            if what == "after-save" and trainer.global_step == int(at):
                os.kill(os.getpid(), signal.SIGKILL)  # saved and durable, nothing pruned yet

        def _remove_checkpoint(self, trainer, filepath):
            super()._remove_checkpoint(trainer, filepath)
            Killed.removed += 1
            if what == "after-removals" and Killed.removed == int(at):
                os.kill(os.getpid(), signal.SIGKILL)  # in the middle of a prune

    lightning.seed_everything(0, verbose=False)
    rules = RetentionPolicy(keep_last=keep_last, keep_best=1, anchor_every_n_steps=4)
    callback = Killed(dirpath=dirpath, monitor="val/loss", every_n_train_steps=1, retention=rules)
    trainer = tiny_trainer([callback], max_steps=max_steps, max_epochs=None, val_check_interval=1)
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path="last")
    print("RESUMED FROM", trainer.ckpt_path)
    """
)


def run_script(tmp_path, dirpath, max_steps, keep_last, kill):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(script), str(dirpath), str(max_steps), str(keep_last), kill],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def reference(dirpath, max_steps, keep_last):
    """What an uninterrupted run with the same policy leaves on disk."""
    callback = RetentionCheckpoint(
        dirpath=dirpath,
        monitor="val/loss",
        every_n_train_steps=1,
        retention=RetentionPolicy(keep_last=keep_last, keep_best=1, anchor_every_n_steps=4),
    )
    tiny_fit(callback, max_epochs=None, max_steps=max_steps, val_check_interval=1)
    return set(listing(dirpath))


def test_sigkill_between_save_and_prune_and_during_prune_then_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    # 1. killed right after the durable save of step 6, before its prune: only extra files remain
    first = run_script(tmp_path, ckpt, 12, 4, "after-save:6")
    assert first.returncode == -9, first.stderr[-2000:]
    assert reference(tmp_path / "ref6", 6, 4) <= set(listing(ckpt))
    # 2. resumed with a tighter policy (so its start-up prune has several deletions); killed after the first
    second = run_script(tmp_path, ckpt, 12, 2, "after-removals:1")
    assert second.returncode == -9, second.stderr[-2000:]
    assert reference(tmp_path / "ref6b", 6, 2) <= set(listing(ckpt))
    # 3. resumed to the end, no kill
    third = run_script(tmp_path, ckpt, 12, 2, "none:0")
    assert third.returncode == 0, third.stderr[-2000:]
    resume_source = os.path.basename(third.stdout.split("RESUMED FROM")[1].strip())
    assert resume_source == rolling_name(6)
    expected = reference(tmp_path / "ref12", 12, 2)
    final = set(listing(ckpt))
    assert expected <= final <= expected | {resume_source}
    assert all(verify_problem(str(ckpt / name)) is None for name in final)
