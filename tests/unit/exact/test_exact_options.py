"""ExactResume's grouped options: each group (``schedule``, ``memory_tier``, ``preemption``) written as nested
LightningCLI YAML builds the same callback as the Python form; bad values in every group are refused together,
each named by its path; the test clocks are a seam of the tests, not an option."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader

from lightning_resume import (
    ConfigurationError,
    ExactResume,
    MemoryTierOptions,
    PreemptionOptions,
    ScheduleOptions,
)
from tests.helpers.clocks import with_clocks

torch.set_num_threads(1)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(16, 4), batch_size=4)


def _from_yaml(tmp_path: Path, init_args: str) -> ExactResume:
    """The ExactResume that LightningCLI builds from ``init_args`` (YAML text, as a user writes it)."""
    config = {
        "trainer": {
            "logger": False,
            "enable_checkpointing": False,
            "callbacks": [{"class_path": "lightning_resume.ExactResume", "init_args": yaml.safe_load(init_args)}],
        }
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(Regressor, args=["--config", str(path)], run=False, save_config_callback=None)
    [exact] = [c for c in cli.trainer.callbacks if isinstance(c, ExactResume)]
    return exact


def _built(exact: ExactResume) -> dict[str, Any]:
    """What the options became: the schedule of both tiers, the memory root, signals, notices, the rest."""
    notices = exact.notices
    return {
        "schedule": exact.scheduler.config if exact.scheduler is not None else None,
        "nodes": exact._num_nodes,
        "memory": exact.memory.root if exact.memory is not None else None,
        "signals": exact.preemption.signals if exact.preemption is not None else None,
        "notices": None
        if notices is None
        else (notices.spec, notices.on_notice, notices.endpoint, notices.dmi_dir, notices.interval_s),
        "top": (exact.strict, exact.fingerprint, exact.elastic, sorted(exact.state)),
    }


CASES = {
    "schedule": (
        """
        mtbf: 24h
        schedule: {formula: daly, num_nodes: 2, min_interval: 5min, max_interval: 2h,
                   every_n_train_steps_max: 50, mtbf_prior: 10d, initial_cost: 30s, check_interval: 1s}
        strict: false
        fingerprint: false
        """,
        dict(
            mtbf="24h",
            schedule=ScheduleOptions(
                formula="daly", num_nodes=2, min_interval="5min", max_interval="2h", every_n_train_steps_max=50,
                mtbf_prior="10d", initial_cost="30s", check_interval="1s",
            ),
            strict=False,
            fingerprint=False,
        ),
    ),
    "memory_tier": (
        """
        memory_tier: {dir: /dev/shm/elsewhere, process_mtbf: 2h, every_n_train_steps_max: 4}
        elastic: keep_global_batch
        """,
        dict(
            memory_tier=MemoryTierOptions(dir="/dev/shm/elsewhere", process_mtbf="2h", every_n_train_steps_max=4),
            elastic="keep_global_batch",
        ),
    ),
    "memory_tier_defaults": ("memory_tier: {}", dict(memory_tier=MemoryTierOptions())),
    "preemption": (
        """
        mtbf: null
        preemption: {signals: [SIGUSR1], notices: [aws], on_notice: snapshot, endpoint: "http://127.0.0.1:9",
                     poll_interval: 2s, dmi_dir: /nonexistent/dmi}
        """,
        dict(
            mtbf=None,
            preemption=PreemptionOptions(
                signals=["SIGUSR1"], notices=["aws"], on_notice="snapshot", endpoint="http://127.0.0.1:9",
                poll_interval="2s", dmi_dir="/nonexistent/dmi",
            ),
        ),
    ),
    "preemption_off": ("{mtbf: null, preemption: null}", dict(mtbf=None, preemption=None)),
    "defaults": ("{}", {}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_group_from_nested_yaml_builds_the_python_form(tmp_path: Path, case: str) -> None:
    text, python = CASES[case]
    from_yaml, from_python = _from_yaml(tmp_path, text), ExactResume(**python)
    assert _built(from_yaml) == _built(from_python)
    assert _built(from_python) != _built(ExactResume(mtbf=None, preemption=None)) or case == "preemption_off"


def test_the_defaults_are_the_documented_ones() -> None:
    built = _built(ExactResume())
    config = built["schedule"]
    assert config.mtbf_mode.value == "observed" and config.mtbf_s == 30 * 86400.0  # the 30-day prior
    assert (config.min_interval_s, config.max_interval_s, config.initial_cost_s, config.check_interval_s) == (
        60.0, 6 * 3600.0, 60.0, 10.0,
    )  # fmt: skip
    assert config.every_n_train_steps_max is None and not config.takes_memory_snapshots
    assert [s.name for s in built["signals"]] == ["SIGTERM", "SIGUSR1"] and built["notices"] is None
    assert built["memory"] is None and built["top"] == (True, True, False, [])
    tier = ExactResume(memory_tier=MemoryTierOptions()).scheduler.config
    assert tier.process_mtbf_mode.value == "observed" and tier.process_mtbf_s == 3600.0  # the 1 h prior


def test_bad_values_in_every_group_are_refused_together_each_named_by_its_path() -> None:
    with pytest.raises(ConfigurationError) as err:
        ExactResume(
            mtbf="soon",
            schedule=ScheduleOptions(min_interval="-1s", max_interval="often", every_n_train_steps_max=0, num_nodes=0),
            memory_tier=MemoryTierOptions(dir="s3://bucket/shm", process_mtbf=-5, every_n_train_steps_max=0),
            preemption=PreemptionOptions(signals=["SIGNOPE"], notices=["ibm"], endpoint="ftp://x", poll_interval=0),
            elastic="sometimes",  # type: ignore[arg-type]
        )
    problems = err.value.problems
    for path in (
        "mtbf='soon'",
        "schedule.min_interval=",
        "schedule.max_interval='often'",
        "schedule.every_n_train_steps_max=0",
        "schedule.num_nodes=0",
        "memory_tier.dir='s3://bucket/shm'",
        "memory_tier.process_mtbf=-5.0s",
        "memory_tier.every_n_train_steps_max=0",
        "preemption.signals=['SIGNOPE']",
        "preemption.notices=('ibm',)",
        "preemption.endpoint='ftp://x'",
        "preemption.poll_interval=0.0s",
        "elastic='sometimes'",
    ):
        assert [p for p in problems if p.startswith(path)], (path, problems)


def test_bad_values_from_yaml_are_refused_with_their_paths(tmp_path: Path) -> None:
    text = "{schedule: {min_interval: soon}, memory_tier: {dir: 's3://b/shm'}, preemption: {notices: [ibm]}}"
    with pytest.raises(ValueError) as err:  # jsonargparse wraps the ConfigurationError, keeping its text
        _from_yaml(tmp_path, text)
    text = str(err.value)
    assert "ExactResume: invalid configuration" in text
    assert "schedule.min_interval='soon'" in text and "memory_tier.dir='s3://b/shm'" in text
    assert "preemption.notices=('ibm',)" in text


def test_mtbf_is_set_in_one_place_only(tmp_path: Path) -> None:
    """``mtbf`` is top-level; the schedule group has no second one that could disagree with it."""
    assert "mtbf" not in inspect.signature(ScheduleOptions).parameters
    with pytest.raises(SystemExit):  # jsonargparse's own refusal of an unknown key, naming it
        _from_yaml(tmp_path, "{schedule: {mtbf: 24h}}")


def test_no_test_clock_in_the_signature_and_few_options() -> None:
    params = inspect.signature(ExactResume).parameters
    assert not {"clock", "wall_clock"} & set(params)
    assert len(params) <= 10


def test_the_tests_clock_seam_drives_the_schedule() -> None:
    exact = with_clocks(ExactResume(mtbf="1h"), clock=lambda: 5.0, wall_clock=lambda: 7.0)
    assert exact.scheduler.clock() == 5.0 and exact.scheduler.wall_clock() == 7.0 and exact._wall_clock() == 7.0
    assert exact.scheduler.config == ExactResume(mtbf="1h").scheduler.config  # the options are untouched
    assert with_clocks(ExactResume(mtbf=None, preemption=None), clock=lambda: 5.0).scheduler is None


def test_each_option_reaches_what_it_configures(tmp_path: Path) -> None:
    schedule = _built(_from_yaml(tmp_path, CASES["schedule"][0]))
    config = schedule["schedule"]
    assert (config.formula.value, config.num_nodes, schedule["nodes"], config.every_n_train_steps_max) == (
        "daly",
        2,
        2,
        50,
    )
    assert (config.mtbf_s, config.min_interval_s, config.max_interval_s) == (86400.0, 300.0, 7200.0)
    assert (config.initial_cost_s, config.check_interval_s, schedule["top"][:2]) == (30.0, 1.0, (False, False))
    memory = _built(ExactResume(**CASES["memory_tier"][1]))
    assert (
        memory["memory"].startswith("/dev/shm/elsewhere/lightning-resume-") and memory["top"][2] == "keep_global_batch"
    )
    assert (memory["schedule"].process_mtbf_s, memory["schedule"].memory_every_n_train_steps_max) == (7200.0, 4)
    preemption = _built(ExactResume(**CASES["preemption"][1]))
    assert [s.name for s in preemption["signals"]] == ["SIGUSR1"]
    assert preemption["notices"] == (("aws",), "snapshot", "http://127.0.0.1:9", "/nonexistent/dmi", 2.0)
