"""Issue 25, part 3: a save of a same-shaped state reuses the last encoding (``codec.TreeEncoder``) and copies
its small tensors in runs (``buffers._Sources``), and nothing it reuses is ever stale.

Every change the signature covers (a key, a type, a dtype, a shape, aliasing, ``requires_grad``...) makes a
full encoding; every tensor-free subtree is encoded afresh at every save; every text equals the full
encoder's byte for byte, and every file loads back as the state at its save.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.errors import UnencodableValueError
from lightning_resume.format import codec, write
from lightning_resume.format.codec import TreeEncoder
from lightning_resume.staging import buffers as buffers_module
from lightning_resume.staging.buffers import HostBuffers
from tests.helpers.compare import assert_same, tensor_bits


def _state(n: int = 6, seed: int = 0) -> Dict[str, Any]:
    """A Lightning-shaped checkpoint: weights (one tied), AdamW-like moments with tensor steps, loop counters,
    callback state, RNG-like tensors and a few dtypes."""
    g = torch.Generator().manual_seed(seed)
    params = OrderedDict((f"layer{i}.weight", torch.randn(4, 3, generator=g)) for i in range(n))
    params["head.weight"] = params["layer0.weight"]  # tied
    moments = {
        i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(4, 3, generator=g), "exp_avg_sq": torch.rand(4, 3)}
        for i in range(n)
    }
    return {
        "epoch": 1,
        "global_step": 10,
        "pytorch-lightning_version": "2.6",
        "state_dict": params,
        "optimizer_states": [
            {"state": moments, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(n))}]}
        ],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1, "completed": 0}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None, "best_model_path": ""}},
        "rng": {"torch": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g), "python": (3, (1, 2, 3), None)},
        "by_id": {0: torch.zeros(2), 1: torch.ones(2)},
        "extra": {
            "mask": torch.tensor([True, False]),
            "half": torch.randn(3, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 2),
            "c": torch.randn(2, dtype=torch.complex64, generator=g),
            "sq": torch.randn(3, 3, generator=g),
            "inf": float("inf"),
        },
    }


def _check(encoder: TreeEncoder, state: Any) -> codec.TreeText:
    """The encoder's text and tensors are exactly what the full encoder gives for ``state``."""
    got = encoder.encode(state)
    tree_json, tensors = write.encode_tree(state)
    assert got.tree_json == tree_json
    assert list(got.tensors) == list(tensors)
    for name, t in tensors.items():
        assert (got.tensors[name].dtype, got.tensors[name].shape) == (t.dtype, t.shape), name
        assert tensor_bits(got.tensors[name].resolve_conj().resolve_neg()) == tensor_bits(
            t.resolve_conj().resolve_neg()
        )
    return got


def _rename(mapping: Dict, old: Any, new: Any) -> Dict:
    return type(mapping)((new if k == old else k, v) for k, v in mapping.items())


def _sd(s: Dict) -> Dict:
    return s["state_dict"]


def _moments(s: Dict) -> Dict:
    return s["optimizer_states"][0]["state"]


