"""The range forecast calibrated on the zoo (issue 27): real trials of a subset of the
zoo's healthy, fragile and boundary tasks, judged against the zoo's ground truth (long real
runs, ``benchmarks/zoo_truth.json``), with the rates the acceptance asks for."""

from __future__ import annotations

import pytest

from autoprec.tasks.zoo.forecast_rates import judge_task, rates, rates_table, verdicts_table
from autoprec.tasks.zoo.truth import load_table

HEALTHY = ("zoo-my-task", "zoo-sgd-mlp", "zoo-adamw-cosine")
FRAGILE = (
    "zoo-exp-growth",
    "zoo-activation-underflow",
    "zoo-linear-growth",
    "zoo-lr-warmup-growth",
)
BOUNDARY = ("zoo-einsum-boundary", "zoo-stack-boundary")
STEPS = (100, 200)  # the README's trial lengths: each one's horizon is 10x


@pytest.fixture(scope="module")
def verdicts():
    table = load_table()
    found = []
    for name in (*HEALTHY, *FRAGILE, *BOUNDARY):
        assert name in table["tasks"], f"{name}: no ground truth in the table"
        for steps in STEPS:
            found.extend(judge_task(name, steps, table))
    print(verdicts_table(found))
    print(rates_table(found))
    return found


@pytest.mark.slow
def test_no_healthy_or_boundary_trial_is_at_risk(verdicts) -> None:
    calm = [v for v in verdicts if v.kind in ("healthy", "boundary")]
    assert len({v.task for v in calm}) >= 3 + len(BOUNDARY)
    assert [v for v in calm if v.outcome == "at risk"] == []


@pytest.mark.slow
def test_fragile_trials_that_fail_within_the_horizon_are_flagged(verdicts) -> None:
    # At --steps 200, the length the truth's 10x is measured at. At --steps 100 a trial
    # sees too little of zoo-linear-growth's growth to tell it from the rest of its trend
    # (a miss, measured and said in benchmarks/README.md).
    fragile = [v for v in verdicts if v.kind == "fragile" and v.steps == 200]
    assert len({v.task for v in fragile}) >= 3
    measured = rates(fragile)
    assert measured.failing >= 3
    assert measured.recall is not None and measured.recall >= 0.9, rates_table(fragile)
    assert measured.false_alarm_rate in (None, 0.0), rates_table(fragile)


@pytest.mark.slow
def test_predicted_crossing_steps_are_within_2x_of_the_real_ones(verdicts) -> None:
    measured = rates(verdicts)
    assert measured.compared >= 2
    assert measured.crossing_within_2x is not None and measured.crossing_within_2x >= 0.8
