"""Every shipped ``configs/*.yaml`` trains through ``LightningCLI`` and leaves the files it promises.

Each config runs as a user would run it, with only what must be local overridden: the trainer's root, each
checkpoint callback's ``dirpath`` (and a save per step, so a few steps show the keep rules), ``max_steps``,
and a mirror's URL pointed at a bucket on the moto server on 127.0.0.1. Nothing here names an option of
``ExactResume``. Then: a nested ``retention:``/``mirror:`` group builds the callback its Python form builds,
and a bad group value is refused naming its path.
"""

from __future__ import annotations

import importlib
from argparse import ArgumentError
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import fsspec
import lightning.pytorch as lightning
import pytest
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from lightning_resume import Mirror, RetentionCheckpoint, RetentionPolicy, verify
from lightning_resume.retention.naming import rolling_name
from tests.helpers.models import TINY_TRAINER, TinyData, TinyModel
from tests.helpers.paths import REPO_ROOT

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))
STEPS = 5

pytestmark = pytest.mark.timeout(180)


def _checkpoint_callbacks(config: dict) -> list[dict]:
    """The ``init_args`` of each callback in ``config`` that is a ``ModelCheckpoint`` (or a subclass)."""
    found = []
    for entry in config["trainer"].get("callbacks", []):
        module, _, name = entry["class_path"].rpartition(".")
        if issubclass(getattr(importlib.import_module(module), name), ModelCheckpoint):
            found.append(entry.setdefault("init_args", {}))
    return found


def _localized(config: dict, tmp_path: Path, bucket: Optional[str]) -> list[dict]:
    """Point what the config keeps on disk or in a bucket at this test's places; its checkpoint callbacks."""
    config["trainer"].update(
        TINY_TRAINER, default_root_dir=str(tmp_path), max_steps=STEPS, val_check_interval=1, max_epochs=None
    )
    callbacks = _checkpoint_callbacks(config)
    for i, init in enumerate(callbacks):
        init.update(dirpath=str(tmp_path / f"ckpt{i}"), every_n_train_steps=1)
        if init.get("mirror") is not None:
            init["mirror"]["url"] = f"{bucket}/run{i}"
    return callbacks


def _newest(init: dict, n: int) -> list[str]:
    """The newest ``n`` saves. With a ``monitor``, Lightning defers step 1's save until the metric is logged,
    and the next validation does not make it (as stock ``ModelCheckpoint``): the saves are steps 2 to STEPS."""
    first = 2 if init.get("monitor") else 1
    return [rolling_name(step) for step in range(first, STEPS + 1)][-n:]


def _bucket_names(url: str) -> list[str]:
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url[len("s3://") :])) if fs.exists(url) else []


def _assert_promised(init: dict) -> None:
    """The newest ``retention.keep_last`` saves in the mirror; locally exactly the newest
    ``mirror.local_keep_last``, or at least the newest ``keep_last``; every local file verifies."""
    local = sorted(p.name for p in Path(init["dirpath"]).iterdir())
    assert local, f"{init['dirpath']} holds no checkpoint"
    assert all(verify(str(Path(init["dirpath"]) / name)) is None for name in local)
    rules, mirror = init.get("retention") or {}, init.get("mirror") or {}
    if rules.get("keep_last") is None:
        return  # no retention rule: Lightning's own names (the drop-in promise is tested on its own)
    if mirror.get("local_keep_last") is not None:
        assert local == _newest(init, mirror["local_keep_last"])
    else:
        assert set(_newest(init, rules["keep_last"])) <= set(local), local
    if mirror:
        assert set(_newest(init, rules["keep_last"])) <= set(_bucket_names(mirror["url"]))


