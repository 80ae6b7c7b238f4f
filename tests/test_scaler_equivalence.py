"""The loss scaler is torch.amp.GradScaler where it uses GradScaler's names: the same work
run through both gives the same scales, skips, losses and weights, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec import LossScale, Policy
from autoprec.errors import LoopError
from autoprec.precision.scaling import LossScaler

# Non-power-of-two factors make a float64 scale drift from torch's float32 one.
ODD = {"init_scale": 1000.0, "growth_factor": 3.0, "backoff_factor": 0.3, "growth_interval": 3}


def _grads(step: int, overflow: bool) -> list[torch.Tensor]:
    values = torch.linspace(-1.0, 1.0, 7) * (step + 1) * 1e-3
    if overflow:
        values[step % 7] = float("inf") if step % 2 else float("nan")
    return [values, values[:3] * 7.0]


def _optimizer(grads: list[torch.Tensor], scale: float) -> torch.optim.Optimizer:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad * scale
    return torch.optim.SGD(params, lr=1.0)


def _begin(scaler: LossScaler | torch.amp.GradScaler) -> None:
    """Scale a loss, as each iteration does (GradScaler sets up its state there)."""
    if isinstance(scaler, torch.amp.GradScaler):
        scaler.scale(torch.ones(()))
    else:
        scaler.scale_loss(torch.ones(()))


def test_scale_and_unscaled_gradients_equal_gradscalers_step_by_step():
    ours = LossScaler(LossScale("dynamic", **ODD))
    torch_scaler = torch.amp.GradScaler("cpu", **ODD)
    for step in range(80):
        overflow = step % 11 in (4, 5) or step % 17 == 9
        grads = _grads(step, overflow)
        opt_ours, opt_torch = _optimizer(grads, ours.scale), _optimizer(grads, ours.scale)
        _begin(ours)
        _begin(torch_scaler)
        assert ours.scale == torch_scaler.get_scale(), f"scale differs at step {step}"
        assert ours.unscale_(opt_ours) is overflow
        torch_scaler.unscale_(opt_torch)
        for a, b in zip(
            opt_ours.param_groups[0]["params"], opt_torch.param_groups[0]["params"], strict=True
        ):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)
        assert ours.step(opt_ours) is not overflow
        torch_scaler.step(opt_torch)
        ours.update()
        torch_scaler.update()
    assert ours.scale == torch_scaler.get_scale()
    assert ours.state_dict()["_growth_tracker"] == torch_scaler.state_dict()["_growth_tracker"]


def test_growth_stops_below_inf_as_torch_refuses_non_finite_growth():
    ours = LossScaler(LossScale("dynamic", init_scale=2.0**100, growth_interval=1))
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100, growth_interval=1)
    for _ in range(60):  # all-zero gradients: every step clean, the scale keeps growing
        for scaler in (ours, torch_scaler):
            _begin(scaler)
            optimizer = _optimizer([torch.zeros(3)], 1.0)
            scaler.step(optimizer)
            scaler.update()
    assert ours.scale == torch_scaler.get_scale() == 2.0**127


def test_a_scale_halved_to_zero_neither_raises_nor_differs_from_torch():
    ours = LossScaler(LossScale("dynamic", init_scale=1.0))  # min_scale 0: no floor
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    for _ in range(200):  # a forward that always overflows
        for scaler in (ours, torch_scaler):
            _begin(scaler)
            optimizer = _optimizer([torch.tensor([float("inf")])], 1.0)
            scaler.step(optimizer)
            scaler.update()
    assert ours.scale == torch_scaler.get_scale() == 0.0


def test_each_optimizer_is_unscaled_and_stepped_once_per_iteration():
    scaler = LossScaler(LossScale("dynamic", init_scale=8.0))
    optimizer = _optimizer([torch.ones(2)], 8.0)
    scaler.unscale_(optimizer)
    with pytest.raises(LoopError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(optimizer)
    assert scaler.step(optimizer)
    with pytest.raises(LoopError, match="step\\(\\) has already been called"):
        scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(optimizer)
    scaler.update()
    optimizer.param_groups[0]["params"][0].grad = torch.ones(2) * scaler.scale
    assert scaler.step(optimizer)  # a new iteration starts ready


def test_state_dict_carries_the_settings_and_loads_into_gradscaler():
    settings = LossScale("dynamic", hysteresis=2, min_scale=1.0, **ODD)
    scaler = LossScaler(settings)
    for step in range(5):
        scaler.step(_optimizer(_grads(step, step == 3), scaler.scale))
        scaler.update()
    state = scaler.state_dict()
    fresh = LossScaler(LossScale("dynamic"))  # torch's defaults
    fresh.load_state_dict(state)
    assert fresh.settings == settings
    assert fresh.state_dict() == state
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(state)
    assert torch_scaler.get_scale() == scaler.scale
    assert torch_scaler.get_growth_factor() == 3.0
    assert torch_scaler.get_backoff_factor() == 0.3
    back = LossScaler(LossScale("dynamic"))
    back.load_state_dict(torch_scaler.state_dict())
    assert back.scale == scaler.scale
    assert back.settings.growth_interval == 3


class Residual(nn.Module):
    """A pre-norm residual block: LayerNorm reads the fp32 residual stream, as in a
    transformer (on the CPU, plain autocast runs it in fp32 there)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.norm = nn.LayerNorm(32)
        self.mlp = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).float()
        h = h + self.mlp(self.norm(h)).float()
        return self.head(h)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Residual()


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for step in range(count):
        x = torch.randn(16, 12, generator=generator)
        if step in (6, 7, 19):
            x[0, 0] = 1e6  # past fp16's range in the forward: an overflowing step
        batches.append((x, torch.randint(0, 5, (16,), generator=generator)))
    return batches


def _reference(dtype: torch.dtype, scaler: torch.amp.GradScaler | None, batches):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, scales = [], []
    for x, y in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        losses.append(loss.item())
        if scaler is None:
            loss.backward()
            optimizer.step()
            continue
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return losses, scales, model.state_dict()


def _autoprec(policy: Policy, batches):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    prec = policy.apply(model, device="cpu")
    losses, scales = [], []
    for x, y in batches:
        optimizer.zero_grad()
        with prec.autocast():
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        losses.append(loss.item())
        prec.backward(loss)
        prec.step(optimizer)
        scales.append(prec.loss_scale)
    if not policy.loss_scale.enabled:
        scales = []
    return losses, scales, model.state_dict()


def _assert_same(ours, reference) -> None:
    # Losses step by step (NaN where the forward overflowed), bit for bit.
    torch.testing.assert_close(
        torch.tensor(ours[0]), torch.tensor(reference[0]), rtol=0, atol=0, equal_nan=True
    )
    assert ours[1] == reference[1]  # scales after each step
    for name, tensor in reference[2].items():
        torch.testing.assert_close(ours[2][name], tensor, rtol=0, atol=0)


def test_uniform_fp16_with_dynamic_scaling_is_autocast_plus_gradscaler():
    batches = _batches(40)
    policy = Policy.uniform("fp16", LossScale("dynamic", **ODD))
    reference = _reference(torch.float16, torch.amp.GradScaler("cpu", **ODD), batches)
    assert len(set(reference[1])) > 3  # the scale moved both ways
    assert sum(loss != loss for loss in reference[0]) == 3  # three overflowing steps
    _assert_same(_autoprec(policy, batches), reference)


def test_uniform_bf16_is_plain_autocast():
    batches = _batches(20)
    _assert_same(
        _autoprec(Policy.uniform("bf16"), batches), _reference(torch.bfloat16, None, batches)
    )
