"""The comparison of ``lightning-resume prove`` on synthetic traces (docs/prove.md): the cut rule, the first
difference over ranks, each diagnosis, the torn line a SIGKILL leaves, and the verdict's two outputs.

A trace here is built by ``run``: a toy training of ``STEPS`` steps, one micro-batch each, saving every
``SAVE_EVERY`` steps, whose digests are functions of the step and rank, so an uninterrupted run and a
correctly resumed one give the same records (their ``time``/``pid`` differ, as real runs' do).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_resume.prove.compare import (
    NO_RELAUNCH,
    TraceFormatError,
    Verdict,
    compare,
    read_trace,
    render,
    to_json,
)

STEPS, SAVE_EVERY = 12, 4
PATH = "/ckpts/last.ckpt"


def start(step=0, resumed_from=None, problems=(), pid=100, rank=0):
    return {
        "kind": "start", "pid": pid, "rank": rank, "world_size": 2, "step": step, "resumed_from": resumed_from,
        "exact": None if resumed_from is None else True, "problems": list(problems), "time": 1.0 + pid,
    }  # fmt: skip


def batch(step, rank=0, **changed):
    record = {
        "kind": "batch", "step": step, "micro": step % 6, "epoch": step // 6, "batch": f"b{rank}-{step}",
        "rng": f"r{rank}-{step}", "loss": f"l{rank}-{step}", "lr": [0.1 / (1 + step)], "time": 2.0,
    }  # fmt: skip
    return {**record, **changed}


def weights(kind, step, rank=0, **changed):
    return {"kind": kind, "step": step, "params": f"p{rank}-{step}", "optim": f"o{rank}-{step}", **changed}


def end(step=STEPS, rank=0, **changed):
    files = sorted(f"step={s}.ckpt" for s in range(SAVE_EVERY, step + 1, SAVE_EVERY))
    return {**weights("end", step, rank), "sched": f"s{rank}-{step}", "files": files, **changed}


def steps(first, last, rank=0, change=None):
    """The records of steps ``first`` .. ``last - 1``; ``change(record)`` may alter each one."""
    out = []
    for s in range(first, last):
        out.append(batch(s, rank))
        if (s + 1) % SAVE_EVERY == 0:
            out.append(weights("saved", s + 1, rank))
    return [change(r) if change else r for r in out]


def run(kills=(), rank=0, change=None, last=STEPS):
    """One rank's trace: launches killed at the steps in ``kills`` (after their batch), each relaunch
    resumed at the last saved step before the kill, the last launch running to step ``last``."""
    records, first = [start(rank=rank)], 0
    for n, kill in enumerate(kills, 1):
        records += steps(first, kill + 1, rank, change)
        first = (kill + 1) // SAVE_EVERY * SAVE_EVERY
        records.append(start(first, PATH, pid=100 + n, rank=rank))
    records += steps(first, last, rank, change) + [end(last, rank)]
    return records


def changed_at(step, kind="batch", **fields):
    """A ``change`` for ``run``: alter ``fields`` of the record of ``kind`` at ``step``."""

    def change(record):
        return {**record, **fields} if record["kind"] == kind and record["step"] == step else record

    return change


def compared_only(records):
    return [r for r in records if r["kind"] != "start"]


# ------------------------------------------------------------------------------------------ exact


@pytest.mark.parametrize("kills", [(5,), (5, 9)])
def test_a_run_resumed_exactly_is_exact_on_two_ranks(kills):
    a = {r: run(rank=r) for r in (0, 1)}
    b = {r: run(kills, rank=r) for r in (0, 1)}
    verdict = compare(a, b)
    assert verdict.exact, verdict
    assert verdict.launches == {0: len(kills) + 1, 1: len(kills) + 1}
    resumed = tuple((k + 1) // SAVE_EVERY * SAVE_EVERY for k in kills)
    assert verdict.resumed_at == {0: resumed, 1: resumed}
    assert verdict.compared == {0: len(compared_only(a[0])), 1: len(compared_only(a[1]))}
    assert render(verdict).splitlines()[0] == "EXACT"


def test_time_and_pid_are_not_compared():
    b = run((5,))
    b = [{**r, "time": 99.0, "pid": 7} if r["kind"] == "batch" else r for r in b]
    assert compare({0: run()}, {0: b}).exact


def test_a_run_never_relaunched_is_no_proof():
    verdict = compare({0: run()}, {0: run()})
    assert not verdict.exact
    assert (verdict.component, verdict.rank, verdict.cause) == ("start", 0, NO_RELAUNCH)
    assert compare({0: run()}, {0: run()}, require_relaunch=False).exact


def test_no_trace_of_b_is_no_proof():
    assert compare({0: run()}, {}).component == "start"


# ---------------------------------------------------------------------------------------- the cut


def test_records_after_the_resumed_checkpoint_are_dropped():
    # launch 1 trains steps 0..6 (saved at 4), is killed, launch 2 resumes at 4 and redoes 4, 5, 6
    verdict = compare({0: run()}, {0: run((6,))})
    assert verdict.exact, verdict
    assert verdict.compared == {0: len(compared_only(run()))}  # launch 1's steps 5 and 6 are not compared


def test_a_validation_between_two_saves_of_one_step_is_kept():
    launch_1 = [start(), *steps(0, 4), {"kind": "val", "step": 4, "metrics": {"v": "3f00"}},
                weights("saved", 4), batch(4), batch(5)]  # fmt: skip
    launch_2 = [start(4, PATH, pid=101), batch(4)]
    a = [start(), *steps(0, 4), {"kind": "val", "step": 4, "metrics": {"v": "3f00"}}, weights("saved", 4), batch(4)]
    assert compare({0: a}, {0: launch_1 + launch_2}).exact
    without = [r for r in launch_1 if r["kind"] != "val"] + launch_2
    assert compare({0: a}, {0: without}).component == "val"  # so the one in launch 1 was compared


def test_a_relaunch_resumed_from_a_checkpoint_saved_two_launches_ago():
    # launch 2 is killed before its first save: launch 3 resumes from launch 1's checkpoint of step 4
    records = [start(), *steps(0, 6), start(4, PATH, pid=101), *steps(4, 7), start(4, PATH, pid=102),
               *steps(4, STEPS), end()]  # fmt: skip
    verdict = compare({0: run()}, {0: records})
    assert verdict.exact and verdict.compared == {0: len(compared_only(run()))}
    assert verdict.resumed_at == {0: (4, 4)}


def test_a_kill_between_the_top_k_file_and_last_ckpt_of_one_step_is_exact():
    """A saves step 4 twice (``save_last=True``: the top-k file, then ``last.ckpt``); B's launch 1 is killed
    between the two, its relaunch resumes from the first and never writes the second (CI, stop 33)."""
    twice = lambda records: [x for r in records for x in ([r, r] if r["kind"] == "saved" else [r])]
    a = twice(run())
    launch_1 = [start(), *twice(steps(0, 4))[:-1]]  # killed before its second save of step 4
    b = [*launch_1, start(4, PATH, pid=101), *twice(steps(4, STEPS)), end()]
    verdict = compare({0: a}, {0: b})
    assert verdict.exact, verdict
    assert verdict.compared == {0: len(compared_only(run()))}, "the same state saved twice is counted once"
    other = [{**r, "params": "p-other"} if r["kind"] == "saved" and r["step"] == 8 else r for r in b]
    other[[i for i, r in enumerate(other) if r["kind"] == "saved" and r["step"] == 8][0]]["params"] = "p0-8"
    verdict = compare({0: a}, {0: other})
    assert (verdict.component, verdict.step) == ("extra", 8), "a second save of other weights is still compared"


# ------------------------------------------------------------------------------------- diagnoses


def test_a_relaunch_that_loaded_no_checkpoint():
    b = [start(), *steps(0, 6), start(0, None, pid=101), *steps(0, STEPS), end()]
    verdict = compare({0: run()}, {0: b})
    assert (verdict.exact, verdict.component, verdict.step) == (False, "start", 0)
    assert "loaded no checkpoint and started from step 0" in verdict.cause
    assert 'ckpt_path="last"' in verdict.fix and "--ckpt_path last" in verdict.fix


def test_a_relaunch_at_a_step_no_launch_saved():
    b = [start(), *steps(0, 6), start(8, "/elsewhere/old.ckpt", pid=101), *steps(8, STEPS), end()]
    verdict = compare({0: run()}, {0: b})
    assert (verdict.component, verdict.step, verdict.got) == ("start", 8, 8)
    assert "did not write" in verdict.cause and "/elsewhere/old.ckpt" in verdict.cause


def found(kind, subject, line=""):
    return {"kind": kind, "subject": subject, "line": line or f"{subject}: a {kind} problem"}


UNSAVED_LOADER = found(
    "loader_position_unsaved", "train loader 0",
    "train loader 0 is a MyLoader (a DataLoader subclass, left as it is), so its position is not saved",
)  # fmt: skip
GENERATOR = found(
    "unsaved_generator", "model.noise", "not exact: model.noise is a numpy.random.Generator no checkpoint saves"
)
BUFFER = found("unsaved_buffer", "scale", "non-persistent buffer scale differs after restore")
# The same problems as the words earlier versions matched: a diagnosis must never come from words alone.
WORDS = [
    "train loader 0 is a DataLoader subclass, so its position is not saved",
    "model.noise is a numpy.random.Generator no checkpoint saves",
    "non-persistent buffers ['scale'] differ after restore",
]


def relaunched(change, findings=(), kill=5, every=lambda r: r, **facts):
    """B killed at ``kill`` whose relaunch (resumed at 4) recorded ``findings`` (and the start ``facts``:
    ``loaders``, ``schedulers``); ``every`` alters all its records, then ``change`` the relaunch's. Its
    problems lines are ``WORDS`` always."""
    relaunch = {**start(4, PATH, WORDS, pid=101), "findings": list(findings), **facts}
    records = [start(), *map(every, steps(0, kill + 1)), relaunch]
    return records + [change(every(r)) for r in [*steps(4, STEPS), end()]]


def test_batch_content_differs_with_an_unsaved_loader_position_names_that_loader():
    b = relaunched(changed_at(5, batch="other"), findings=[UNSAVED_LOADER, BUFFER])
    verdict = compare({0: run()}, {0: b})
    assert (verdict.component, verdict.step, verdict.expected, verdict.got) == ("batch", 5, "b0-5", "other")
    assert verdict.cause.startswith(
        "batch content differs from step 5: train loader 0 could not have its position saved"
    )
    assert "MyLoader" in verdict.cause and "scale" not in verdict.cause and verdict.sure
    assert "StatefulDataLoader" in verdict.fix


def test_batch_content_differing_without_evidence_is_not_sure_and_says_what_was_compared():
    verdict = compare({0: run()}, {0: relaunched(changed_at(5, batch="other"))})  # warning words, no findings
    assert verdict.component == "batch" and not verdict.sure
    assert verdict.cause.startswith("not sure why batch content differs from step 5: every train loader's position")
    assert "RNG streams before it were equal" in verdict.cause


def test_sure_comes_from_how_the_cause_was_found_never_from_its_words(monkeypatch):
    """A cause the evidence singles out is sure whatever words begin it: ``Verdict.sure`` reads no text."""
    from lightning_resume.prove import compare as module

    words = "not sure is how this cause happens to begin"
    monkeypatch.setitem(module._CAUSES, "batch", lambda f: (words, "fix"))
    verdict = compare({0: run()}, {0: relaunched(changed_at(5, batch="other"))})
    assert verdict.cause == words and verdict.sure


COMBINED = {"mode": "max_size", "each": [{"type": "DataLoader", "dataset": "A", "iterable": False}] * 2}
REPLAY = {"mode": None, "each": [{"type": "DataLoader", "dataset": "ReplayBuffer", "iterable": True}]}


def test_a_combined_loader_and_an_iterable_dataset_get_their_own_cause():
    combined = compare({0: run()}, {0: relaunched(changed_at(5, batch="other"), loaders=COMBINED)})
    assert "CombinedLoader mode='max_size', 2 loaders" in combined.cause and combined.sure
    assert "position was not restored" not in combined.cause
    replay = compare({0: run()}, {0: relaunched(changed_at(5, batch="other"), loaders=REPLAY)})
    assert "IterableDataset (ReplayBuffer)" in replay.cause and "state_dict/load_state_dict" in replay.fix


def test_same_batch_and_rng_but_another_loss_names_the_unsaved_generator():
    b = relaunched(changed_at(5, loss="3f000000"), findings=[UNSAVED_LOADER, GENERATOR])
    verdict = compare({0: run()}, {0: b})
    assert (verdict.component, verdict.step) == ("loss", 5)
    assert "an RNG stream outside ExactResume (model.noise)" in verdict.cause and "ExactResume(state=" in verdict.fix
    buffer = compare({0: run()}, {0: relaunched(changed_at(5, loss="3f000000"), findings=[GENERATOR, BUFFER])})
    assert "non-persistent buffer scale" in buffer.cause and "persistent=True" in buffer.fix  # observed to differ
    assert "also found generators it does not save: model.noise" in buffer.cause
    unknown = compare({0: run()}, {0: relaunched(changed_at(5, loss="3f000000"))})
    assert unknown.cause.startswith("not sure why the loss differs at step 5") and not unknown.sure


def test_rng_differing_before_the_step():
    b = relaunched(changed_at(4, rng="fresh", batch="other"))
    verdict = compare({0: run()}, {0: b})
    assert (verdict.component, verdict.step) == ("rng", 4)  # the RNG is reported before the batch it shaped
    assert "RNG streams differ at the start of step 4" in verdict.cause and not verdict.sure
    loader = compare({0: run()}, {0: relaunched(changed_at(4, rng="fresh"), findings=[UNSAVED_LOADER])})
    assert "train loader 0 could not have its position saved" in loader.cause and "new iterator" in loader.cause


def test_weights_differ_right_after_the_restore():
    b = relaunched(changed_at(8, kind="saved", params="drifted"), findings=[BUFFER, UNSAVED_LOADER])
    verdict = compare({0: run()}, {0: b})
    assert (verdict.component, verdict.step) == ("params", 8)
    assert "weights differ right after the restore" in verdict.cause
    assert "the non-persistent buffer scale" in verdict.cause and "train loader" not in verdict.cause


def test_weights_differing_later_are_not_blamed_on_the_restore():
    b = relaunched(changed_at(12, kind="end", params="drifted"), findings=[BUFFER])
    verdict = compare({0: run()}, {0: b})
    assert (verdict.component, verdict.step) == ("params", 12)
    assert "right after the restore" not in verdict.cause


def test_a_difference_before_any_kill_is_not_a_resume_problem():
    b = run((9,), change=changed_at(2, loss="3f000000"))
    verdict = compare({0: run()}, {0: b})
    assert (verdict.component, verdict.step) == ("loss", 2)
    assert "before B was ever killed" in verdict.cause and "deterministic" in verdict.fix


# ---------------------------------------------------------------------- learning rates and captured state


def with_state(record, sched=None, user=None):
    """A batch record with the scheduler digests and captured-state digests the trace records per step."""
    if record["kind"] != "batch":
        return record
    step = record["step"]
    return {**record, "sched": sched or [f"s-{step}"], "user": user or {"model.lr_scheduler": f"u-{step}"}}


PLATEAU = [{"type": "ReduceLROnPlateau", "plateau": True, "interval": "epoch"}]
STEP_LR = [{"type": "StepLR", "plateau": False, "interval": "step"}]


def test_a_plateau_scheduler_returned_from_configure_optimizers_is_not_told_to_be_returned():
    """The reported case: a ReduceLROnPlateau that is returned from configure_optimizers missed its epoch-end
    step; its state differs at the next epoch's first step, before the learning rate it sets."""
    a = [with_state(r) for r in run()]
    missed = changed_at(6, sched=["not stepped"], lr=[0.5])
    verdict = compare({0: a}, {0: relaunched(missed, every=with_state, schedulers=PLATEAU)})
    assert (verdict.component, verdict.detail, verdict.step) == ("sched", "0", 6)
    assert "LR scheduler 0 (ReduceLROnPlateau), returned from configure_optimizers" in verdict.cause
    assert "return the scheduler" not in verdict.fix and verdict.sure
    step_lr = compare({0: a}, {0: relaunched(missed, every=with_state, schedulers=STEP_LR)})
    assert "LR scheduler 0 (StepLR)" in step_lr.cause and "stepped outside Lightning's schedule" in step_lr.cause


