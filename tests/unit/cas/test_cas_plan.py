"""The save plan of content-addressed saves (``cas.plan``): pure, over plain records."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lightning_resume.cas import plan
from lightning_resume.cas.plan import Action, Seen
from lightning_resume.format.packs import MIN_BLOCK_BYTES, Ref, Refs

BIG = MIN_BLOCK_BYTES


def test_small_tensors_stay_inline_whatever_their_history():
    assert plan.predict(BIG - 1, None) is Action.INLINE
    assert plan.predict(BIG - 1, Seen("k", True)) is Action.INLINE


def test_a_tensor_never_saved_or_that_changed_is_written_while_hashed():
    assert plan.predict(BIG, None) is Action.WRITE
    assert plan.predict(BIG, Seen("k", False)) is Action.WRITE


def test_a_tensor_unchanged_or_not_yet_compared_is_hashed_first():
    assert plan.predict(BIG, Seen("k", True)) is Action.HASH_FIRST
    assert plan.predict(BIG, Seen("k", None)) is Action.HASH_FIRST


def test_plan_keeps_file_order_within_each_action():
    seen = {"b": Seen("x", True), "d": Seen("y", False)}
    p = plan.plan({"a": BIG, "b": BIG, "c": 10, "d": BIG, "e": BIG}, seen)
    assert p == plan.Plan(inline=["c"], hash_first=["b"], write=["a", "d", "e"])


def _passes(history: list[list[str]]) -> list[int]:
    """Passes over each save's bytes for one tensor whose key at save i is ``history[i]``: 1 when written while
    hashed or hashed and referenced, 2 when hashed first and then written."""
    seen: dict[str, Seen] = {}
    held: set[str] = set()
    out = []
    for keys in history:
        action = plan.predict(BIG, seen.get("t"))
        key = keys[0]
        out.append(2 if action is Action.HASH_FIRST and key not in held else 1)
        held = {key}
        seen = plan.after_save(seen, {"t": key})
    return out


@given(st.lists(st.sampled_from("abc"), min_size=2, max_size=12))
def test_a_tensor_that_changed_at_the_previous_save_costs_one_pass(keys):
    passes = _passes([[k] for k in keys])
    for i in range(2, len(keys)):
        if keys[i - 1] != keys[i - 2]:  # it changed at the previous save: predicted to change, written while hashed
            assert passes[i] == 1
        if keys[i] == keys[i - 1]:  # unchanged now: hashed, found held, referenced
            assert passes[i] == 1


def test_a_full_fine_tune_pays_one_pass_per_save_after_the_second():
    assert _passes([[str(i)] for i in range(8)]) == [1, 2, 1, 1, 1, 1, 1, 1]


def test_a_frozen_tensor_is_referenced_from_the_second_save_on():
    seen = plan.after_save({}, {"frozen": "k"})
    assert plan.plan({"frozen": BIG}, seen).hash_first == ["frozen"]
    seen = plan.after_save(seen, {"frozen": "k"})
    assert seen == {"frozen": Seen("k", True)}


def test_after_resume_a_tensor_carried_over_is_unchanged_and_one_the_save_wrote_is_compared_again():
    refs = Refs("ab" * 16, {"frozen": Ref("frozen", "F32", (1,), "k1", "old"), "head": Ref("head", "F32", (1,), "k2", "new")},
                "new")  # fmt: skip
    assert plan.after_resume(refs) == {"frozen": Seen("k1", True), "head": Seen("k2", None)}


def test_a_save_at_the_step_of_the_previous_one_hashes_everything_first_and_keeps_the_history():
    seen = {"head": Seen("k2", False)}
    assert plan.predict(BIG, seen["head"], same_step=True) is Action.HASH_FIRST
    assert plan.predict(BIG, None, same_step=True) is Action.WRITE  # never saved: nothing can hold it
    assert plan.after_save(seen, {"head": "k2"}, same_step=True) == seen  # the next step still predicts a change
    assert plan.after_save(seen, {"head": "k3"}, same_step=True) == {"head": Seen("k3", None)}
