"""``lightning-resume plan`` with replicas: the three-level plan printed (text, JSON, plot) beside the
two-level one, from the same pure functions the schedule uses."""

import json

import pytest

from lightning_resume.cli.commands.plan import fmt_duration
from lightning_resume.cli.main import main
from lightning_resume.schedule.formulas import Levels, three_level_plan, two_level_plan
from lightning_resume.schedule.state import REPLICA_STEP_OVERHEAD

DAY = 86400.0
# the Llama 3 mix on 2,048 nodes (per node: M2 = 2048 x 54 d / 356 ~ 310 d, M1 = 2048 x 54 d / 63 ~ 1755 d)
ARGS = ["plan", "--cost", "60s", "--mtbf", "310d", "--nodes", "2048", "--process-mtbf", "1755d"]
ARGS += ["--memory-cost", "1s", "--replica-time", "10s", "--job-loss-mtbf", "54d"]
LEVELS = Levels(
    c1=1.0, c2=REPLICA_STEP_OVERHEAD * 10.0, d2=10.0, c3=60.0, m1=1755 * DAY / 2048, m2=310 * DAY / 2048, m3=54 * DAY
)


def test_plan_prints_the_three_levels_against_two(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    plan, two = three_level_plan(LEVELS), two_level_plan(*LEVELS.without_replicas())
    assert plan.replicate and two.waste / plan.waste > 2
    assert "three-level: a memory snapshot every T1, sent to a peer node, every k-th one durable" in out
    assert f"D2 (replica transfer){fmt_duration(10.0):>10}   C2 (its cost to training, 3% of D2) 0.30 s" in out
    assert f"M2 node loss         {fmt_duration(LEVELS.m2):>10}   -> newest replica (peer node)" in out
    assert f"M3 whole-job loss    {fmt_duration(54 * DAY):>10}   -> newest durable save" in out
    assert "replicate            every memory snapshot" in out
    # the three-level section follows the two-level one: the last "T1 memory interval" line is the plan's
    assert out.rsplit("T1 memory interval   ", 1)[1].startswith(f"{fmt_duration(plan.t1):>10}")
    assert f"k  durable every     {plan.k:>10}   -> T3 durable interval {fmt_duration(plan.t2)}" in out
    assert f"expected waste       {plan.waste:>10.2%}" in out
    assert f"k {two.k}, expected waste {two.waste:.2%}  (no replicas: node and job losses back to disk)" in out
    assert f"replicas save        {two.waste / plan.waste:>9.1f}x" in out


def test_plan_three_level_json_and_when_replicas_do_not_pay(capsys):
    assert main([*ARGS, "--json"]) == 0
    three = json.loads(capsys.readouterr().out)["three_level"]
    plan = three_level_plan(LEVELS)
    assert (three["replicate"], three["k"]) == (True, plan.k)
    assert three["t1_s"] == pytest.approx(plan.t1) and three["waste"] == pytest.approx(plan.waste)
    assert three["job_loss_mtbf_s"] == 54 * DAY and three["replica_cost_s"] == pytest.approx(0.3)
    # a transfer slower than any sensible interval: no replicas, the plan is the two-level one
    slow = [a if a != "10s" else "30d" for a in ARGS]
    assert main([*slow, "--json"]) == 0
    three = json.loads(capsys.readouterr().out)["three_level"]
    assert three["replicate"] is False and three["waste"] == pytest.approx(three["two_level_waste"])
    assert main([*slow]) == 0
    assert "replicate            none: replicas do not pay here" in capsys.readouterr().out


def test_plan_three_level_needs_the_memory_tier(capsys):
    assert main(["plan", "--cost", "20s", "--replica-time", "5s"]) == 2
    assert "--replica-time needs --process-mtbf" in capsys.readouterr().err
    assert main(["plan", "--cost", "20s", "--process-mtbf", "1h", "--memory-cost", "1s"]) == 0
    assert "three-level" not in capsys.readouterr().out  # no replica time: two levels, as before


def test_plan_plot_draws_the_levels(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "waste.png"
    assert main([*ARGS, "--plot", str(png)]) == 0
    from matplotlib import image

    assert image.imread(str(png)).shape[1] > 1200  # two panels side by side (12 in at 120 dpi)


def _load_sim():
    import importlib.util
    import os
    import sys

    from tests.helpers.paths import REPO_ROOT

    path = os.path.join(str(REPO_ROOT), "benchmarks", "interval_sim.py")
    spec = importlib.util.spec_from_file_location("interval_sim", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_three_level_simulation_agrees_with_the_model_and_beats_two_level():
    sim = _load_sim()
    m1, m2, m3 = sim.MIXES["llama3"]
    lv = Levels(c1=1.0, c2=REPLICA_STEP_OVERHEAD * 10.0, d2=10.0, c3=60.0, m1=m1, m2=m2, m3=m3)
    r = sim.run_three_level(lv, step_time=1.0, work=20 / (1 / m1 + 1 / m2 + 1 / m3), seeds=60, rng_seed=4)
    assert r["plan"] == pytest.approx(r["plan_model"], rel=0.15)  # first-order model vs Monte Carlo
    assert r["two"] == pytest.approx(r["two_model"], rel=0.15)
    assert r["two"] / r["plan"] > 2.0
    assert r["plan"] <= r["best"] * 1.1  # the plan is near the best swept replicating (T1, k)


def test_a_node_lost_while_its_replica_is_in_flight_goes_to_disk():
    sim = _load_sim()
    # node losses only (M1, M3 huge); a transfer longer than an interval and a durable save: none lands in time
    lv = Levels(c1=0.0, c2=0.0, d2=111.0, c3=10.0, m1=1e12, m2=3600.0, m3=1e12)
    kw = dict(levels=lv, work=20 * 3600.0, seeds=40, rng_seed=2)
    late = sim.simulate_three_level([100.0], [10], [True], **kw).mean()
    off = sim.simulate_three_level([100.0], [10], [False], **kw).mean()
    assert late == pytest.approx(off)  # exactly the same failures, the same rollbacks
    early = sim.simulate_three_level([100.0], [10], [True], **{**kw, "levels": Levels(**{**vars(lv), "d2": 1.0})})
    assert early.mean() < off / 2