def test_a_scheduler_stepped_by_hand_that_nobody_saves():
    """No scheduler in Lightning's lists, yet the LR changes: the LR differs first, and the cause says why."""
    b = relaunched(changed_at(5, lr=[0.9]), schedulers=[])
    verdict = compare({0: run()}, {0: b})
    assert (verdict.component, verdict.step) == ("lr", 5)
    assert "no LR scheduler is returned from configure_optimizers, yet the learning rate changes" in verdict.cause
    assert "configure_optimizers" in verdict.fix and verdict.sure

    def constant(record):
        return {**record, "lr": [0.1]} if record["kind"] == "batch" else record

    relaunch = relaunched(changed_at(5, lr=[0.2]), every=constant)
    assert not compare({0: [constant(r) for r in run()]}, {0: relaunch}).sure


def test_captured_state_that_differs_is_named_as_that_component():
    a = [with_state(r) for r in run()]
    b = relaunched(changed_at(5, user={"model.lr_scheduler": "reset"}), every=with_state)
    verdict = compare({0: a}, {0: b})
    assert (verdict.component, verdict.detail, verdict.step) == ("user", "model.lr_scheduler", 5)
    assert verdict.cause.startswith("model.lr_scheduler differs at the start of step 5")
    assert (verdict.expected, verdict.got) == ("u-5", "reset")
    assert render(verdict).splitlines()[0] == "DIFFERS at step 5 (rank 0): user model.lr_scheduler"


