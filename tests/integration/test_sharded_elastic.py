"""Elastic resume of a sharded run: Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` on gloo, through
``ShardedModelParallelStrategy``) SIGKILLed mid-epoch on 2 ranks and resumed on 3 with ``ExactResume(elastic=True)``
in fresh processes. The DCP checkpoint reshards on load; the interrupted epoch's untrained samples are dealt to
the 3 ranks, so over the epoch every sample id is trained once (a stated few twice), and the next epoch is the
sampler's own order for 3 ranks.

The run is what users write: a plain ``DataLoader(shuffle=True, num_workers=2)`` or torchdata's
``StatefulDataLoader`` with Lightning's own distributed sampler (which Lightning puts inside the latter's own
batch sampler, so ``loader.batch_size`` is ``None``), dropout, 96 samples in batches of 4, a ``ModelCheckpoint``
every 4 steps."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lightning_resume import load_full, verify_sharded
from lightning_resume.exact.state import elastic as policy
from tests.helpers import sharded_runs
from tests.helpers.kill_resume import steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N, BATCH, SEED = 96, 4, 7
"""Samples, per-rank batch, and the sampler's seed (the job's ``seed_everything(7)``: Lightning's sampler's)."""
FLAGS = ("--elastic", "--shuffle", "--samples", str(N), "--num-workers", "2", "--max-epochs", "3", "--every", "4")
SAVED_STEP = 16
"""The checkpoint resumed from: on 2 ranks an epoch is 12 steps, so step 16 is 4 batches into epoch 1."""
CKPT = f"epoch=1-step={SAVED_STEP}.ckpt"


def _ids(out: Path, ranks: int, epoch: int, before_step: Optional[int] = None) -> list[list[int]]:
    """Each rank's sample ids trained in ``epoch`` (only at global steps below ``before_step`` when given)."""

    def keep(record: dict[str, Any]) -> bool:
        return record["epoch"] == epoch and (before_step is None or record["step"] < before_step)

    return [[i for s in steps(out, r) if keep(s) for i in s["ids"]] for r in range(ranks)]


def _report(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"report-rank{rank}.json").read_text())


EXTENDED = frozenset({"test_a_sharded_run_killed_on_two_ranks_resumes_on_three_with_every_sample_once"})
"""Both cases in make test-all (five fresh processes each); make test covers the deal with DDP."""


@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_a_sharded_run_killed_on_two_ranks_resumes_on_three_with_every_sample_once(tmp_path: Path, loader: str) -> None:
    killed, resumed = tmp_path / "B", tmp_path / "C"
    flags = (*FLAGS, *(["--plain-loader"] if loader == "plain" else []))
    sharded_runs.fit_until_paused(killed, *flags, "--pause-before", str(SAVED_STEP + 2))
    ckpt = killed / "ckpt" / CKPT
    assert verify_sharded(str(ckpt)).world_size == 2  # a committed DCP directory written by 2 ranks
    sharded_runs.fit(resumed, str(ckpt), *flags, "--devices", "3", "--dump-start", timeout=240)
    errors = sorted(resumed.glob("error-*.txt"))  # the job catches what fit raised, to dump its weights anyway
    assert not errors, "\n".join(path.read_text() for path in errors)

    # The killed run followed Lightning's sampler for 2 ranks; 4 of its batches of epoch 1 are in the checkpoint.
    spec = policy.OrderSpec(N, shuffle=True, seed=SEED, drop_last=False)
    before = _ids(killed, 2, 1, SAVED_STEP)
    assert before == [spec.indices(2, r, 1)[: 4 * BATCH] for r in range(2)]
    assert max(s["step"] for r in range(2) for s in steps(killed, r)) > SAVED_STEP  # it trained past the save

    # Over the interrupted epoch every sample once; the padding to a multiple of 3 ranks trained twice.
    after = _ids(resumed, 3, 1)
    untrained = N - 2 * 4 * BATCH
    repeated = -untrained % 3
    assert repeated > 0  # the case exercises the padding rule
    assert len({len(ids) for ids in after}) == 1  # every rank as many samples
    counts = Counter(i for ids in before + after for i in ids)
    assert set(counts) == set(range(N)), f"never trained: {sorted(set(range(N)) - set(counts))}"
    twice = sorted(i for i, c in counts.items() if c > 1)
    assert len(twice) == repeated and all(counts[i] == 2 for i in twice), f"trained twice: {twice}"

    for rank in range(3):  # every rank says the same
        report = _report(resumed, rank)
        assert report["exact"] is False and report["sample_exact"] is True
        assert report["world_size"] == {"checkpoint": 2, "now": 3}
        assert report["global_batch"] == {"before": 2 * BATCH, "after": 3 * BATCH}
        assert (report["untrained"], report["repeated"], report["dropped"]) == (untrained, repeated, 0)
        assert report["step"] == SAVED_STEP
        assert any("resumed a checkpoint of 2 ranks on 3" in line for line in report["differences"])

    # The next epoch: the sampler's ordinary order for 3 ranks, every sample once across them.
    assert _ids(resumed, 3, 2) == [spec.indices(3, r, 2) for r in range(3)]
    assert sorted(i for ids in _ids(resumed, 3, 2) for i in ids) == list(range(N))

    # The resumed run counts steps on from the checkpoint's, on every rank alike.
    for rank in range(3):
        assert min(s["step"] for s in steps(resumed, rank)) == SAVED_STEP
    # The 2-rank shards were resharded onto 3: training started from the checkpoint's weights.
    start = torch.load(resumed / "start.pt", weights_only=True)
    saved = load_full(str(ckpt))["state_dict"]
    assert set(start) == set(saved) and all(torch.equal(start[k], saved[k]) for k in start)
