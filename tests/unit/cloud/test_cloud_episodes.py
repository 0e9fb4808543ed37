"""The advisory episode policy (``cloud.episodes``): pure, no server, no clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lightning_resume.cloud.episodes import next_episode

QUIET = 600.0


def _handed_out(answers: list[tuple[float, object]], quiet_s: float = QUIET) -> list[float]:
    """The times at which an advisory is handed out for ``(time, detail or None)`` answers."""
    episode, out = None, []
    for now, detail in answers:
        episode, new = next_episode(episode, detail, now, quiet_s)
        if new:
            out.append(now)
    return out


def test_a_flapping_advisory_is_one_episode():
    flaps = [(t * 5.0, "rebalance of 12:00" if t % 2 == 0 else None) for t in range(80)]
    assert _handed_out(flaps) == [0.0]


def test_a_new_notice_time_at_every_reappearance_is_still_one_episode_per_quiet_period():
    flaps = [(t * 5.0, f"rebalance of {t}" if t % 2 == 0 else None) for t in range(400)]  # 2000 s
    handed = _handed_out(flaps)
    assert handed == [0.0, 600.0, 1200.0, 1800.0]


def test_the_same_announcement_after_a_quiet_period_is_a_new_episode():
    """GCE announces every live migration with the same text: only the quiet between them tells two apart."""
    answers = [(0.0, "MIGRATE"), (5.0, "MIGRATE"), (10.0, None), (700.0, None), (705.0, "MIGRATE")]
    assert _handed_out(answers) == [0.0, 705.0]


def test_a_changed_announcement_waits_for_the_quiet_period_then_is_handed_out():
    answers = [(0.0, "of 12:00"), (100.0, "of 12:01"), (599.0, "of 12:01"), (600.0, "of 12:01"), (605.0, "of 12:01")]
    assert _handed_out(answers) == [0.0, 600.0]


@given(
    st.lists(st.tuples(st.floats(0, 50), st.one_of(st.none(), st.sampled_from(["a", "b", "c"]))), max_size=200),
    st.floats(1, 100),
)
def test_episodes_are_at_least_quiet_s_apart_whatever_the_endpoint_answers(steps, quiet_s):
    now, answers = 0.0, []
    for gap, detail in steps:
        now += gap
        answers.append((now, detail))
    handed = _handed_out(answers, quiet_s)
    assert all(b - a >= quiet_s for a, b in zip(handed, handed[1:]))
    if any(detail is not None for _, detail in answers):
        assert handed, "the first advisory is always handed out"