def test_validation_metrics_that_differ_are_named_and_not_sure():
    val = {"kind": "val", "step": 8, "metrics": {"val/acc": "a", "val/loss": "l"}}
    a = run()
    a.insert(next(i for i, r in enumerate(a) if r["kind"] == "saved" and r["step"] == 8), val)
    b = relaunched(lambda r: r)
    b.insert(
        next(i for i, r in enumerate(b) if r["kind"] == "saved" and r["step"] == 8),
        {**val, "metrics": {"val/acc": "b", "val/loss": "l"}},
    )
    verdict = compare({0: a}, {0: b})
    assert (verdict.component, verdict.detail) == ("val", "val/acc") and not verdict.sure
    assert "torchmetrics" in verdict.cause


# ------------------------------------------------------------------------------- timed snapshots


def snapshot(step, **changed):
    return weights("saved", step, timed=True, **changed)


def with_snapshot(records, step, name=None):
    """``records`` with a timed save after the batch that reaches ``step``, and its file at the end."""
    out = []
    for r in records:
        out.append(r)
        if r["kind"] == "batch" and r["step"] + 1 == step:
            out.append(snapshot(step))
    name = name or f"last-snapshot-step={step:09d}.ckpt"
    return [
        {**r, "files": sorted([*r["files"], name]), "timed_files": [name]} if r["kind"] == "end" else r for r in out
    ]