# each: what changes between two saves of the same state, and whether the second reuses the first's encoding
MUTATIONS: Dict[str, tuple[Callable[[Dict], None], bool]] = {
    "scalar leaf": (lambda s: s.update(global_step=11), True),
    "scalar leaf of another type": (lambda s: s.update(global_step=11.5), True),
    "nested scalar": (lambda s: s["loops"]["fit_loop"]["epoch_progress"]["total"].update(completed=1), True),
    "learning rate": (lambda s: s["optimizer_states"][0]["param_groups"][0].update(lr=5e-4), True),
    "string leaf": (lambda s: s.update({"pytorch-lightning_version": "2.7"}), True),
    "key of a tensor-free dict": (lambda s: s.update(loops=_rename(s["loops"], "fit_loop", "validate_loop")), True),
    "non-finite float": (lambda s: s["extra"].update(inf=float("-inf")), True),
    "values changed in place": (lambda s: [t.add_(1) for t in _sd(s).values()], True),
    "a fresh tensor of the same shape": (
        lambda s: s["rng"].update(torch=torch.randint(0, 9, (16,), dtype=torch.uint8)),
        True,
    ),
    "a fresh empty tensor": (lambda s: s["extra"].update(empty=torch.empty(0, 2)), True),
    "transposed in place of itself": (lambda s: s["extra"].update(sq=s["extra"]["sq"].t()), True),
    "a negative view of the same memory": (lambda s: s["extra"].update(sq=s["extra"]["sq"]._neg_view()), True),
    "a conjugate view of the same memory": (lambda s: s["extra"].update(c=s["extra"]["c"].conj()), True),
    "tensor renamed": (lambda s: s.update(state_dict=_rename(_sd(s), "layer3.weight", "layer3.w")), False),
    "tensor key order": (
        lambda s: s.update(state_dict=OrderedDict(reversed(list(_sd(s).items())))),
        False,
    ),
    "nested key of a tensor": (lambda s: s["extra"].update(mask2=s["extra"].pop("mask")), False),
    "dtype, same memory and element size": (
        lambda s: _sd(s).update({"layer1.weight": _sd(s)["layer1.weight"].view(torch.int32)}),
        False,
    ),
    "dtype, same element size": (lambda s: s["extra"].update(half=s["extra"]["half"].view(torch.float16)), False),
    "dtype": (lambda s: s["extra"].update(half=s["extra"]["half"].float()), False),
    "shape, same memory": (lambda s: _sd(s).update({"layer2.weight": _sd(s)["layer2.weight"].view(3, 4)}), False),
    "requires_grad": (lambda s: _sd(s).update({"layer2.weight": _sd(s)["layer2.weight"].requires_grad_()}), False),
    "a Parameter": (lambda s: _sd(s).update({"layer2.weight": torch.nn.Parameter(_sd(s)["layer2.weight"])}), False),
    "a Parameter without grad": (
        lambda s: _sd(s).update({"layer2.weight": torch.nn.Parameter(_sd(s)["layer2.weight"], requires_grad=False)}),
        False,
    ),
    "an int key of a dict of tensors becomes a bool": (lambda s: s.update(by_id=_rename(s["by_id"], 1, True)), False),
    "untied": (lambda s: _sd(s).update({"head.weight": _sd(s)["layer0.weight"].clone()}), False),
    "newly tied": (lambda s: _sd(s).update({"layer1.weight": _sd(s)["layer2.weight"]}), False),
    "a view sharing another tensor's data pointer": (
        lambda s: s["extra"].update(sq=_sd(s)["layer4.weight"].reshape(-1)[:9].view(3, 3)),
        True,  # other shape: not an alias, so the encoding holds; the copy reads the new memory
    ),
    "a tensor-free value becomes a tensor": (
        lambda s: s["callbacks"]["ModelCheckpoint{'monitor': None}"].update(best_model_score=torch.tensor(0.5)),
        False,
    ),
    "a tensor becomes a list": (lambda s: s["extra"].update(mask=[True, False]), False),
    "a numpy array in a tensor-free subtree": (lambda s: s["loops"].update(keys=np.arange(3)), False),
    "a second optimizer": (lambda s: s["optimizer_states"].append({"state": {}, "param_groups": []}), False),
    "a tuple for a list": (lambda s: s.update(optimizer_states=tuple(s["optimizer_states"])), False),
    "an int key becomes a bool": (
        lambda s: s["optimizer_states"][0].update(state=_rename(_moments(s), 1, True)),
        False,
    ),
    "an int key becomes a str": (lambda s: s["optimizer_states"][0].update(state=_rename(_moments(s), 1, "1")), False),
    "an OrderedDict becomes a dict": (lambda s: s.update(state_dict=dict(_sd(s))), False),
    "a per-parameter state loses a key": (lambda s: _moments(s)[2].pop("step"), False),
}


NOT_KEPT = {
    "a numpy array in a tensor-free subtree",
    "an int key becomes a bool",
    "an int key of a dict of tensors becomes a bool",
}
"""Changed states encoded in full at every save: a numpy array (a tensor in a file) and keys other than
strings and ints beside tensors are not tracked by a kept encoding."""


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_second_encoding_is_the_full_encoders_whatever_changed(name):
    change, reuses = MUTATIONS[name]
    encoder, state = TreeEncoder(), _state()
    _check(encoder, state)
    _check(encoder, state)
    assert (encoder.encoded, encoder.reused) == (1, 1)  # a same-shaped state reuses the encoding
    change(state)
    _check(encoder, state)
    assert (encoder.encoded, encoder.reused) == ((1, 2) if reuses else (2, 1))
    _check(encoder, state)  # and the changed state is kept in turn, unless its tensors are not tracked
    assert encoder.reused == (1 if name in NOT_KEPT else 3 if reuses else 2)


