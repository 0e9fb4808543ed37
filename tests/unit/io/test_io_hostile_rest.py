"""Issue 15 items 10 and 11 (readers and the encoder): each test is the attack, and asserts the documented
error (a ``LightningResumeError`` naming the file or key path) or that the odd input is passed over."""

from __future__ import annotations

import argparse
import os
import threading
import warnings

import pytest
import torch

from lightning_resume.cli.main import main
from lightning_resume.errors import CheckpointCorruptError, TreeFormatError, UnencodableValueError
from lightning_resume.format import codec, framing
from lightning_resume.format.read import load_file
from lightning_resume.format.write import save_file
from lightning_resume.io.resolve import newest_verified
from lightning_resume.io.verify import verify


class _BadNamespace:
    def __reduce__(self):
        return (argparse.Namespace, (1,))  # an allowlisted class, called with arguments it does not take


def test_legacy_pickle_calling_an_allowed_class_with_bad_arguments_is_corrupt_naming_the_file(tmp_path, capsys):
    path = tmp_path / "odd.ckpt"
    torch.save({"state_dict": {}, "hparams": _BadNamespace()}, str(path))
    with pytest.raises(CheckpointCorruptError, match="odd.ckpt"):
        load_file(str(path))
    assert main(["convert", str(path), str(tmp_path / "out.ckpt")]) == 1
    assert "odd.ckpt" in capsys.readouterr().err


def test_last_fallback_skips_a_sibling_whose_reader_fails_with_any_exception(tmp_path):
    paths = {"a.ckpt": 1.0, "b.ckpt": 2.0}

    def check(path: str) -> None:
        if path == "b.ckpt":
            raise TypeError("a reader bug a crafted file triggers")

    skipped: list = []
    assert newest_verified(list(paths), check, key=paths.get, skipped=skipped.append) == "a.ckpt"
    assert "b.ckpt" in skipped[0] and "TypeError" in skipped[0]


def _in_thread(fn, timeout: float = 20.0):
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as err:
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "hung on a FIFO named *.ckpt"
    return out


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_ckpt_is_refused_without_opening_it(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "good.ckpt"))
    fifo = tmp_path / "step=000000009.ckpt"
    os.mkfifo(fifo)
    out = _in_thread(lambda: verify(str(fifo)))
    assert isinstance(out.get("error"), CheckpointCorruptError) and "FIFO" in str(out["error"])
    out = _in_thread(lambda: load_file(str(fifo)))
    assert isinstance(out.get("error"), CheckpointCorruptError)
    out = _in_thread(lambda: main(["verify", str(tmp_path)]))
    assert out.get("value") == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _in_thread(lambda: newest_verified([str(fifo), str(tmp_path / "good.ckpt")], key=lambda p: p))
    assert out.get("value") == str(tmp_path / "good.ckpt")


def test_a_200_deep_dict_fails_the_save_naming_the_key_path_and_writes_nothing(tmp_path):
    deep: dict = {}
    node = deep
    for _ in range(200):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(UnencodableValueError, match=r"'x\.a\.a") as info:
        save_file({"x": deep}, str(tmp_path / "deep.ckpt"))
    assert "recursion" in str(info.value)
    assert not os.listdir(tmp_path)


def test_a_container_deeper_than_max_depth_fails_the_save(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "MAX_DEPTH", 5)
    with pytest.raises(UnencodableValueError, match="MAX_DEPTH"):
        save_file({"x": [[[[[[[1]]]]]]]}, str(tmp_path / "deep.ckpt"))


def test_a_5000_digit_int_fails_the_save_naming_the_key_path(tmp_path):
    with pytest.raises(UnencodableValueError, match=r"'x\.1'"):
        save_file({"x": [1, 10**5000]}, str(tmp_path / "big.ckpt"))
    assert not os.listdir(tmp_path)


def test_a_size_with_a_huge_dimension_is_malformed():
    with pytest.raises(TreeFormatError, match="torch.Size"):
        codec.decode({"@": "size", "v": [2**100]}, {})
    with pytest.raises(TreeFormatError):
        codec.decode({"@": "size", "v": [-1]}, {})
    assert codec.decode({"@": "size", "v": [2, 3]}, {}) == torch.Size([2, 3])


def test_a_dtype_node_never_runs_torch_module_getattr(monkeypatch):
    calls: list = []

    def spy(name: str):
        calls.append(name)
        raise AttributeError(name)

    monkeypatch.setattr(torch, "__getattr__", spy, raising=False)
    for name in ("has_cuda", "has_mps", "no_such_dtype", "Tensor", "__getattr__"):
        with pytest.raises(TreeFormatError, match="unknown torch dtype"):
            codec.decode({"@": "dtype", "v": name}, {})
    assert calls == []
    assert codec.decode({"@": "dtype", "v": "bfloat16"}, {}) is torch.bfloat16


def test_duplicate_json_keys_are_refused_in_the_tree_the_header_and_the_integrity_record(tmp_path):
    with pytest.raises(TreeFormatError, match="more than once"):
        codec.parse_tree('{"@": "dict", "v": {"a": 1, "a": 2}}')
    raw = b'{"__metadata__":{"a":"1"},"__metadata__":{"a":"2"}}'
    prefix = len(raw).to_bytes(8, "little") + raw
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        framing.parse_header("f.ckpt", prefix, len(prefix))
    from lightning_resume.format.integrity import parse_record

    with pytest.raises(CheckpointCorruptError):
        parse_record("f.ckpt", '{"version": 1, "version": 1}')