def test_snapshots_at_steps_the_clock_chose_are_not_a_difference():
    """The reported case: a run longer than min_interval snapshots at a step that depends on machine speed."""
    a = with_snapshot(run(), 7)
    b = with_snapshot(run((5,)), 10)  # B snapshots later: its launches ran at another speed
    assert compare({0: a}, {0: b}).exact
    assert compare({0: run()}, {0: b}).exact and compare({0: a}, {0: run((5,))}).exact
    resumed_from_it = [
        *steps(0, 7),
        snapshot(7),
        batch(7),
        start(7, "/ckpts/last-snapshot-step=000000007.ckpt", pid=101),
    ]
    b = with_snapshot([start(), *resumed_from_it, *steps(7, STEPS), end()], 9)
    assert compare({0: a}, {0: b}).exact  # B resumed from its own snapshot: the cut still reads it


def test_a_snapshot_both_runs_took_at_one_step_is_compared_by_content():
    a = with_snapshot(run(), 10)
    b = with_snapshot(run((5,)), 10)
    b = [{**r, "params": "drifted"} if r["kind"] == "saved" and r.get("timed") else r for r in b]
    verdict = compare({0: a}, {0: b})
    assert (verdict.component, verdict.step, verdict.detail) == ("params", 10, "snapshot of step 10")


