"""Telemetry: underflow counts only gradients fp16 would lose, saturation is counted,
and hopeless trials on fragile tasks stop early with a reason naming the mechanism."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec import LossScale, Policy
from autoprec.devices import get_backend
from autoprec.numerics.telemetry import GradientMonitor
from autoprec.tasks import load_task
from autoprec.trials.training import Budget, EarlyStopping, run_trial

CPU = get_backend("cpu")


def test_underflow_ratio_counts_only_gradients_lost_to_fp16_not_true_zeros():
    layer = nn.Linear(4, 2, bias=False)
    model = nn.Sequential(layer)
    # 3 true zeros, 2 values under fp16's smallest subnormal (6e-8), 3 representable.
    grad = torch.tensor([[0.0, 0.0, 0.0, 1e-9], [2e-8, 1e-3, 7e-8, 0.5]])
    layer.weight.grad = grad
    monitor = GradientMonitor(model)
    monitor.observe_gradients(scale=1.0)
    stats = monitor.stats["0"]
    assert stats.grad_nonzero == 5 and stats.grad_zero == 3
    assert stats.grad_flushed == 2
    assert stats.grad_underflow_ratio == pytest.approx(2 / 5)
    assert monitor.grad_underflow_ratio == pytest.approx(2 / 5)
    assert any(w.startswith("underflow: 40.0% of 0's") for w in monitor.warnings())
    # At a loss scale of 2**10 the same gradients survive in fp16.
    scaled = GradientMonitor(model)
    scaled.observe_gradients(scale=2.0**10)
    assert scaled.stats["0"].grad_flushed == 0
    assert scaled.warnings() == []


def test_saturation_at_65504_and_nonfinite_outputs_are_counted():
    class Saturating(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            values = torch.tensor([65504.0, -65504.0, 1.0, float("inf")], dtype=torch.float16)
            return values * self.scale.detach().half() + 0 * x.sum().half()

    model = nn.Sequential(Saturating())
    monitor = GradientMonitor(model)
    with monitor.activations():
        model(torch.ones(2))
    report = monitor.report()
    stats = monitor.stats["0"]
    assert stats.act_elements == 4
    assert stats.act_at_fp16_max == 2  # the two saturated values, not the inf
    assert stats.act_nonfinite == 1
    assert report["layers"][0]["name"] == "0"
    assert stats.act_overflow_origin == 1  # its inputs were finite and in range
    assert any(
        w.startswith("overflow: 0 turned finite inputs into 1 non-finite")
        for w in report["warnings"]
    )


def test_fp32_outputs_past_fp16_range_are_flagged_as_overflow_risk():
    model = nn.Sequential(nn.Linear(1, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e5)
    monitor = GradientMonitor(model)
    with monitor.activations():
        model(torch.ones(3, 1))
    assert monitor.stats["0"].act_at_fp16_max == 3
    assert "overflow risk" in monitor.warnings()[0]


def test_trailing_rule_compares_with_the_baseline_curve():
    baseline = [2.0] * 10 + [1.0] * 40
    stop = EarlyStopping(reference_losses=tuple(baseline))
    assert stop.trailing([2.0] * 25, steps=50) is not None  # learned nothing
    assert stop.trailing([2.0] * 10 + [1.05] * 15, steps=50) is None  # on the curve
    assert stop.trailing([2.0] * 5, steps=50) is None  # too early to judge


@pytest.fixture(scope="module")
def overflow():
    task = load_task("digits-overflow")
    return task, run_trial(task, Policy.uniform("fp32"), CPU, Budget(steps=40))


@pytest.fixture(scope="module")
def underflow():
    task = load_task("digits-underflow")
    return task, run_trial(task, Policy.uniform("fp32"), CPU, Budget(steps=40))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fragile_tasks_train_in_fp32_and_bf16(overflow, underflow, dtype):
    for task, baseline in (overflow, underflow):
        result = run_trial(task, Policy.uniform(dtype), CPU, Budget(steps=40))
        assert result.state == "complete", result.reason
        assert result.accuracy >= baseline.accuracy - 0.02 and result.accuracy > 0.8


@pytest.mark.parametrize("loss_scale", [LossScale(), LossScale("dynamic")])
def test_uniform_fp16_overflows_whatever_the_loss_scale(overflow, loss_scale):
    task, baseline = overflow
    result = run_trial(
        task,
        Policy.uniform("fp16", loss_scale),
        CPU,
        Budget(steps=40),
        EarlyStopping.from_baseline(baseline),
    )
    assert result.state == "pruned"
    assert result.reason.startswith("overflow:")
    assert "first non-finite output: features (fp16)" in result.reason
    assert result.steps_run <= 6


def test_uniform_fp16_without_scaling_stops_learning_and_is_pruned_early(underflow):
    task, baseline = underflow
    assert any("underflow" in w for w in baseline.telemetry["warnings"])  # the advice
    result = run_trial(
        task,
        Policy.uniform("fp16", LossScale()),
        CPU,
        Budget(steps=40),
        EarlyStopping.from_baseline(baseline),
    )
    assert result.state == "pruned"
    assert result.reason.startswith("underflow: loss trails the fp32 baseline")
    assert result.steps_run < 40
    scaled = run_trial(
        task, Policy.uniform("fp16"), CPU, Budget(steps=40), EarlyStopping.from_baseline(baseline)
    )
    assert scaled.state == "complete" and scaled.accuracy > 0.8


def test_overflow_is_blamed_on_the_module_where_it_starts():
    # The fp32 baseline of the overflow task: the square in `features` (a parent module
    # with no parameters of its own) passes 65504; the LayerNorm after it only receives it.
    task = load_task("digits-overflow")
    model = task.model()
    inputs, _ = next(iter(task.train_data(0)))
    monitor = GradientMonitor(model)
    with monitor.activations():
        model(inputs)
    warnings = monitor.warnings()
    assert len(warnings) == 1 and warnings[0].startswith("overflow risk: ")
    assert " of features reach " in warnings[0]
    assert monitor.stats["norm_in"].act_overflow_origin == 0


def test_shared_parameters_count_once_and_empty_outputs_pass():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    model(torch.ones(2, 3)).sum().backward()
    monitor = GradientMonitor(model)
    with monitor.activations():
        model(torch.ones(0, 3))  # an empty batch, as an expert that got no tokens
    monitor.observe_gradients()
    assert sum(s.grad_elements for s in monitor.stats.values()) == 12
