"""Models that land on any CPU: a policy applied by hand to a recurrent layer or a layer
of a user's own either trains or is refused in one line before anything runs.

Where autocast cannot run a layer in the policy's dtype and a cast of it can, `apply`
lands it by cast: its parameters are cast on the fly (the fp32 Parameters stay the
optimizer's) and its inputs cast, autocast off. Which way each layer lands comes from
probing it on this device (`autoprec.numerics.observe.probe`), never from its class name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autoprec
from autoprec import Policy
from autoprec.devices import failing_dtypes, forget_watched, get_backend
from autoprec.errors import PolicyError
from autoprec.precision.hooks import Precision
from autoprec.precision.plan import CAST, Plan, RegionSpec
from autoprec.precision.scaling import LossScale
from autoprec.trials.training import Budget, run_trial

WIDTH = 8
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Joined(nn.Module):
    """A projection of its input joined to the input itself: ``torch.cat`` of a
    low-precision matmul and an fp32 tensor under autocast."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width // 2, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, self.weight), x[..., : x.shape[-1] // 2]], dim=-1)


class Anchored(nn.Module):
    """A projection pulled a quarter of the way to a learned anchor. ``torch.lerp`` wants
    its operands in one dtype and is on none of autocast's lists, so under autocast the
    projection's low dtype meets the fp32 anchor and fails, on every CPU; with the
    parameters cast it runs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.anchor = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.lerp(F.linear(x, self.weight), self.anchor, 0.25)


class Pairwise(nn.Module):
    """Pairwise distances of projected rows: ``F.pdist`` has no fp16 or bf16 kernel on
    the CPU, and autocast does not run it in fp32 either."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = F.linear(x, self.weight)
        return F.pdist(rows.flatten(0, -2)).mean() + rows


class Sequence(nn.Module):
    """A sequence classifier around one middle layer."""

    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.middle = middle
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.middle(self.inp(x))
        h = h[0] if isinstance(h, tuple) else h
        return self.head(h[:, -1])


MIDDLES = {
    "lstm": lambda: nn.LSTM(WIDTH, WIDTH, batch_first=True),
    "gru": lambda: nn.GRU(WIDTH, WIDTH, batch_first=True),
    "joined": lambda: Joined(WIDTH),
    "anchored": lambda: Anchored(WIDTH),
}


def batches(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 5, WIDTH, generator=generator)
    y = (x[:, :, 0].sum(dim=1) > 0).long()
    while True:
        for i in range(0, 64, 16):
            yield x[i : i + 16], y[i : i + 16]


@pytest.fixture(autouse=True)
def nothing_watched():
    """Each test starts as a user's own script does: nothing probed or watched yet."""
    forget_watched("cpu")
    yield
    forget_watched("cpu")