def test_a_retention_that_took_a_snapshot_instead_of_its_own_save_is_not_a_difference():
    """Retention skips its save of a step it just snapshotted, and counts the snapshot in keep_last: the files
    it keeps depend on when the snapshots came, once any came."""
    a = [{**r, "retention_files": r["files"]} if r["kind"] == "end" else r for r in run()]
    b = [snapshot(8) if r["kind"] == "saved" and r["step"] == 8 else r for r in run((5,))]
    b = [
        {**r, "files": ["step=12.ckpt", "step=7.ckpt"], "retention_files": ["step=12.ckpt", "step=7.ckpt"]}
        if r["kind"] == "end"
        else r
        for r in b
    ]
    assert compare({0: a}, {0: b}).exact
    untimed = [{**r, "timed": False} if r["kind"] == "saved" else r for r in b]
    assert not compare({0: a}, {0: untimed}).exact  # without a timed save, retention's files are compared


def test_checkpoint_files_differ_at_the_end():
    files = ["step=12.ckpt", "step=4.ckpt", "step=8-v1.ckpt", "step=8.ckpt"]
    b = relaunched(lambda r: {**r, "files": files} if r["kind"] == "end" else r)
    verdict = compare({0: run()}, {0: b})
    assert (verdict.component, verdict.step, verdict.got) == ("files", 12, files)
    assert verdict.cause == "the checkpoint files written differ: only in the killed run ['step=8-v1.ckpt']"
    fewer = relaunched(lambda r: {**r, "files": ["step=12.ckpt", "step=4.ckpt"]} if r["kind"] == "end" else r)
    assert "only in the uninterrupted run ['step=8.ckpt']" in compare({0: run()}, {0: fewer}).cause


