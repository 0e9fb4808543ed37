"""A hostile DCP checkpoint is refused before its pickle payload can run (metadata and non-tensor values)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from lightning_resume import load_full, load_sharded, save_sharded
from lightning_resume.errors import UnsafeCheckpointError
from lightning_resume.sharded.commit import commit
from lightning_resume.sharded.marker import CommitRecord, digest_files
from lightning_resume.sharded.safe_pickle import load_metadata

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Payload:
    """Unpickling this with plain pickle creates ``path``: the proof a loader ran attacker code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('pwned')",)


def _good_checkpoint(directory) -> str:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}
    return save_sharded(state, str(directory), step=1)


def _recommit(directory: str) -> None:
    """An attacker can rewrite the marker too: digests prove integrity, not origin."""
    names = [n for n in os.listdir(directory) if n not in ("COMMITTED",)]
    commit(CommitRecord(directory, 1, 1, digest_files(directory, names)))


def test_real_metadata_uses_only_allowlisted_classes(tmp_path):
    directory = _good_checkpoint(tmp_path / "ck")
    metadata = load_metadata(os.path.join(directory, ".metadata"))
    assert set(metadata.state_dict_metadata) == {"model.w", "opt.lr", "opt.betas"}


def test_metadata_with_reduce_payload_is_refused_and_never_runs(tmp_path):
    directory = _good_checkpoint(tmp_path / "ck")
    metadata = load_metadata(os.path.join(directory, ".metadata"))
    marker = tmp_path / "pwned"
    metadata.planner_data = Payload(str(marker))
    hostile = pickle.dumps(metadata)
    pickle.loads(hostile)  # control: plain pickle (what DCP's FileSystemReader does) runs the payload
    assert marker.exists()
    marker.unlink()
    with open(os.path.join(directory, ".metadata"), "wb") as handle:
        handle.write(hostile)
    _recommit(directory)
    template = {"model": {"w": torch.zeros(2, 3)}, "opt": {"lr": 0.0, "betas": (0.0, 0.0)}}
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.exec"):
        load_sharded(template, directory)
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.exec"):
        load_full(directory)
    assert not marker.exists()


def test_dotted_global_reaching_a_method_of_an_allowed_class_is_refused(tmp_path):
    # protocol 4 STACK_GLOBAL "pathlib" "PosixPath.touch": find_class would resolve the dotted name
    path = tmp_path / "touched"
    hostile = (
        b"\x80\x04\x8c\x07pathlib\x94\x8c\x0fPosixPath.touch\x94\x93\x94"
        + pickle.dumps(str(path), protocol=4)[2:-1]
        + b"\x85R."
    )
    (tmp_path / ".metadata").write_bytes(hostile)
    with pytest.raises(UnsafeCheckpointError, match="PosixPath.touch"):
        load_metadata(str(tmp_path / ".metadata"))
    assert not path.exists()


def test_non_tensor_value_with_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    directory = save_sharded({"w": torch.ones(2), "extra": Payload(str(marker))}, str(tmp_path / "ck"), step=1)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="extra"):
        load_full(directory)
    with pytest.raises(UnsafeCheckpointError, match="extra"):
        load_sharded({"w": torch.zeros(2), "extra": None}, directory)
    assert not marker.exists()


def test_garbage_metadata_is_refused_with_its_path(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x05not a pickle")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
        load_metadata(str(tmp_path / ".metadata"))
