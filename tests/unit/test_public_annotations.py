"""Issue 15.12: configurable public classes expose real annotation objects, not strings.

Tools that build parsers from a signature (``jsonargparse.ArgumentParser.add_argument(type=annot)``,
as Lightning's own tests do for ``ModelCheckpoint.save_last``) fail on postponed (string) annotations.
ExactResume is checked by its owners (exact/callback.py).
"""

import inspect

import pytest
from jsonargparse import ArgumentParser

import lightning_resume

CONFIGURABLE = [
    "ExactResume",
    "ScheduleOptions",
    "MemoryTierOptions",
    "PreemptionOptions",
    "RetentionCheckpoint",
    "RetentionPolicy",
    "Mirror",
    "SafetensorsCheckpointIO",
    "ActivationCheckpointingStrategy",
    "ActivationCheckpointingDDPStrategy",
    "ActivationCheckpointingFSDPStrategy",
    "ShardedCheckpointIO",
    "ShardedModelParallelStrategy",
]


@pytest.mark.parametrize("name", CONFIGURABLE)
def test_every_parameter_annotation_is_a_real_object(name):
    params = inspect.signature(getattr(lightning_resume, name)).parameters
    strings = {p: v.annotation for p, v in params.items() if isinstance(v.annotation, str)}
    assert strings == {}


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("false", False), ("link", "link")])
def test_save_last_annotation_builds_a_parser_as_in_lightnings_tests(value, expected):
    annotation = inspect.signature(lightning_resume.RetentionCheckpoint).parameters["save_last"].annotation
    parser = ArgumentParser()
    parser.add_argument("--a", type=annotation)
    assert parser.parse_args(["--a", value]).a == expected


@pytest.mark.parametrize("name", CONFIGURABLE)
def test_every_parameter_builds_a_parser_argument(name):
    params = inspect.signature(getattr(lightning_resume, name)).parameters
    parser = ArgumentParser()
    for param in params.values():
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL) or param.annotation is param.empty:
            continue
        parser.add_argument(f"--{param.name}", type=param.annotation)