def test_the_file_a_relaunch_resumed_from_is_kept_by_rule_not_a_difference():
    """A relaunch from a file A pruned later keeps it (Lightning never deletes the file a run resumed from):
    not a difference; any other extra file, or the source when it is not a relaunch's, still is."""
    a = [{**r, "files": ["last.ckpt", "step=12.ckpt"]} if r["kind"] == "end" else r for r in run()]
    kept = ["last.ckpt", "step=12.ckpt", "step=4.ckpt"]
    resumed = [
        {**r, "resumed_from": "/ckpts/step=4.ckpt"} if r["kind"] == "start" and r["step"] == 4 else r for r in run((5,))
    ]
    b = [{**r, "files": kept} if r["kind"] == "end" else r for r in resumed]
    assert compare({0: a}, {0: b}).exact
    url = [{**r, "resumed_from": "s3://bucket/ckpts/step=4.ckpt"} if r.get("resumed_from") else r for r in b]
    assert compare({0: a}, {0: url}).exact
    from_last = [{**r, "files": kept} if r["kind"] == "end" else r for r in run((5,))]  # resumed from last.ckpt
    verdict = compare({0: a}, {0: from_last})
    assert verdict.component == "files" and "only in the killed run ['step=4.ckpt']" in verdict.cause
    more = [{**r, "files": [*kept, "step=8.ckpt"]} if r["kind"] == "end" else r for r in resumed]
    assert "only in the killed run ['step=8.ckpt']" in compare({0: a}, {0: more}).cause