def _snapshot(state: Any) -> Any:
    """``state`` as a load of a save taken now gives it back: tensors copied (conjugate and negative views
    resolved, type and ``requires_grad`` kept), containers rebuilt."""
    if isinstance(state, torch.Tensor):
        copy = state.detach().resolve_conj().resolve_neg().clone()
        if type(state) is torch.nn.Parameter:
            return torch.nn.Parameter(copy, requires_grad=state.requires_grad)
        return copy.requires_grad_(state.requires_grad)
    if isinstance(state, dict):
        return type(state)((k, _snapshot(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(_snapshot(v) for v in state)
    return state


@pytest.mark.parametrize("save", ["async", "overlapped"])
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_an_async_save_after_a_change_loads_back_as_the_changed_state(tmp_path, name, save):
    change, _ = MUTATIONS[name]
    io = SafetensorsCheckpointIO(save=save)
    state = _state()
    for i in range(3):  # the third save copies the small tensors in runs (byte views kept since the second)
        io.save_checkpoint(state, tmp_path / f"{i}.ckpt")
    change(state)
    io.save_checkpoint(state, tmp_path / "changed.ckpt")
    expected = _snapshot(state)
    with torch.no_grad():  # after save() returns, the snapshot no longer depends on the state
        for t in [*_sd(state).values(), *(v for m in _moments(state).values() for v in m.values())]:
            if t.dtype.is_floating_point:
                t.add_(1)
    io.teardown()
    loaded = SafetensorsCheckpointIO().load_checkpoint(tmp_path / "changed.ckpt")
    assert_same(loaded, expected)


def test_an_unencodable_value_in_a_reused_tree_fails_as_the_full_encoder_does():
    encoder, state = TreeEncoder(), _state()
    encoder.encode(state)
    state["loops"]["bad"] = object()
    with pytest.raises(UnencodableValueError) as full:
        write.encode_tree(state)
    with pytest.raises(UnencodableValueError) as reused:
        encoder.encode(state)
    assert str(reused.value) == str(full.value)


def test_a_lowered_max_depth_applies_to_a_reused_tree(monkeypatch):
    encoder, state = TreeEncoder(), _state()
    encoder.encode(state)
    monkeypatch.setattr(codec, "MAX_DEPTH", 3)
    with pytest.raises(UnencodableValueError, match="MAX_DEPTH=3"):
        encoder.encode(state)


def test_a_converter_registered_after_a_save_applies_to_the_next(monkeypatch):
    monkeypatch.setattr(codec, "_CONVERTERS_BY_TYPE", dict(codec._CONVERTERS_BY_TYPE))
    monkeypatch.setattr(codec, "_CONVERTERS_BY_NAME", dict(codec._CONVERTERS_BY_NAME))
    encoder, state = TreeEncoder(), _state()
    encoder.encode(state)
    codec.register_converter(OrderedDict, lambda d: {"items": list(d.items())}, lambda v: OrderedDict(v["items"]))
    got = _check(encoder, state)  # the state_dict is now the converter's: not the kept encoding
    assert '"@":"custom"' in got.tree_json and encoder.reused == 0


def test_a_tree_deeper_than_reuse_depth_is_encoded_in_full_each_time():
    deep: Dict[str, Any] = {"w": torch.ones(2)}
    node = deep
    for _ in range(codec.REUSE_DEPTH + 2):
        node["next"] = {"w": torch.ones(1)}
        node = node["next"]
    encoder = TreeEncoder()
    _check(encoder, deep)
    _check(encoder, deep)
    assert encoder.reused == 0


def test_tensor_free_trees_and_a_bare_tensor_are_kept_too():
    encoder = TreeEncoder()
    for tree in ({"a": 1, "b": [1, 2, "x"]}, {"a": 2, "b": [3]}):
        _check(encoder, tree)
    assert encoder.reused == 1
    encoder = TreeEncoder()
    t = torch.arange(5)
    for _ in range(2):
        assert list(_check(encoder, t).tensors) == ["<root>"]
    assert encoder.reused == 1


def test_signatures_that_change_every_save_stop_being_kept():
    encoder = TreeEncoder()
    for i in range(20):
        _check(encoder, {f"w{i}": torch.ones(2)})  # a new key each save: nothing to reuse
    assert encoder.reused == 0 and encoder.encoded == 20 and encoder._plan is None


# ------------------------------------------------------------------------------------ random trees


def _tensor(draw: Callable, shape: List[int], dtype: torch.dtype) -> torch.Tensor:
    seed = draw(st.integers(0, 2**16))
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 10
    return (t > 0) if dtype is torch.bool else t.to(dtype)


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.bool, torch.uint8]
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=3),
)


