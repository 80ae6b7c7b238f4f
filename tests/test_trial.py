"""The trial runner: each dtype trains, failures become results, never exceptions."""

from __future__ import annotations

import math

import pytest
import torch

import autoprec
from autoprec import LossScale, Policy, Rule
from autoprec.devices import get_backend
from autoprec.trials.training import Budget, EarlyStopping, run_trial
from autoprec.trials.training import time_policies_side_by_side as time_side_by_side

CPU = get_backend("cpu")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_each_dtype_trains(tiny_task, dtype):
    result = run_trial(tiny_task, Policy.uniform(dtype), CPU, Budget(steps=40))
    assert result.state == "complete", result.reason
    assert result.accuracy > 0.6  # 4 classes: chance is 0.25
    assert result.losses[-1] < result.losses[0]
    assert result.steps_run == 40
    assert result.step_time_ms > 0
    assert result.peak_memory_mb > 0 and result.peak_memory_is_estimate
    # All but the LayerNorm, which autocast keeps in fp32.
    assert (
        result.low_precision_share == 0.0 if dtype == "fp32" else result.low_precision_share > 0.9
    )
    metrics = result.metrics()
    for name in (
        "accuracy",
        "step_time_ms",
        "peak_memory_mb",
        "overflow_steps",
        "nonfinite_steps",
        "grad_underflow_ratio",
        "final_loss",
    ):
        assert name in metrics
    if dtype == "fp16":
        assert result.loss_scales[0] == 2.0**16


def test_same_seed_same_result(tiny_task):
    first = run_trial(tiny_task, Policy.uniform("fp32"), CPU, Budget(steps=10))
    second = run_trial(tiny_task, Policy.uniform("fp32"), CPU, Budget(steps=10))
    assert first.losses == second.losses
    assert first.accuracy == second.accuracy


def test_low_precision_activations_shrink_the_cpu_memory_estimate(tiny_task):
    wide = autoprec.Task(
        "wide",
        lambda: torch.nn.Sequential(
            torch.nn.Linear(16, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4)
        ),
        tiny_task.train_data,
        tiny_task.val_data,
        tiny_task.loss,
    )
    fp32 = run_trial(wide, Policy.uniform("fp32"), CPU, Budget(steps=4, warmup_steps=2))
    bf16 = run_trial(wide, Policy.uniform("bf16"), CPU, Budget(steps=4, warmup_steps=2))
    assert bf16.peak_memory_mb < fp32.peak_memory_mb


def test_nonfinite_loss_without_scaling_is_pruned_with_reason(tiny_task):
    def exploding_loss(outputs, targets):
        return torch.nn.functional.cross_entropy(outputs, targets) * float("inf")

    task = autoprec.Task(
        "inf", tiny_task.model, tiny_task.train_data, tiny_task.val_data, exploding_loss
    )
    result = run_trial(task, Policy.uniform("fp32"), CPU, Budget(steps=10))
    assert result.state == "pruned"
    assert "non-finite loss" in result.reason and "step 0" in result.reason
    assert result.nonfinite_steps == 1
    assert result.accuracy is None


class Blowup(torch.nn.Module):
    """Inputs scaled past fp16's 65504: every fp16 forward overflows."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x * 1e6)


def test_overflowing_fp16_layer_is_caught_by_the_scaler_then_pruned(tiny_task):
    task = autoprec.Task("blowup", Blowup, tiny_task.train_data, tiny_task.val_data, tiny_task.loss)
    result = run_trial(task, Policy.uniform("fp16"), CPU, Budget(steps=20), EarlyStopping())
    assert result.state == "pruned"
    assert result.reason.startswith("overflow: non-finite loss")
    assert "first non-finite output: fc (fp16)" in result.reason
    assert result.nonfinite_steps == 5
    assert result.overflow_steps >= 5
    # Without early stopping the scaler skips every step to the end of the budget.
    patient = run_trial(task, Policy.uniform("fp16"), CPU, Budget(steps=20))
    assert patient.steps_run == 20 and patient.overflow_steps == 20
    # The same model with that layer kept in fp32 trains.
    kept = Policy(rules=(Rule("fp32", patterns=("fc",)),), default="fp16")
    assert run_trial(task, kept, CPU, Budget(steps=20)).state == "complete"


def test_exception_becomes_failed_trial(tiny_task):
    def broken_data(seed):
        yield torch.randn(32, 5), torch.zeros(32, dtype=torch.long)  # wrong width

    task = autoprec.Task("broken", tiny_task.model, broken_data, tiny_task.val_data, tiny_task.loss)
    result = run_trial(task, Policy.uniform("fp32"), CPU, Budget(steps=4))
    assert result.state == "failed"
    assert result.reason.startswith("RuntimeError")
    assert result.run_time_s > 0


def test_side_by_side_timing_gives_one_median_per_policy(tiny_task):
    policies = [Policy.uniform("fp32"), Policy.uniform("bf16"), Policy.uniform("fp16")]
    times_ms = time_side_by_side(tiny_task, policies, CPU, Budget(steps=16), rounds=2)
    assert len(times_ms) == 3
    assert all(t > 0 and math.isfinite(t) for t in times_ms)


def test_custom_metric_is_used(tiny_task):
    task = autoprec.Task(
        "m",
        tiny_task.model,
        tiny_task.train_data,
        tiny_task.val_data,
        tiny_task.loss,
        metric=lambda out, y: -float(out.abs().mean()),
    )
    result = run_trial(task, Policy.uniform("fp32"), CPU, Budget(steps=4))
    assert result.accuracy < 0 and math.isfinite(result.accuracy)


def test_a_high_initial_loss_scale_backing_off_is_not_pruned(tiny_task):
    # 2**24 with hysteresis 4 skips dozens of steps while it backs off: healthy, not hopeless.
    baseline = run_trial(tiny_task, Policy.uniform("fp32"), CPU, Budget(steps=80))
    scale = LossScale("dynamic", init_scale=2.0**24, hysteresis=4, backoff_factor=0.5)
    result = run_trial(
        tiny_task,
        Policy.uniform("fp16", scale),
        CPU,
        Budget(steps=80),
        EarlyStopping.from_baseline(baseline),
    )
    assert result.state == "complete", result.reason
    assert result.accuracy >= baseline.accuracy - 0.05


def test_a_trial_that_never_steps_is_pruned_even_without_early_stopping(tiny_task):
    task = autoprec.Task("blowup", Blowup, tiny_task.train_data, tiny_task.val_data, tiny_task.loss)
    result = run_trial(task, Policy.uniform("fp16"), CPU, Budget(steps=10))
    assert result.state == "pruned" and "skipped all 10 steps" in result.reason