def test_fewer_steps_are_missing_records():
    verdict = compare({0: run()}, {0: run((5,), last=10)})
    assert (verdict.component, verdict.step) == ("missing", 10)
    assert "fewer steps" in verdict.cause and "end at step 10" in verdict.cause


def test_a_trace_that_stops_early_is_missing_records():
    b = run((5,))[:-3]
    verdict = compare({0: run()}, {0: b})
    assert verdict.component == "missing" and verdict.got is None


def test_more_steps_are_extra_records():
    a = {0: run(last=10)}
    verdict = compare(a, {0: run((5,))})
    assert (verdict.component, verdict.step) == ("extra", 10)
    assert "more steps" in verdict.cause


def test_a_validation_run_at_another_point():
    b = run((5,))
    b.insert(len(b) - 3, {"kind": "val", "step": 11, "metrics": {}})
    verdict = compare({0: run()}, {0: b})
    assert verdict.component == "val" and "validation ran at another point" in verdict.cause


# ------------------------------------------------------------------------------------------ ranks


def test_the_first_position_over_ranks_decides_and_the_lowest_rank_on_a_tie():
    a = {r: run(rank=r) for r in (0, 1)}
    late_0 = run((5,), rank=0, change=changed_at(9, loss="x"))
    early_1 = run((5,), rank=1, change=changed_at(6, loss="x"))
    assert (compare(a, {0: late_0, 1: early_1}).rank, compare(a, {0: late_0, 1: early_1}).step) == (1, 6)
    same_1 = run((5,), rank=1, change=changed_at(9, loss="x"))
    tie = compare(a, {0: late_0, 1: same_1})
    assert (tie.rank, tie.step) == (0, 9)
    assert tie.compared[0] == tie.compared[1] and tie.compared[0] < len(compared_only(a[0]))


def test_a_rank_missing_from_b():
    a = {r: run(rank=r) for r in (0, 1)}
    verdict = compare(a, {0: run((5,))})
    assert (verdict.component, verdict.rank) == ("missing", 1)


# ------------------------------------------------------------------------------------------ files


def write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_read_trace_skips_the_torn_last_line(tmp_path):
    write(tmp_path / "trace-rank0.jsonl", run((5,)), tail='{"kind": "batch", "st')
    write(tmp_path / "trace-rank1.jsonl", run((5,), rank=1))
    (tmp_path / "launch-1.log").write_text("not a trace")
    trace = read_trace(tmp_path)
    assert list(trace) == [0, 1] and trace[0] == run((5,)) and trace[1] == run((5,), rank=1)


def test_read_trace_skips_a_torn_line_a_relaunch_appended_after(tmp_path):
    # the writer ends a torn line with a newline before the relaunch's start record
    launch_1, launch_2 = [start(), *steps(0, 6)], [start(4, PATH, pid=101), *steps(4, STEPS), end()]
    text = "".join(json.dumps(r) + "\n" for r in launch_1) + '{"kind":"bat\n'
    (tmp_path / "trace-rank0.jsonl").write_text(text + "".join(json.dumps(r) + "\n" for r in launch_2))
    assert read_trace(tmp_path)[0] == launch_1 + launch_2


