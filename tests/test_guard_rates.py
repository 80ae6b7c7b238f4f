"""The guard judged on the zoo (`autoprec.tasks.zoo.guard_rates`): one real guarded run of a
fragile task end to end, and the judgement's rules on plain changes."""

from __future__ import annotations

import torch

from autoprec.guard.changes import PROMOTE, ROLLBACK, Change
from autoprec.tasks.zoo import ZOO
from autoprec.tasks.zoo.guard_rates import (
    GuardedRun,
    change_side,
    guarded_run,
    judge,
    names_failing_layer,
    rates,
)
from autoprec.tasks.zoo.truth import load_table


def test_a_guarded_fragile_run_trains_as_fp32_and_names_the_failing_layer() -> None:
    torch.set_num_threads(1)
    entry = ZOO["zoo-exp-growth"]
    run = guarded_run(entry, "fp16")
    verdict = judge(run, entry, load_table()["tasks"][entry.name])

    assert run.crashed is None and run.weights_finite
    assert run.changes and all(c.layer == "head" for c in run.changes)
    assert verdict.caught, verdict.why_missed
    assert run.snapshot_bytes > 0


def _change(action: str, layer: str, reason: str) -> Change:
    return Change(100, action, layer, (layer,), "fp16", "bf16", reason)


def test_the_side_of_a_change_comes_from_its_reason() -> None:
    assert change_side(_change(PROMOTE, "head", "overflow projected at step ~900")) == "overflow"
    assert change_side(_change(PROMOTE, "x", "underflow projected at step ~900")) == "underflow"
    assert change_side(_change(PROMOTE, "head", "largest |output| 9000 is 2.9 bits")) == "overflow"
    flush = "its fp8 cast flushes 1.3% of its nonzero output gradients to zero in e5m2"
    assert change_side(_change(PROMOTE, "fc", flush)) == "underflow"
    forward = "the loss was not finite: the forward overflowed, which loss scaling cannot help"
    assert change_side(_change(ROLLBACK, "head", forward)) == "overflow"
    floor = "gradients were not finite at the loss scale's floor (1)"
    assert change_side(_change(ROLLBACK, "kernel", floor)) == "underflow"


def test_a_layer_is_right_at_or_below_a_failing_group_or_where_the_truth_saw_it() -> None:
    entry = ZOO["zoo-residual-growth"]  # failing groups: blocks, embed, head
    assert names_failing_layer(_change(PROMOTE, "blocks.1.fc", ""), entry, {})
    assert not names_failing_layer(_change(PROMOTE, "blocksX", ""), entry, {})
    seen = {"first_nonfinite_output_layer": "norm"}
    assert names_failing_layer(_change(PROMOTE, "norm", ""), entry, seen)


def test_any_change_on_a_healthy_task_is_a_false_alarm() -> None:
    entry = ZOO["zoo-sgd-mlp"]
    row = {"runs": {"fp32": [{"final_metric": 0.975}], "fp16": [{}]}}
    quiet = GuardedRun(entry.name, "healthy", "fp16", 2000, 0, final_metric=0.97)
    alarmed = GuardedRun(
        entry.name,
        "healthy",
        "fp16",
        2000,
        0,
        final_metric=0.97,
        changes=(_change(PROMOTE, "fc", ""),),
    )
    verdicts = [judge(quiet, entry, row), judge(alarmed, entry, row)]

    assert [v.false_alarm for v in verdicts] == [False, True]
    assert "| healthy fp16 | 2 | 1/2 (50%) | - | zoo-sgd-mlp |" in rates(verdicts)
