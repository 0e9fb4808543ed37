"""The state users keep outside Lightning (``exact.state.user``): what the walk finds and leaves out, that a
capture loads with ``torch.load(weights_only=True)`` and encodes with the project's codec, that a restore puts
every kind back, and what ``ExactResume(state=...)`` refuses."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import MaxMetric, MeanMetric, MetricCollection
from torchmetrics.classification import BinaryAccuracy

from lightning_resume import ExactResume
from lightning_resume.errors import ConfigurationError
from lightning_resume.exact.state import user
from lightning_resume.format import codec


class Env:
    def __init__(self) -> None:
        self.np_random = np.random.default_rng(0)
        self.legacy = np.random.RandomState(1)
        self.py_random = random.Random(2)
        self.torch_random = torch.Generator().manual_seed(3)


class Counter:
    def __init__(self) -> None:
        self.n, self.seen = 0, np.zeros(3)

    def state_dict(self):
        return {"n": self.n, "seen": self.seen}

    def load_state_dict(self, state):
        self.n, self.seen = state["n"], state["seen"]


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)
        self.opt = torch.optim.SGD(self.parameters(), lr=0.1)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.opt, 2)
        self.given_to_lightning = torch.optim.lr_scheduler.StepLR(self.opt, 3)
        self.acc = BinaryAccuracy()
        self.collection = MetricCollection({"mean": MeanMetric(), "max": MaxMetric()})
        self.env = Env()
        self.tools = [Counter(), {"loader": DataLoader(list(range(4)))}]
        self.tools.append(self.tools)  # a cycle


def _found(module: Module, registered=None):
    return user.find({"model": module}, registered or {}, [module.given_to_lightning])


def test_the_walk_finds_each_kind_and_leaves_out_what_lightning_saves():
    module = Module()
    found = _found(module)
    kinds = {h.path: h.kind for h in found.held}
    assert kinds == {
        "model.acc": user.METRIC,
        "model.collection.mean": user.METRIC,
        "model.collection.max": user.METRIC,
        "model.lr_scheduler": user.SCHEDULER,
        "model.env.np_random": "numpy.random.Generator",
        "model.env.legacy": "numpy.random.RandomState",
        "model.env.py_random": "random.Random",
        "model.env.torch_random": "torch.Generator",
        "model.tools[0]": user.STATEFUL,
    }
    assert found.unsaved == []


def test_the_walk_is_bounded_in_depth_and_breadth():
    deep = {"a": {"b": {"c": {"d": {"e": {"rng": random.Random(0)}}}}}}
    wide = [random.Random(i) for i in range(user.MAX_ITEMS + 1)]
    found = user.find({"deep": deep, "wide": wide}, {}, [])
    assert found.held == []


def test_a_registered_object_is_held_by_its_name_and_not_again_where_the_walk_meets_it():
    module = Module()
    found = _found(module, {"env_rng": module.env.np_random})
    paths = [h.path for h in found.held]
    assert "state.env_rng" in paths and "model.env.np_random" not in paths


def test_a_capture_loads_weights_only_encodes_without_pickle_and_restores_every_kind():
    module = Module()
    found = _found(module)
    _train_a_little(module)
    captured = user.capture(found)
    buffer = io.BytesIO()
    torch.save(captured, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    encoded = codec.encode(captured)
    decoded = codec.decode(codec.parse_tree(codec.to_json(encoded.tree)), encoded.tensors)
    assert user.user_state_digests(decoded) == user.user_state_digests(captured)
    expected = user.user_state_digests(captured)
    _train_a_little(module)
    assert user.user_state_digests(user.capture(found)) != expected
    restored, unmatched = user.restore_user_state(found, loaded)
    assert unmatched == [] and sorted(restored) == sorted(found.paths)
    assert user.user_state_digests(user.capture(found)) == expected


def _train_a_little(module: Module) -> None:
    module.opt.step()
    module.lr_scheduler.step()
    module.acc.update(torch.tensor([0.9, 0.2]), torch.tensor([1, 1]))
    module.collection.update(torch.tensor([1.0, 3.0]))
    module.env.np_random.normal(size=5)
    module.env.legacy.normal(size=5)
    module.env.py_random.random()
    torch.rand(3, generator=module.env.torch_random)
    module.tools[0].n += 1
    module.tools[0].seen += 1


def test_a_restored_metric_computes_and_counts_as_the_saved_one():
    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    found = user.find({"m": {"mean": metric}}, {}, [])
    captured = user.capture(found)
    value, count = metric.compute(), metric.update_count
    metric.reset()
    user.restore_user_state(found, captured)
    assert metric.update_count == count and torch.equal(metric.compute(), value)


def test_a_metric_lightning_resets_next_is_saved_as_reset():
    metric = MeanMetric()
    metric.update(torch.tensor([5.0]))
    found = user.find({"m": [metric]}, {}, [])
    captured = user.capture(found, reset=[metric])
    metric.update(torch.tensor([7.0]))
    user.restore_user_state(found, captured)
    assert metric.update_count == 0


def test_what_cannot_be_captured_is_named_with_the_fix():
    class Holder:
        def state_dict(self):
            return {"fn": lambda: 1}

        def load_state_dict(self, state):
            pass

    found = user.find({"model": {"holder": Holder()}}, {}, [])
    assert found.held == []
    assert len(found.unsaved) == 1 and "model['holder']" in found.unsaved[0] and "state_dict()" in found.unsaved[0]


def test_a_checkpoint_without_an_object_held_now_is_reported():
    found = user.find({"m": [MeanMetric()]}, {}, [])
    restored, unmatched = user.restore_user_state(found, {"gone": {"kind": user.METRIC, "reset": True}})
    assert restored == [] and len(unmatched) == 2


def test_exact_resume_refuses_bad_registrations_naming_each():
    with pytest.raises(ConfigurationError) as err:
        ExactResume(mtbf=None, state={"opt": torch.optim.SGD([nn.Parameter(torch.zeros(1))]), "x": 3, "": Counter()})
    text = str(err.value)
    assert "state['opt']" in text and "state['x']" in text and "state key ''" in text
    assert ExactResume(mtbf=None, state={"rng": np.random.default_rng(0), "c": Counter()}).state
