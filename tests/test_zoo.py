"""The task zoo: its registry, its tasks (each builds and trains a few real steps) and
its ground-truth table (benchmarks/zoo_truth.json), which must cover every task and agree
with each task's kind."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from autoprec.errors import TaskError
from autoprec.policy import Policy
from autoprec.tasks import load_task
from autoprec.tasks.zoo import ZOO, Kind, ZooEntry, entries
from autoprec.tasks.zoo.calibration import random_mixed_policies
from autoprec.tasks.zoo.truth import (
    ACCURACY_TOLERANCE,
    NUDGES,
    TRIAL_STEPS,
    TRUTH_STEPS,
    RunTruth,
    cpu_kind,
    load_table,
    long_run,
    measure_entry,
    nudge_weights,
    table_path,
)


def test_the_registry_holds_at_least_24_tasks_of_the_three_kinds():
    assert len(ZOO) >= 24
    assert len(entries(Kind.HEALTHY)) >= 12
    assert len(entries(Kind.FRAGILE)) >= 10
    assert len(entries(Kind.BOUNDARY)) >= 2
    assert all(isinstance(e, ZooEntry) and e.name == n for n, e in ZOO.items())
    for entry in entries(Kind.FRAGILE):
        assert entry.failing_groups and entry.fails_in and entry.side in ("overflow", "underflow")
    assert {e.side for e in entries(Kind.FRAGILE)} == {"overflow", "underflow"}
    # each fragile task is a distinct mechanism
    assert len({e.mechanism for e in entries(Kind.FRAGILE)}) == len(entries(Kind.FRAGILE))


@pytest.mark.parametrize("name", list(ZOO))
def test_every_zoo_task_builds_trains_and_states_its_mechanism(name):
    entry = ZOO[name]
    doc = entry.factory.__doc__ or ""
    assert len(doc.split()) >= 5, f"{name}: its factory's docstring must state the mechanism"
    assert entry.mechanism
    task = load_task(name)  # the name the command line takes
    assert task.name.endswith(name.removeprefix("zoo-"))
    truth, _ = long_run(task, Policy.uniform("fp32"), seed=0, steps=3)
    assert truth.crashed is None
    assert truth.steps_run == 3 and truth.failure_step is None
    assert truth.final_metric is not None


def test_an_unknown_zoo_name_is_refused_in_one_line():
    with pytest.raises(TaskError, match="zoo task"):
        load_task("zoo-no-such-task")


def test_random_mixed_policies_are_fixed_by_the_task_and_cover_every_leaf():
    entry = ZOO["zoo-cat-boundary"]
    first, again = random_mixed_policies(entry, 5), random_mixed_policies(entry, 5)
    assert [p.to_dict() for p in first] == [p.to_dict() for p in again]
    model = entry.task().model()
    resolved = first[0].resolve(model)
    assert set(resolved.values()) <= {"fp16", "bf16"}
    assert len({tuple(p.resolve(model).values()) for p in first}) > 1


@pytest.fixture(scope="module")
def table():
    if not table_path().is_file():
        pytest.fail(f"{table_path()} is missing: python benchmarks/bench_zoo.py --ground-truth")
    return load_table()


def test_the_truth_table_covers_every_zoo_task(table):
    assert table["steps"] == TRUTH_STEPS == 10 * TRIAL_STEPS
    missing = [n for n in ZOO if n not in table["tasks"]]
    assert not missing, f"not measured: {missing}"
    for name, row in table["tasks"].items():
        assert row["kind"] == ZOO[name].kind.value
        assert {"fp32", "fp16", "bf16"} <= set(row["runs"])
        assert row["runs"]["fp32"][0]["failure_step"] is None, f"{name}: fp32 failed"


def test_every_truth_row_names_the_kind_of_cpu_that_measured_it(table):
    """fp16's kernels differ with and without avx512_fp16 or AMX: each row says which
    kind of CPU measured it."""
    assert all(row.get("cpu") for row in table["tasks"].values())
    row = measure_entry(ZOO["zoo-sgd-mlp"], steps=3)
    assert row["cpu"] == cpu_kind() and row["steps"] == 3


@pytest.mark.parametrize("name", [e.name for e in entries(Kind.FRAGILE)])
def test_a_fragile_task_fails_in_fp16_within_the_window_and_not_with_its_group_in_fp32(table, name):
    row = table["tasks"].get(name)
    if row is None:
        pytest.fail(f"{name} is not in the truth table")
    fp16 = row["runs"]["fp16"]
    assert len(fp16) >= 2, "fragile tasks are measured over several seeds"
    for run in fp16:
        step = run["failure_step"]
        assert step is not None, f"{name} seed {run['seed']}: fp16 did not fail"
        assert 2 * TRIAL_STEPS <= step <= TRUTH_STEPS, f"{name}: fails at {step}"
    bf16 = row["runs"]["bf16"][0]["failure_step"]
    if "bf16" in ZOO[name].fails_in:  # its precision fails too, in the same window
        assert bf16 is not None and 2 * TRIAL_STEPS <= bf16 <= TRUTH_STEPS
    else:
        assert bf16 is None, f"{name}: bf16 fails at {bf16}"
    kept = row["runs"]["fp16+group-fp32"][0]
    assert kept["failure_step"] is None, f"{name}: fails with its group in fp32"


@pytest.mark.parametrize("name", [e.name for e in entries(Kind.HEALTHY)])
def test_a_healthy_task_trains_in_fp16_and_bf16_as_fp32_does(table, name):
    row = table["tasks"].get(name)
    if row is None:
        pytest.fail(f"{name} is not in the truth table")
    for label in ("fp16", "bf16"):
        run = row["runs"][label][0]
        if run["crashed"]:  # a crash is the casts' defect, recorded; not a late failure
            assert run["failure_step"] == 0
            continue
        assert run["failure_step"] is None, f"{name} {label}: fails at {run['failure_step']}"
        assert run["metric_drop"] <= ACCURACY_TOLERANCE


@pytest.mark.parametrize("name", [e.name for e in entries(Kind.BOUNDARY)])
def test_a_boundary_task_trains_uniformly_and_records_its_mixed_policies(table, name):
    row = table["tasks"].get(name)
    if row is None:
        pytest.fail(f"{name} is not in the truth table")
    for label in ("fp16", "bf16"):
        assert row["runs"][label][0]["failure_step"] is None
    assert any("boundary" in label for label in row["runs"])


def test_a_nudge_moves_about_half_of_every_weight_by_one_ulp_and_nothing_more():
    model = ZOO["zoo-sgd-mlp"].task().model()
    again = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    nudge_weights(model, 1)
    moved_shares = []
    for old, new in zip(before, model.parameters(), strict=True):
        up = torch.nextafter(old, torch.full_like(old, math.inf))
        down = torch.nextafter(old, torch.full_like(old, -math.inf))
        assert bool(((new == old) | (new == up) | (new == down)).all())
        moved_shares.append(float((new != old).float().mean()))
    weight_share = moved_shares[0]  # the first Linear's 4096 weights
    assert 0.45 < weight_share < 0.55
    nudge_weights(again, 1)  # the same seed moves the same elements the same way
    assert all(
        torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(), strict=True)
    )


def test_a_metric_collapse_is_a_failure_unless_fp32_moved_one_ulp_collapses_too():
    collapsed = RunTruth("uniform-bf16", 0, 2000, metric_collapse_step=1100)
    assert collapsed.failure_step == 1100
    chance = RunTruth("uniform-bf16", 0, 2000, metric_collapse_step=1100, fp32_chaotic=True)
    assert chance.failure_step is None
    # the range events stay failures on a chaotic task
    overflow = RunTruth(
        "uniform-fp16",
        0,
        2000,
        first_nonfinite_loss_step=958,
        metric_collapse_step=900,
        fp32_chaotic=True,
    )
    assert overflow.failure_step == 958


def test_a_table_row_marked_chaotic_is_read_with_its_metric_collapses_set_aside(tmp_path):
    run = RunTruth("uniform-bf16", 0, 2000, metric_collapse_step=1100).to_dict()
    reference = RunTruth("uniform-fp32", 0, 2000).to_dict()
    row = {"kind": "fragile", "runs": {"fp32": [reference], "bf16": [run]}}
    for chaotic, expected in ((False, 1100), (True, None)):
        path = tmp_path / f"table-{chaotic}.json"
        table = {"version": 1, "steps": 2000, "tasks": {"t": {**row, "fp32_chaotic": chaotic}}}
        path.write_text(json.dumps(table))
        assert load_table(path)["tasks"]["t"]["runs"]["bf16"][0]["failure_step"] == expected


def test_every_truth_row_trains_fp32_again_from_weights_moved_one_ulp(table):
    """fp32's own chaos is measured for every task: a training whose metric moves by the
    collapse rule under one rounding of its initial weights cannot attribute a metric
    collapse to precision."""
    for name, row in table["tasks"].items():
        nudged = row.get("fp32_nudged")
        assert nudged is not None and len(nudged) == len(NUDGES), f"{name}: not measured"
        assert all(r["crashed"] is None and r["steps_run"] == TRUTH_STEPS for r in nudged)
        assert row["fp32_chaotic"] == any(r["metric_collapse_step"] is not None for r in nudged)
    # Measured: one rounding of the initial weights collapses this one's metric in fp32.
    assert table["tasks"]["zoo-attention-logit-growth"]["fp32_chaotic"]


def test_the_ground_truth_run_sees_a_layer_go_non_finite():
    """The watch is real: a fragile task pushed past fp16's range in a short run shows
    the non-finite output of the layer that overflowed, and the fp32 run does not."""
    task = ZOO["zoo-exp-growth"].task()
    torch.manual_seed(0)
    model_unit = task.model().head.unit
    assert model_unit > 1
    reference_truth, reference = long_run(task, Policy.uniform("fp32"), steps=20)
    assert reference_truth.failure_step is None
    from autoprec.tasks.zoo import fragile

    original = fragile.GAIN_UNITS["exponential"]
    fragile.GAIN_UNITS["exponential"] = 2.0**20  # 16 times past fp16's largest at once
    try:
        truth, _ = long_run(
            ZOO["zoo-exp-growth"].task(), Policy.uniform("fp16"), steps=20, reference=reference
        )
    finally:
        fragile.GAIN_UNITS["exponential"] = original
    assert truth.first_nonfinite_output_layer == "head"
    assert truth.failure_step == 0


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_an_lstm_trial_trains_or_is_refused_before_training_never_crashes(dtype):
    """oneDNN's LSTM on the CPU has no kernel for fp32 inputs and low-precision weights
    (and, on some CPUs, none in fp16 at all). A trial watches its layers on a real batch
    first: it casts the LSTM's inputs where the kernel runs on cast ones, and a dtype the
    kernel cannot run at all is refused before training, naming the layer and the
    kernel's reason. Whatever the instruction set, the trial never fails inside it."""
    from autoprec.devices import get_backend
    from autoprec.errors import PolicyError
    from autoprec.trials.training import Budget, run_trial

    task = ZOO["zoo-lstm"].task()
    try:
        result = run_trial(task, Policy.uniform(dtype), get_backend("cpu"), Budget(steps=8))
    except PolicyError as error:
        assert "rnn (LSTM): cannot run in" in str(error)
        return
    assert result.state == "complete", result.reason
    assert result.accuracy is not None