@st.composite
def _trees(draw: Callable, depth: int = 0) -> Any:
    kind = draw(
        st.sampled_from(["leaf", "tensor", "tensor", "dict", "list", "tuple"] if depth < 3 else ["leaf", "tensor"])
    )
    if kind == "leaf":
        return draw(LEAVES)
    if kind == "tensor":
        return _tensor(draw, draw(st.lists(st.integers(0, 3), max_size=2)), draw(st.sampled_from(DTYPES)))
    children = draw(st.lists(_trees(depth + 1), max_size=3))
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    keys = draw(
        st.lists(
            st.one_of(st.text(max_size=2), st.integers(0, 3)),
            min_size=len(children),
            max_size=len(children),
            unique=True,
        )
    )
    return dict(zip(keys, children))


@st.composite
def _mutated(draw: Callable, tree: Any) -> Any:
    """A copy of ``tree`` where each node may change: a leaf's value, a tensor's values (fresh memory), its
    dtype or shape, a tied tensor, a key; most nodes are kept as they are."""
    change = draw(st.sampled_from(["keep"] * 6 + ["leaf", "fresh", "dtype", "shape", "tie", "key"]))
    if isinstance(tree, torch.Tensor):
        if change == "fresh":
            return _tensor(draw, list(tree.shape), tree.dtype)
        if change == "dtype":
            return tree.to(draw(st.sampled_from(DTYPES)))
        if change == "shape":
            return tree.reshape(-1)
        if change == "leaf":
            return draw(LEAVES)
        return tree
    if isinstance(tree, dict):
        items = [(k, draw(_mutated(v))) for k, v in tree.items()]
        if change == "key" and items:
            items[0] = (draw(st.text(max_size=2)), items[0][1])
        if change == "tie" and len(items) >= 2 and all(isinstance(v, torch.Tensor) for _, v in items[:2]):
            items[1] = (items[1][0], items[0][1])
        return dict(items)
    if isinstance(tree, (list, tuple)):
        return type(tree)(draw(_mutated(v)) for v in tree)
    return draw(LEAVES) if change == "leaf" else tree


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_random_trees_and_changes_encode_as_the_full_encoder_does(data):
    tree = data.draw(_trees())
    encoder = TreeEncoder()
    _check(encoder, tree)
    for _ in range(3):
        tree = data.draw(_mutated(tree))
        _check(encoder, tree)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_random_trees_and_changes_round_trip_through_async_saves(tmp_path, data):
    # Each example in a directory of its own, its writes waited for even when Hypothesis abandons it mid-way
    # (a draw past its data budget): an abandoned example's late writes replaced the next example's files.
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    io = SafetensorsCheckpointIO(save="async")
    tree = {"t": data.draw(_trees())}
    trees = []
    try:
        for i in range(4):
            io.save_checkpoint(tree, root / f"{i}.ckpt")
            tree_json, tensors = write.encode_tree(tree)
            trees.append((tree_json, {k: tensor_bits(v) for k, v in tensors.items()}))  # as at save time
            tree = data.draw(_mutated(tree))
    finally:
        io.teardown()
    for i, (tree_json, tensors) in enumerate(trees):
        loaded = SafetensorsCheckpointIO().load_checkpoint(root / f"{i}.ckpt")
        again_json, again = write.encode_tree(loaded)
        assert again_json == tree_json and {k: tensor_bits(v) for k, v in again.items()} == tensors


# ------------------------------------------------------------------------------------ many tensors


def _many(n: int) -> Dict[str, Any]:
    k = n // 4
    params = OrderedDict((f"layers.{i}.weight", torch.randn(8)) for i in range(k))
    moments = {j: {"step": torch.tensor(1.0), "exp_avg": torch.randn(8), "exp_avg_sq": torch.rand(8)} for j in range(k)}
    return {
        "global_step": 1,
        "state_dict": params,
        "optimizer_states": [{"state": moments, "param_groups": [{"lr": 1e-3, "params": list(range(k))}]}],
        "rng": torch.randint(0, 255, (64,), dtype=torch.uint8),
    }


