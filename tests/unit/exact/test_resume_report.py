"""``ExactResume.resume_report`` is a frozen ``ResumeReport``; the dict of earlier versions still reads, warned."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_resume import ResumeReport
from lightning_resume.exact.restore import BeforeAfter, as_launched

DEALT = ResumeReport(
    step=12, exact=False, differences=("resumed a checkpoint of 2 ranks on 4",), sample_exact=True,
    world_size=BeforeAfter(2, 4), global_batch=BeforeAfter(16, 32), accumulate_grad_batches=BeforeAfter(1, 1),
    untrained=40, repeated=0, dropped=0, fingerprint_ok=True,
)  # fmt: skip


def test_a_fresh_start_reports_nothing_restored_and_no_source():
    report = as_launched(ResumeReport(), None, "durable", memory_tier=True, unsaved=["loader 0"])
    assert report == ResumeReport() and not report.resumed
    assert report.to_dict() == {"source": None}  # what earlier versions set


def test_item_access_reads_the_earlier_dict_and_names_the_attribute_to_use():
    with pytest.warns(DeprecationWarning, match=r"use ExactResume\.resume_report\.world_size"):
        assert DEALT["world_size"] == {"checkpoint": 2, "now": 4}
    with pytest.warns(DeprecationWarning, match=r"resume_report\.global_batch"):
        assert DEALT.get("global_batch") == {"before": 16, "after": 32}
    with pytest.warns(DeprecationWarning):
        assert DEALT["differences"] == ["resumed a checkpoint of 2 ranks on 4"]
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        DEALT["tier"]  # never set: a KeyError, as the dict raised
    with pytest.warns(DeprecationWarning):
        assert "untrained" in DEALT and "memory_tier" not in DEALT


def test_the_report_is_frozen_and_its_dict_is_json():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEALT.exact = True  # type: ignore[misc]
    assert json.loads(json.dumps(DEALT.to_dict()))["accumulate_grad_batches"] == {"before": 1, "after": 1}
    assert "unsaved_buffers_differ" not in DEALT.to_dict()  # absent unless some differ, as before


def test_the_launch_adds_the_tier_the_memory_tiers_reason_and_unsaved_loaders():
    report = as_launched(DEALT, "/ckpts/last.ckpt", "durable", memory_tier=True, unsaved=["loader 1: no position"])
    assert report.source == "/ckpts/last.ckpt" and report.tier == "durable"
    assert report.memory_tier == "snapshots of 2 ranks not used: resumed from disk"
    assert report.differences[-1] == "loader 1: no position" and report.exact is False
    same_world = dataclasses.replace(DEALT, exact=True, differences=(), world_size=None)
    assert as_launched(same_world, "x", "memory", memory_tier=True, unsaved=[]).memory_tier is None
    assert as_launched(same_world, "x", "memory", memory_tier=True, unsaved=[]).exact is True
