"""Loss scaling: torch's dynamic rules, hysteresis, a floor, static skipping, state."""

from __future__ import annotations

import math

import pytest
import torch

from autoprec import LossScale
from autoprec.errors import PolicyError
from autoprec.precision.scaling import LossScaler


def _optimizer_with_grad(value: float) -> torch.optim.Optimizer:
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), value)
    return torch.optim.SGD([param], lr=0.1)


def _step(scaler: LossScaler, grad: float) -> bool:
    optimizer = _optimizer_with_grad(grad * scaler.scale)
    stepped = scaler.step(optimizer)
    scaler.update()
    return stepped


def test_dynamic_backs_off_on_overflow_and_grows_after_interval():
    scaler = LossScaler(LossScale("dynamic", init_scale=1024.0, growth_interval=3))
    assert not _step(scaler, float("inf"))
    assert scaler.scale == 512.0
    for _ in range(3):
        assert _step(scaler, 1.0)
    assert scaler.scale == 1024.0


def test_unscale_divides_by_the_scale():
    scaler = LossScaler(LossScale("static", init_scale=8.0))
    optimizer = _optimizer_with_grad(4.0)
    assert scaler.unscale_(optimizer) is False
    grad = optimizer.param_groups[0]["params"][0].grad
    torch.testing.assert_close(grad, torch.full((3,), 0.5))


def test_hysteresis_backs_off_only_after_consecutive_overflows():
    scaler = LossScaler(LossScale("dynamic", init_scale=1024.0, hysteresis=2))
    _step(scaler, float("nan"))
    assert scaler.scale == 1024.0
    _step(scaler, 1.0)  # a clean step resets the count
    _step(scaler, float("inf"))
    assert scaler.scale == 1024.0
    _step(scaler, float("inf"))
    assert scaler.scale == 512.0


def test_min_scale_is_a_floor():
    scaler = LossScaler(LossScale("dynamic", init_scale=4.0, min_scale=2.0))
    for _ in range(5):
        _step(scaler, float("inf"))
    assert scaler.scale == 2.0


def test_static_skips_overflow_and_keeps_its_scale():
    scaler = LossScaler(LossScale("static", init_scale=128.0))
    assert not _step(scaler, float("inf"))
    assert _step(scaler, 1.0)
    assert scaler.scale == 128.0


def test_none_never_scales_or_skips():
    scaler = LossScaler(LossScale())
    loss = torch.tensor(3.0)
    assert scaler.scale_loss(loss) is loss
    assert _step(scaler, float("inf"))


def test_state_dict_round_trip():
    scaler = LossScaler(LossScale("dynamic", init_scale=64.0, growth_interval=10, hysteresis=3))
    _step(scaler, 1.0)
    _step(scaler, float("inf"))
    other = LossScaler(LossScale("dynamic", init_scale=64.0, growth_interval=10, hysteresis=3))
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "auto"},
        {"init_scale": 0.0},
        {"init_scale": 1e39},  # inf as the float32 scale
        {"growth_factor": 1.0},
        {"growth_factor": float("inf")},
        {"hysteresis": 0},
    ],
)
def test_invalid_settings(kwargs):
    with pytest.raises(PolicyError, match=r"^loss_scale\."):
        LossScale(**kwargs)


def test_the_largest_loss_scale_is_float32s_largest():
    """The settings are checked without torch, against float32's largest number, as torch
    keeps the scale: that number is allowed, the next float above it is not."""
    largest = float(torch.finfo(torch.float32).max)
    assert LossScale(init_scale=largest).init_scale == largest
    with pytest.raises(PolicyError, match="init_scale"):
        LossScale(init_scale=math.nextafter(largest, math.inf))
