"""``lightning-resume inspect`` shows what ExactResume saved, on a checkpoint written by a subprocess run
(tests/helpers/jobs/trainee.py with 2 data-loader workers)."""

from __future__ import annotations

from pathlib import Path


def test_inspect_shows_what_exact_resume_saved(tmp_path: Path, capsys) -> None:
    import json

    from lightning_resume.cli import main as cli
    from tests.helpers import kill_resume as h

    cfg = {
        "out": str(tmp_path / "A"),
        "ckpt_dir": str(tmp_path / "ckpt"),
        "n": 40,
        "batch_size": 4,
        "max_epochs": 1,
        "num_workers": 2,
        "augment": True,
        "safetensors": True,
        "ckpt": {"every_n_train_steps": 5, "save_top_k": -1, "filename": "{step}"},
    }
    h.run(cfg, tmp_path)
    assert cli.main(["inspect", str(tmp_path / "ckpt" / "step=5.ckpt"), "--json"]) == 0
    exact = json.loads(capsys.readouterr().out)["exact_resume"]
    (rank,) = exact["ranks"]
    assert exact["world_size"] == 1 and rank["rng_streams"][:3] == ["python", "numpy", "torch"]
    assert rank["loader_positions"] == ["5 batches yielded, 2 worker states"]
    assert (
        # the verified format: weights and optimizer are left to the file's own digests (checked at restore)
        set(rank["fingerprint"]) == {"hash", "rng", "data", "step"} and rank["fingerprint"]["step"] == "5"
    )
    assert cli.main(["inspect", str(tmp_path / "ckpt" / "step=5.ckpt")]) == 0
    assert "rank 0: RNG python, numpy, torch" in capsys.readouterr().out
