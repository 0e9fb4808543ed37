"""Two-process DDP (gloo, CPU): only rank 0 deletes, both ranks hold the same records, nothing hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from lightning_resume.retention.naming import rolling_name
from tests.helpers.filesystem import listing
from tests.helpers.paths import REPO_ROOT

REPO = str(REPO_ROOT)

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    import lightning
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from lightning_resume.retention.checkpoint import RetentionCheckpoint
    from lightning_resume.retention.policy import RetentionPolicy
    from tests.helpers.models import TinyData, TinyModel, tiny_trainer

    out = sys.argv[1]

    class LoggingIO(TorchCheckpointIO):
        def remove_checkpoint(self, path):
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            with open(os.path.join(out, f"removed-rank{rank}.txt"), "a") as log:
                log.write(os.path.basename(path) + "\\n")
            super().remove_checkpoint(path)

    lightning.seed_everything(0, verbose=False)
    # val/loss is logged without sync_dist, so each rank sees its own value: the callback must agree anyway
    rules = RetentionPolicy(keep_last=2, keep_best=1, anchor_every_n_steps=3)
    callback = RetentionCheckpoint(dirpath=os.path.join(out, "ckpt"), monitor="val/loss", every_n_train_steps=1,
                                   retention=rules)
    trainer = tiny_trainer([callback], max_steps=7, max_epochs=None, val_check_interval=1,
                           strategy="ddp", devices=2, plugins=[LoggingIO()])
    trainer.fit(TinyModel(), datamodule=TinyData())
    records = sorted((r.to_state() for r in callback._records.values()), key=lambda s: s["path"])
    with open(os.path.join(out, f"records-rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"records": records, "best": callback.best_model_path}, f)
    """
)


def test_ddp_only_rank_zero_deletes_and_ranks_agree(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rank0 = json.loads((tmp_path / "records-rank0.json").read_text())
    rank1 = json.loads((tmp_path / "records-rank1.json").read_text())
    assert rank0 == rank1
    removed = (tmp_path / "removed-rank0.txt").read_text().split()
    assert removed and not (tmp_path / "removed-rank1.txt").exists()
    kept = {os.path.basename(r["path"]) for r in rank0["records"]}
    assert set(listing(tmp_path / "ckpt")) == kept
    assert kept.isdisjoint(removed)
    assert {rolling_name(3), rolling_name(6), rolling_name(7)} <= kept  # anchors and the newest
