"""Young/Daly intervals, the waste model and ScheduleConfig validation."""

import math
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.errors import ConfigurationError
from lightning_resume.schedule.config import MtbfMode, ScheduleConfig
from lightning_resume.schedule.formulas import (
    Formula,
    daly_interval,
    expected_waste,
    first_order_waste,
    optimal_interval,
    young_interval,
)

MIN, HOUR = 60.0, 3600.0

# Daly (2006), delta = 5 min: the paper's worked values.
PAPER = [(24 * HOUR, 117.0, 120.0), (6 * HOUR, 57.0, 60.0), (15 * MIN, 9.1, 12.2)]


@pytest.mark.parametrize("m, daly_min, young_min", PAPER)
def test_paper_examples(m, daly_min, young_min):
    assert young_interval(5 * MIN, m) / MIN == pytest.approx(young_min, abs=0.05)
    assert daly_interval(5 * MIN, m) / MIN == pytest.approx(daly_min, abs=0.35)


def test_daly_is_m_when_cost_exceeds_twice_m():
    assert daly_interval(200.0, 100.0) == 100.0
    assert daly_interval(10_000.0, 100.0) == 100.0
    # just below the threshold Daly's series gives 8M/9: the paper's formula jumps there
    assert daly_interval(199.999, 100.0) == pytest.approx(800 / 9, rel=1e-4)


def test_bad_inputs_are_refused():
    for bad in [(-1.0, 10.0), (1.0, 0.0), (math.nan, 1.0), (1.0, math.inf)]:
        with pytest.raises(ValueError):
            young_interval(*bad)
        with pytest.raises(ValueError):
            daly_interval(*bad)
    with pytest.raises(ValueError, match="interval t"):
        expected_waste(0.0, 1.0, 10.0)


costs = st.floats(min_value=1e-3, max_value=1e5)
mtbfs = st.floats(min_value=1.0, max_value=1e8)


@settings(max_examples=300, deadline=None)
@given(c1=costs, c2=costs, m=mtbfs, formula=st.sampled_from(Formula))
def test_interval_monotone_in_cost(c1, c2, m, formula):
    lo, hi = sorted((c1, c2))
    assert optimal_interval(lo, m, formula) <= optimal_interval(hi, m, formula) * (1 + 1e-12)


@settings(max_examples=300, deadline=None)
@given(c=costs, m1=mtbfs, m2=mtbfs, formula=st.sampled_from(Formula))
def test_interval_monotone_in_mtbf(c, m1, m2, formula):
    lo, hi = sorted((m1, m2))
    if formula is Formula.DALY and (c >= 2 * lo) != (c >= 2 * hi):
        return  # Daly's published formula is discontinuous at c = 2m (8m/9 -> m): see test above
    assert optimal_interval(c, lo, formula) <= optimal_interval(c, hi, formula) * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(c=st.floats(min_value=1e-3, max_value=1e3), ratio=st.floats(min_value=10, max_value=1e6))
def test_young_balances_the_two_waste_terms_and_minimises_first_order_waste(c, ratio):
    m = c * ratio
    t = young_interval(c, m)
    assert c / t == pytest.approx(t / (2 * m), rel=1e-9)
    assert first_order_waste(t, c, m) == pytest.approx(math.sqrt(2 * c / m), rel=1e-9)
    assert first_order_waste(t, c, m) <= min(first_order_waste(t * 1.1, c, m), first_order_waste(t / 1.1, c, m))


@settings(max_examples=200, deadline=None)
@given(c=st.floats(min_value=1e-3, max_value=1e3), ratio=st.floats(min_value=1.0, max_value=1e6))
def test_daly_is_near_the_exact_optimum_of_the_poisson_model(c, ratio):
    m = c * ratio
    t = daly_interval(c, m)
    best = min(expected_waste(t * f, c, m) for f in (0.5, 0.7, 0.85, 1.0, 1.15, 1.4, 2.0))
    assert expected_waste(t, c, m) <= best + 5e-3


def test_exact_waste_tends_to_first_order_for_small_cost():
    c, m = 1.0, 1e6
    t = young_interval(c, m)
    assert expected_waste(t, c, m) == pytest.approx(first_order_waste(t, c, m), rel=0.01)
    assert expected_waste(1e9, c, m) == 1.0  # a segment far longer than M never completes


def test_config_collects_every_problem():
    with pytest.raises(ConfigurationError) as info:
        ScheduleConfig(
            mtbf_s=-1.0,
            num_nodes=0,
            formula="bogus",
            min_interval_s=10.0,
            max_interval_s=5.0,
            every_n_train_steps_max=0,
            initial_cost_s=0.0,
            check_interval_s=0.0,
        )
    text = str(info.value)
    for name in (
        "formula='bogus'",
        "mtbf=-1.0s",
        "num_nodes=0",
        "max_interval=5.0s",
        "every_n_train_steps_max=0",
        "initial_cost=0.0s",
        "check_interval=0.0s",
    ):
        assert name in text
    assert len(info.value.problems) == 7


def test_from_user_parses_durations_and_reports_bad_ones_with_the_rest():
    cfg = ScheduleConfig.from_user(
        mtbf="24h",
        num_nodes=64,
        formula="daly",
        min_interval=timedelta(minutes=2),
        max_interval="1h",
        every_n_train_steps_max=5000,
    )
    assert cfg.job_mtbf_s == pytest.approx(86400 / 64)
    assert cfg.formula is Formula.DALY and cfg.min_interval_s == 120.0 and cfg.max_interval_s == 3600.0
    assert cfg.with_nodes(8).job_mtbf_s == pytest.approx(86400 / 8)
    with pytest.raises(ConfigurationError) as info:
        ScheduleConfig.from_user(mtbf="soon", num_nodes=0, min_interval="2h", max_interval="1h")
    text = str(info.value)
    assert "mtbf='soon'" in text and "num_nodes=0" in text and "max_interval" in text


def test_observed_mode_needs_a_prior():
    cfg = ScheduleConfig.from_user(mtbf="observed", mtbf_prior="12h", num_nodes=2)
    assert cfg.mtbf_mode is MtbfMode.OBSERVED and cfg.job_mtbf_s == 6 * HOUR
    with pytest.raises(ConfigurationError, match="mtbf_prior"):
        ScheduleConfig.from_user(mtbf="observed")
    assert ScheduleConfig.from_user(mtbf=None).job_mtbf_s is None