def test_read_trace_refuses_a_bad_line_elsewhere_naming_file_and_line(tmp_path):
    lines = [json.dumps(r) for r in run()]
    lines[3] = '{"kind": "batch", "st'
    (tmp_path / "trace-rank2.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=r"trace-rank2\.jsonl:4: "):
        read_trace(tmp_path)


def test_read_trace_of_no_directory_is_empty(tmp_path):
    assert read_trace(tmp_path / "absent") == {}


# ----------------------------------------------------------------------------------------- output

SCHEMA = {
    "verdict": str, "step": (int, type(None)), "rank": (int, type(None)), "component": (str, type(None)),
    "cause": str, "fix": str, "launches": dict, "resumed_at": dict, "compared": dict, "sure": bool,
    "detail": (str, type(None)),
}  # fmt: skip


@pytest.mark.parametrize("exact", [True, False])
def test_json_schema(exact):
    b = {r: run((5, 9), rank=r, change=None if exact else changed_at(6, loss="x")) for r in (0, 1)}
    document = to_json(compare({r: run(rank=r) for r in (0, 1)}, b))
    assert set(document) == set(SCHEMA) | {"expected", "got"}
    for key, types in SCHEMA.items():
        assert isinstance(document[key], types), key
    assert document["verdict"] == ("EXACT" if exact else "DIFFERS")
    assert document["launches"] == {"0": 3, "1": 3} and document["resumed_at"] == {"0": [4, 8], "1": [4, 8]}
    assert all(isinstance(n, int) for n in document["compared"].values())
    if exact:
        assert (document["step"], document["component"], document["cause"]) == (None, None, "")
    else:
        assert (document["step"], document["rank"], document["component"]) == (6, 0, "loss")
        assert (document["expected"], document["got"]) == ("l0-6", "x") and document["cause"]
    assert json.loads(json.dumps(document)) == document


def test_render_names_the_difference_then_cause_fix_and_a_row_per_rank():
    b = {r: run((5, 9), rank=r, change=changed_at(6, batch="other")) for r in (0, 1)}
    text = render(compare({r: run(rank=r) for r in (0, 1)}, b))
    lines = text.splitlines()
    assert lines[0] == "DIFFERS at step 6 (rank 0): batch"
    assert any(line.startswith("cause:") and "batch content differs" in line for line in lines)
    assert any(line.startswith("fix:") for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("rank"))
    assert lines[header].split() == ["rank", "launches", "resumed", "at", "records", "compared"]
    assert [line.split()[:4] for line in lines[header + 1 :]] == [["0", "3", "4,", "8"], ["1", "3", "4,", "8"]]


def test_verdict_is_frozen():
    with pytest.raises(AttributeError):
        Verdict(True).exact = False  # type: ignore[misc]


def test_the_comparison_needs_neither_torch_nor_lightning():
    code = "import sys, lightning_resume.prove.compare; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning')))"
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


def test_ignore_leaves_out_kinds_and_fields_but_the_cut_still_reads_them():
    """What a caller checks itself (the project's kill-and-resume harness: the files written) can be left out;
    a save redone after the resume then no longer counts, every training difference still does."""
    b = run((5,))
    i = next(i for i, r in enumerate(b) if r["kind"] == "start" and r["step"]) + 1
    b = [*b[:i], weights("saved", 4), *b[i:]]  # the resumed run saves its resume step once more
    b = [{**r, "files": ["other.ckpt"]} if r["kind"] == "end" else r for r in b]
    assert compare({0: run()}, {0: b}).component == "extra"
    assert compare({0: run()}, {0: b}, ignore=("saved", "files")).exact
    trained_differently = [{**r, "loss": "x"} if r["kind"] == "batch" and r["step"] == 7 else r for r in b]
    verdict = compare({0: run()}, {0: trained_differently}, ignore=("saved", "files"))
    assert (verdict.exact, verdict.component, verdict.step) == (False, "loss", 7)


def test_a_relaunch_that_reruns_the_validation_due_at_its_save_is_cut_before_that_validation():
    """Saves of one step before and after its validation: a relaunch that begins by validating resumed the
    earlier one (validation was due), so the killed launch's validation is dropped, not counted twice."""
    val = {"kind": "val", "step": 4, "metrics": {"loss": "v"}}
    a = [start(), *steps(0, 4), val, weights("saved", 4), *steps(4, 6), end(6)]
    b = [start(), *steps(0, 4), val, weights("saved", 4), batch(4), start(4, PATH, pid=101), val, *steps(4, 6), end(6)]
    a = [r for r in a if not (r["kind"] == "end")] + [end(6, files=[])]
    b = [r for r in b if not (r["kind"] == "end")] + [end(6, files=[])]
    assert compare({0: a}, {0: b}, ignore=("saved",)).exact