def train_by_hand(model: nn.Module, policy: Policy, steps: int = 10) -> list[float]:
    """The README's loop: apply, an optimizer over the model, autocast, backward, step."""
    prec = policy.apply(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _, (x, y) in zip(range(steps), batches(), strict=False):
        optimizer.zero_grad()
        with prec.autocast():
            out = model(x)
        loss = F.cross_entropy(prec.convert_output(out), y)
        prec.backward(loss)
        prec.step(optimizer)
        losses.append(loss.item())
    prec.remove()
    return losses


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("middle", ["lstm", "gru", "joined", "anchored"])
def test_a_uniform_policy_applied_by_hand_trains_ten_steps_or_is_refused_in_one_line(middle, dtype):
    """An LSTM, a GRU, a ``torch.cat`` of mixed inputs and a layer autocast cannot run:
    under uniform fp16 and bf16, applied by hand with nothing watched before, each trains
    10 steps with finite losses and fp32 master weights that move, and each layer runs in
    the dtype the layer table says without a batch (forward hooks see it); where this CPU
    cannot run one, ``apply`` refuses in one line that names it and the dtype."""
    torch.manual_seed(0)
    model = Sequence(MIDDLES[middle]())
    before = [p.detach().clone() for p in model.middle.parameters()]
    policy = Policy.uniform(dtype)
    try:
        table = policy.layer_table(model)
        losses = train_by_hand(model, policy)
    except PolicyError as error:  # this CPU has no kernel for it, cast or not
        assert "\n" not in str(error) and str(error).startswith("middle ("), error
        assert f"cannot run in {dtype}" in str(error), error
        cast = copy.deepcopy(model.middle).to(LOW[dtype])
        with pytest.raises(RuntimeError):  # the refusal is true: the cast fails too
            output = cast(torch.randn(4, 5, WIDTH, dtype=LOW[dtype], requires_grad=True))
            (output[0] if isinstance(output, tuple) else output).float().sum().backward()
        return
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses)))
    after = list(model.middle.parameters())
    assert all(p.dtype == torch.float32 and isinstance(p, nn.Parameter) for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    seen = output_dtypes(model, policy)
    assert {row["name"]: row["dtype"] for row in table} == seen


def output_dtypes(model: nn.Module, policy: Policy) -> dict[str, str]:
    """Each child's output dtype in one forward under the policy, as forward hooks see it."""
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    seen: dict[str, str] = {}

    def hook(module: nn.Module, args, output, name: str) -> None:
        seen[name] = names[(output[0] if isinstance(output, tuple) else output).dtype]

    handles = [
        child.register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
        for name, child in model.named_children()
    ]
    prec = policy.apply(model)
    with torch.no_grad(), prec.autocast():
        model(next(batches())[0])
    prec.remove()
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_layer_autocast_cannot_run_lands_by_cast_and_computes_as_its_cast_copy(dtype):
    """The real failure, on every CPU: under autocast ``torch.lerp`` meets the projection's
    low dtype beside the fp32 anchor and raises, cast inputs or not. The probe finds it,
    the plan lands the layer by cast, and the layer table says so. The landed layer
    computes exactly what a copy cast with ``.to(dtype)`` computes on cast inputs, and its
    fp32 Parameters receive that copy's gradients, upcast: the optimizer keeps fp32
    master weights."""
    low = LOW[dtype]
    layer = Anchored(WIDTH)
    x = torch.randn(4, 5, WIDTH)
    for given in (x, x.to(low)):
        with pytest.raises(RuntimeError, match="expected dtype"), torch.autocast("cpu", low):
            layer(given)
    model = Sequence(layer)
    policy = Policy.uniform(dtype)
    lands = {row["name"]: row["lands"] for row in policy.layer_table(model)}
    assert lands == {"inp": "autocast", "middle": CAST, "head": "autocast"}
    reference = copy.deepcopy(layer).to(low)
    inputs = torch.randn(4, 5, WIDTH, dtype=low)
    expected = reference(inputs)
    expected.float().sum().backward()
    prec = policy.apply(model)
    with prec.autocast():
        out = layer(inputs.float())
    out.float().sum().backward()
    prec.remove()
    assert out.dtype == low and torch.equal(out, expected)
    for name, parameter in layer.named_parameters():
        assert parameter.dtype == torch.float32 and isinstance(parameter, nn.Parameter)
        cast_grad = reference.get_parameter(name).grad
        assert torch.equal(parameter.grad, cast_grad.float()), name


def test_a_layer_neither_autocast_nor_a_cast_can_run_is_refused_before_anything_runs():
    """``F.pdist`` has no fp16 or bf16 kernel on the CPU and autocast runs it in neither:
    ``apply`` raises PolicyError in one line naming the layer and the dtype, and the model
    is left as it was (no region installed)."""
    model = Sequence(Pairwise(WIDTH))
    for dtype in ("fp16", "bf16"):
        with pytest.raises(PolicyError) as refused:
            Policy.uniform(dtype).apply(model)
        message = str(refused.value)
        assert message.startswith(f"middle (Pairwise): cannot run in {dtype} on cpu: ")
        assert "pdist" in message and "\n" not in message
        assert all("forward" not in m.__dict__ for m in model.modules())
    assert Policy.uniform("fp32").apply(model) is not None  # fp32 runs it


def test_an_lstm_landed_by_cast_computes_as_the_lstm_cast_to_fp16():
    """Where oneDNN has no low-precision LSTM for training, a cast of the LSTM runs (the
    issue's CPU). The cast landing on an LSTM (whose flat weights torch re-reads when they
    change) computes what ``lstm.to(torch.float16)`` computes on fp16 inputs, forward and
    backward, and the fp32 Parameters are the LSTM's again after each forward."""
    torch.manual_seed(0)
    model = Sequence(nn.LSTM(WIDTH, WIDTH, batch_first=True))
    reference = copy.deepcopy(model.middle).to(torch.float16)
    inputs = torch.randn(4, 5, WIDTH, dtype=torch.float16)
    expected, _ = reference(inputs)
    expected.float().sum().backward()
    landed = RegionSpec("middle", "fp16", "fp16", cast_inputs=True, cast_parameters=True)
    plan = Plan("cpu", "fp16", (landed,), dict.fromkeys(("inp", "middle", "head"), "fp16"))
    prec = Precision(model, plan, LossScale(), get_backend("cpu"))
    with prec.autocast():
        out, _ = model.middle(inputs.float())
    out.float().sum().backward()
    assert out.dtype == torch.float16 and torch.equal(out, expected)
    for name, parameter in model.middle.named_parameters():
        assert parameter.dtype == torch.float32 and isinstance(parameter, nn.Parameter)
        assert torch.equal(parameter.grad, reference.get_parameter(name).grad.float()), name
    assert all(w.dtype == torch.float32 for w in model.middle.parameters())
    prec.remove()
    with torch.no_grad():
        assert model.middle(inputs.float())[0].dtype == torch.float32  # its own again


def anchored_task() -> autoprec.Task:
    return autoprec.Task(
        "anchored",
        lambda: Sequence(Anchored(WIDTH)),
        batches,
        lambda: [next(batches(1))],
        F.cross_entropy,
    )


def test_a_trial_of_a_layer_that_lands_by_cast_trains_as_applied_by_hand():
    """The search's path agrees with a user's: the trial watches the layers on a real
    batch, the profile-free trial lands the anchored layer by cast and trains."""
    policy = Policy.uniform("bf16")
    result = run_trial(anchored_task(), policy, get_backend("cpu"), Budget(steps=6))
    assert result.state == "complete", result.reason
    assert result.low_precision_share == 1.0


def test_the_profile_measures_a_layer_that_lands_by_cast_as_the_plan_runs_it():
    """The search's profile runs each layer as the plan runs it: the anchored layer, cast,
    gets a deviation from fp32 in fp16 and bf16 instead of an error, and no dtype of it is
    recorded as failing (the space keeps offering both)."""
    task = anchored_task()
    profile = autoprec.profile_task(task, "cpu", dtypes=["fp16", "bf16"])
    middle = next(m for m in profile.modules if m.name == "middle")
    assert not middle.error, middle.reason
    for dtype in ("fp16", "bf16"):
        assert middle.stats[dtype]["output_deviation"] > 0
    assert failing_dtypes("cpu", task.model().middle) == {}
