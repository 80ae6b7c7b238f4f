"""The watcher: one host transfer per observed step, counts as the caller defines them,
gradients seen through tensor hooks, shared parameters counted once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.numerics.telemetry import GradientMonitor
from autoprec.numerics.watch import CALL, INPUT, OUTPUT, OUTPUT_GRAD, PARAM_GRAD, Counts, Watcher


def elements_and_max(tensor: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.tensor(tensor.numel()).double(), tensor.abs().amax().double()])


COUNTS = Counts(elements_and_max, maxima={1})


@pytest.fixture
def host_transfers(monkeypatch):
    """How many times a tensor was moved to the host or read as a Python number."""
    calls = {"cpu": 0, "item": 0}
    for method in calls:
        original = getattr(torch.Tensor, method)

        def counted(self, *args, method=method, original=original, **kwargs):
            calls[method] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    return calls


def test_one_host_transfer_per_observed_step(host_transfers):
    # An in-place ReLU after the Linear: output gradients are seen through tensor hooks.
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    watcher = Watcher(model)
    for step in range(2):
        with watcher.forward(outputs=COUNTS, output_grads=COUNTS, inputs=COUNTS):
            model(torch.randn(5, 3)).sum().backward()
        watcher.parameter_gradients(COUNTS)
        assert host_transfers == {"cpu": step, "item": 0}  # nothing moved yet
        changed = watcher.collect()
        assert host_transfers == {"cpu": step + 1, "item": 0}
    assert watcher.ran == {"0", "1", "2"}
    assert ("0", OUTPUT_GRAD) in changed and ("2", PARAM_GRAD) in changed
    assert watcher.totals[("0", INPUT)][0] == 2 * 15
    assert watcher.totals[("2", OUTPUT)][0] == 2 * 5
    assert watcher.totals[("0", PARAM_GRAD)][0] == 2 * (12 + 4)
    assert watcher.collect() == []  # nothing pending: no transfer
    assert host_transfers["cpu"] == 2


def test_gradient_monitor_moves_a_step_to_the_host_once(host_transfers):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    monitor = GradientMonitor(model)
    with monitor.activations():
        loss = model(torch.randn(5, 3)).sum()
    loss.backward()
    monitor.observe_gradients(scale=2.0**16)
    assert host_transfers == {"cpu": 1, "item": 0}
    assert monitor.stats["2"].act_elements == 5 and monitor.stats["0"].grad_elements == 16
    assert host_transfers["cpu"] == 1


def test_maxima_and_sums_accumulate_over_calls():
    shared = nn.Identity()
    model = nn.Sequential(shared)
    watcher = Watcher(model)
    calls = Counts(
        lambda args, kwargs, output: torch.tensor([1, output.numel()], dtype=torch.float64),
        maxima={1},
    )
    with watcher.forward(calls=calls, outputs=COUNTS):
        model(torch.tensor([1.0, -3.0]))
        model(torch.tensor([2.0]))
        model(torch.ones(0))  # an empty output: a call, but no output to count
        model(torch.ones(2, dtype=torch.int64))  # integers are not counted as outputs
    watcher.collect()
    assert watcher.totals[("0", OUTPUT)] == [3.0, 3.0]
    assert watcher.totals[("0", CALL)] == [4.0, 2.0]  # four calls, at most two elements


def test_a_parameter_shared_by_two_modules_counts_once():
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight = first.weight  # tied, as an embedding and an output layer
    model = nn.Sequential(first, second)
    model(torch.ones(2, 3)).sum().backward()
    watcher = Watcher(model)
    watcher.parameter_gradients(COUNTS)
    watcher.collect()
    assert watcher.totals[("0", PARAM_GRAD)][0] == 9 + 3
    assert watcher.totals[("1", PARAM_GRAD)][0] == 3  # its own bias only
