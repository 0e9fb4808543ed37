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