def _cli(path: Path, *args: str, **kwargs: Any) -> LightningCLI:
    return LightningCLI(TinyModel, TinyData, args=[*args, "--config", str(path)], save_config_callback=None, **kwargs)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_trains_and_keeps_what_it_promises(path: Path, tmp_path: Path, request) -> None:
    config = yaml.safe_load(path.read_text())
    mirrored = any(init.get("mirror") for init in _checkpoint_callbacks(config))
    bucket = request.getfixturevalue("s3_bucket") if mirrored else None
    callbacks = _localized(config, tmp_path, bucket)
    assert callbacks, f"{path.name} configures no checkpoint callback"
    local = tmp_path / path.name
    local.write_text(yaml.safe_dump(config))
    lightning.seed_everything(0, verbose=False)
    run = _cli(local, "fit")
    assert run.trainer.global_step == STEPS
    for init in callbacks:
        _assert_promised(init)


def _write(tmp_path: Path, init_args: dict) -> Path:
    entry = {"class_path": "lightning_resume.RetentionCheckpoint", "init_args": init_args}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {**TINY_TRAINER, "max_steps": 1, "callbacks": [entry]}}))
    return path


def _shape(callback: RetentionCheckpoint) -> tuple:
    every = (callback._every_n_train_steps, callback._every_n_epochs)
    where = (callback.dirpath, callback.mirror_directory)
    return (callback.state_key, callback.policy, callback.tiers, callback.mirror_anchors, every, where)


def test_nested_groups_build_the_callback_the_python_form_builds(tmp_path: Path) -> None:
    base = {"dirpath": str(tmp_path / "ckpt"), "monitor": "val/loss", "mode": "max", "every_n_train_steps": 2}
    rules = {"keep_last": 3, "keep_best": 2, "anchor_every_n_steps": 10, "anchor_every": "6h"}
    mirror = {"url": str(tmp_path / "bucket"), "local_keep_last": 1, "anchors": "sync"}
    run = _cli(_write(tmp_path, {**base, "retention": rules, "mirror": mirror}), run=False)
    (built,) = [c for c in run.trainer.callbacks if isinstance(c, RetentionCheckpoint)]
    python = RetentionCheckpoint(
        **base,
        retention=RetentionPolicy(keep_last=3, keep_best=2, anchor_every_n_steps=10, anchor_every=timedelta(hours=6)),
        mirror=Mirror(str(tmp_path / "bucket"), local_keep_last=1, anchors="sync"),
    )
    assert _shape(built) == _shape(python)
    assert built.policy.mode == "max" and built.policy.anchor_every == 6 * 3600.0  # the callback's mode; seconds


BAD_GROUPS = {
    "policy values": (
        {"retention": {"keep_last": 0, "anchor_every": "soon"}},
        ["retention.keep_last=0 would delete", "retention.anchor_every='soon' is not a duration"],
    ),
    "mirror values": (
        {"retention": {"keep_last": 2}, "mirror": {"url": "s3://b/run", "local_keep_last": 0}},
        ["mirror.local_keep_last=0 would delete"],
    ),
    "an unknown option": ({"retention": {"keep_lst": 2}}, ['Parser key "retention"', "'keep_lst' is not accepted"]),
    "a value outside its type": (
        {"retention": {"keep_last": 2}, "mirror": {"url": "s3://b/run", "anchors": "later"}},
        ['Parser key "mirror"', 'Parser key "anchors"', "later"],
    ),
    "groups that disagree with the callback": (
        {"mode": "max", "retention": {"keep_best": 1, "mode": "min"}, "mirror": {"url": "s3://b/run"}},
        ["retention.mode='min' conflicts with mode='max'", "retention.keep_best=1 needs a metric; set monitor"],
    ),
}


@pytest.mark.parametrize(("init_args", "needles"), BAD_GROUPS.values(), ids=list(BAD_GROUPS))
def test_a_bad_group_value_is_refused_naming_its_path(tmp_path: Path, init_args: dict, needles: list) -> None:
    path = _write(tmp_path, {"dirpath": str(tmp_path / "ckpt"), **init_args})
    with pytest.raises((ArgumentError, ValueError)) as info:  # a ConfigurationError is a ValueError
        _cli(path, run=False, parser_kwargs={"exit_on_error": False})
    for needle in needles:
        assert needle in str(info.value), str(info.value)
