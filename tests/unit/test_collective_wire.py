"""What the object collectives send: tensors as raw bytes, so gathering a rank's state never calls ``torch.save``
(pickling a tensor does, through its storage; Lightning's own tests count ``torch.save`` calls per rank)."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import torch

from lightning_resume.collective import _from_wire, _to_wire


def test_tensors_travel_as_bytes_and_come_back_equal(monkeypatch):
    calls = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: calls.append(1) or real(*a, **k))
    state = {
        "rng": {"torch": torch.get_rng_state(), "cuda": [torch.arange(4, dtype=torch.uint8)]},
        "metrics": OrderedDict(loss=torch.tensor(0.25), bf=torch.ones(2, 3, dtype=torch.bfloat16)),
        "empty": torch.empty(0, 4),
        "plain": (1, "x", None),
    }
    sent = pickle.dumps(_to_wire(state))
    assert calls == []
    back = _from_wire(pickle.loads(sent))
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"]) and back["plain"] == (1, "x", None)
    assert torch.equal(back["metrics"]["bf"], state["metrics"]["bf"]) and back["metrics"]["bf"].dtype == torch.bfloat16
    assert back["empty"].shape == (0, 4) and isinstance(back["metrics"], OrderedDict)