def test_ten_thousand_tensors_round_trip_through_saves_that_reuse_the_layout(tmp_path):
    state = _many(10_000)
    io = SafetensorsCheckpointIO(save="async")
    saver = io._saver
    expected = []
    for step in range(4):
        if step == 2:  # an optimizer step in place, a counter, fresh RNG state: the same signature
            for t in list(state["state_dict"].values())[::7]:
                t.add_(1)
            for m in list(state["optimizer_states"][0]["state"].values())[::5]:
                m["step"].add_(1)
                m["exp_avg"].mul_(0.5)
            state["global_step"] = 2
            state["rng"] = torch.randint(0, 255, (64,), dtype=torch.uint8)
        if step == 3:  # a renamed tensor: encoded in full and laid out again
            state["state_dict"] = _rename(state["state_dict"], "layers.7.weight", "layers.7.w")
        io.save_checkpoint(state, tmp_path / f"{step}.ckpt")
        tree_json, tensors = write.encode_tree(state)
        expected.append((tree_json, {k: tensor_bits(v) for k, v in tensors.items()}))  # the bytes at save time
    io.teardown()
    assert (saver.encoder.encoded, saver.encoder.reused) == (2, 2)
    assert saver.buffers.layouts == 2
    for step, (tree_json, tensors) in enumerate(expected):
        io.verify_checkpoint(str(tmp_path / f"{step}.ckpt"))
        loaded = SafetensorsCheckpointIO().load_checkpoint(tmp_path / f"{step}.ckpt")
        again_json, again = write.encode_tree(loaded)
        assert again_json == tree_json and len(again) == 10_001
        assert {k: tensor_bits(v) for k, v in again.items()} == tensors


# ------------------------------------------------------------------------------------ the copy


def _small(n: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i:04d}": torch.randn(5, generator=g) for i in range(n)}


def _fill(pool: HostBuffers, tensors: Dict[str, torch.Tensor]):
    staged = pool.prepare(tensors)
    pool.fill(staged, tensors)
    return staged


def test_from_the_third_fill_small_tensors_are_copied_by_one_cat_per_run():
    tensors = _small(3000)
    pool = HostBuffers()
    _fill(pool, tensors)
    _fill(pool, tensors)  # the same memory twice: byte views kept
    staged = pool.prepare(tensors)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pool.fill(staged, tensors)
    calls = [e.name for e in prof.events() if e.cpu_parent is None]
    assert calls == ["aten::cat"], calls  # 60 KB: one run
    assert all(torch.equal(staged[k], v) for k, v in tensors.items())


def test_tensors_in_new_memory_are_copied_from_it_and_their_old_views_dropped():
    tensors = _small(50)
    pool = HostBuffers()
    for _ in range(3):
        _fill(pool, tensors)
    tensors["p0007"] = torch.randn(5)  # fresh memory, same shape
    tensors["p0020"] = torch.randn(10)[::2]  # strided
    tensors["p0030"] = torch.randn(5)._neg_view()  # negative bit
    staged = _fill(pool, tensors)
    for k, v in tensors.items():
        assert torch.equal(staged[k], v.resolve_neg()), k
    sources = pool._sources
    assert sources is not None
    assert [sources.views[i] is None for i in (7, 20, 30)] == [True, True, True]
    tensors["p0020"] = torch.randn(5)
    staged = _fill(pool, tensors)  # and again: p0007 (same memory twice now) gets a view back
    assert sources.views[7] is not None and all(torch.equal(staged[k], v.resolve_neg()) for k, v in tensors.items())


def test_a_failing_run_copy_falls_back_to_copying_tensor_by_tensor(monkeypatch):
    tensors = _small(40)
    pool = HostBuffers()
    for _ in range(2):
        _fill(pool, tensors)

    def refuse(*args, **kwargs):
        raise RuntimeError("no cat today")

    monkeypatch.setattr(torch, "cat", refuse)
    for t in tensors.values():
        t.add_(1)
    staged = _fill(pool, tensors)
    assert all(torch.equal(staged[k], v) for k, v in tensors.items())


def test_a_known_layout_key_skips_the_signature_and_another_key_checks_it(monkeypatch):
    calls = []
    real = buffers_module._signature
    monkeypatch.setattr(buffers_module, "_signature", lambda *a: calls.append(1) or real(*a))
    tensors, key, other = _small(5), object(), object()
    pool = HostBuffers()
    for k in (key, key, key, other, None, None):
        staged = pool.prepare(tensors, k)
        pool.fill(staged, tensors)
    assert len(calls) == 4 and pool.layouts == 1  # the first, then the other key, then each without a key


def test_large_tensors_are_not_copied_in_runs():
    big = {"big": torch.randn(buffers_module.CAT_MAX_BYTES // 4 + 1), **_small(3)}
    pool = HostBuffers()
    for _ in range(3):
        staged = _fill(pool, big)
    sources = pool._sources
    assert sources is not None and sources.views[0] is None and all(v is not None for v in sources.views[1:])
    assert all(torch.equal(staged[k], v) for k, v in big.items())
