"""The ``lightning-resume plan`` command and a quick run of the interval simulation (in this process; the
simulation script run as a program: tests/integration/test_schedule_sim_script.py)."""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from lightning_resume.cli.commands.plan import fmt_duration, parse_bandwidth, parse_count
from lightning_resume.cli.main import main
from lightning_resume.schedule.formulas import (
    daly_interval,
    expected_waste,
    single_level_waste,
    two_level_plan,
    young_interval,
)
from tests.helpers.paths import REPO_ROOT

ROOT = str(REPO_ROOT)


def test_plan_prints_intervals_and_the_waste_table(capsys):
    assert main(["plan", "--size", "7B", "--write-bw", "2GB/s", "--mtbf", "24h", "--nodes", "64"]) == 0
    out = capsys.readouterr().out
    # C = 7e9 * 16 B / 2e9 B/s = 56 s; M = 86400 / 64 = 1350 s; Young = sqrt(2*56*1350) = 388.8 s
    assert "C (blocking cost)    56.0 s" in out and "M (job MTBF)         22.5 min" in out
    assert "T* Young sqrt(2CM)      6.5 min" in out and "<- young" in out and "<- daly" in out
    assert f"{expected_waste(young_interval(56, 1350), 56, 1350):.2%}" in out


def test_plan_json_matches_the_policy(capsys):
    assert main(["plan", "--cost", "5min", "--mtbf", "15min", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["young_s"] == pytest.approx(young_interval(300, 900))
    assert plan["daly_s"] == pytest.approx(daly_interval(300, 900)) and plan["daly_s"] / 60 == pytest.approx(
        9.14, abs=0.01
    )
    curve = plan["curve"]
    assert min(curve, key=lambda r: r["waste"])["marks"] == ["daly"]


def test_plan_errors_are_clear(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--size", "7X", "--write-bw", "2GB/s"])
    assert info.value.code == 2 and "--size='7X'" in capsys.readouterr().err
    assert main(["plan", "--size", "7B"]) == 2
    assert "give --size and --write-bw" in capsys.readouterr().err
    assert parse_count("1.3B") == 1.3e9 and parse_count("125M") == 125e6 and parse_count("7e9") == 7e9
    assert parse_bandwidth("500 MB/s") == 5e8 and parse_bandwidth("1GiB/s") == 2**30


def test_plan_plot_without_matplotlib_says_so(tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401

        has_mpl = True
    except ImportError:
        has_mpl = False
    png = tmp_path / "waste.png"
    rc = main(["plan", "--cost", "30s", "--mtbf", "6h", "--plot", str(png)])
    if has_mpl:
        assert rc == 0 and png.stat().st_size > 0
    else:
        assert rc == 2 and not png.exists()  # a usage problem, not a failed check
        assert "needs matplotlib" in capsys.readouterr().err


def _load_sim():
    spec = importlib.util.spec_from_file_location("interval_sim", os.path.join(ROOT, "benchmarks", "interval_sim.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_simulation_agrees_with_the_model_and_ranks_policies():
    sim = _load_sim()
    c, m = 30.0, 900.0
    taus = np.array([young_interval(c, m), daly_interval(c, m), 1800.0])
    waste = sim.simulate(taus, c, m, work=50 * m, seeds=300, rng_seed=1).mean(axis=1)
    for tau, w in zip(taus, waste):  # Monte Carlo vs the exact Poisson formula
        assert w == pytest.approx(expected_waste(tau, c, m), abs=0.02)
    row = sim.run_scenario(sim.Scenario(m=m, c=c, step_time=1.0, restart=0.0, work=50 * m, seeds=100), sweep_points=40)
    assert row["young"] <= 1.05 * row["best"] and row["daly"] <= 1.05 * row["best"]
    assert row["every_30min"] > 2 * row["young"]


def test_plan_shows_both_tiers_with_a_process_mtbf(capsys):
    args = ["plan", "--cost", "20s", "--mtbf", "24h", "--process-mtbf", "1h", "--memory-cost", "0.2s"]
    assert main(args) == 0
    out = capsys.readouterr().out
    plan = two_level_plan(0.2, 20.0, 3600.0, 86400.0)
    assert "two-level: a memory snapshot every T1" in out
    assert f"T1 memory interval   {fmt_duration(plan.t1):>10}" in out
    assert f"k  durable every     {plan.k:>10}   -> T2 durable interval {fmt_duration(plan.t2)}" in out
    assert f"expected waste       {plan.waste:>10.2%}" in out
    single = single_level_waste(20.0, 3600.0, 86400.0)
    assert f"expected waste {single:.2%}" in out and f"{single / plan.waste:>9.1f}x" in out
    assert main(args[:-4] + ["--json"]) == 0 and json.loads(capsys.readouterr().out)["two_level"] is None


def test_plan_two_level_json_scales_mtbfs_by_nodes_and_derives_c1_from_bandwidth(capsys):
    args = ["plan", "--size", "1B", "--write-bw", "1GB/s", "--mtbf", "24h", "--nodes", "4"]
    assert main(args + ["--process-mtbf", "4h", "--memory-bw", "8GB/s", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)["two_level"]
    assert two["memory_cost_s"] == pytest.approx(2.0) and two["process_mtbf_s"] == 3600.0
    plan = two_level_plan(2.0, 16.0, 3600.0, 21600.0)
    assert (two["k"], two["t1_s"], two["waste"]) == (plan.k, pytest.approx(plan.t1), pytest.approx(plan.waste))
    assert main(["plan", "--cost", "20s", "--process-mtbf", "1h"]) == 2
    assert "--process-mtbf needs --memory-cost" in capsys.readouterr().err


def test_two_level_simulation_agrees_with_the_model_and_beats_single_level():
    sim = _load_sim()
    c1, c2, m1, m2 = 0.2, 10.0, 3600.0, 86400.0
    plan = two_level_plan(c1, c2, m1, m2)
    m = 1.0 / (1.0 / m1 + 1.0 / m2)
    kw = dict(c2=c2, m1=m1, m2=m2, work=30 * m, seeds=200, rng_seed=3)
    two = sim.simulate_two_level(np.array([plan.t1]), np.array([plan.k]), c1, **kw).mean(axis=1)[0]
    young = young_interval(c2, m)
    single = sim.simulate_two_level(np.array([young]), np.array([1]), 0.0, memory=False, **kw).mean(axis=1)[0]
    assert two == pytest.approx(plan.waste, rel=0.15)  # first-order model vs Monte Carlo
    assert single == pytest.approx(expected_waste(young, c2, m), rel=0.15)
    assert single / two > 2.0
    # without the memory tier surviving process failures, the same plan is far worse
    lost = sim.simulate_two_level(np.array([plan.t1]), np.array([plan.k]), c1, memory=False, **kw).mean(axis=1)[0]
    assert lost > 2 * two


def test_two_level_simulation_with_k_one_and_free_memory_is_the_single_level_simulation():
    sim = _load_sim()
    taus = np.array([300.0, 900.0])
    kw = dict(work=20 * 900.0, seeds=50, rng_seed=5)
    # all failures one class (m1 huge): the two-failure simulation reduces to the one-class one
    two = sim.simulate_two_level(taus, np.ones(2), 0.0, c2=30.0, m1=1e12, m2=900.0, memory=False, **kw)
    one = sim.simulate(taus, 30.0, 900.0, **kw)
    assert two.mean(axis=1) == pytest.approx(one.mean(axis=1), abs=0.03)
