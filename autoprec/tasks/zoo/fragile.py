"""Fragile-late zoo tasks: each fails in fp16 between 2x and 10x a 200-step trial (step
400 to 2000), by a distinct mechanism, and trains in fp32 and bf16 (fp32's range).

Where a value's size is a unit choice, the task carries a fixed ``UNIT`` that the model
multiplies in and divides out again (``gain(z) / UNIT``, raw input counts before a
normalisation), so fp32 and bf16 train exactly as without it while the fp16 crossing
lands inside the window. The units were set from fp32 runs and the failure steps
measured by the ground truth (``benchmarks/zoo_truth.json``); each factory's docstring
says what it measured.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autoprec.tasks.base import Task
from autoprec.tasks.zoo import datasets
from autoprec.tasks.zoo._entry import Kind, ZooEntry


def region_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the enclosing autocast region computes in (x's own outside one): what a
    custom kernel written for the region's dtype runs in."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _param_groups(params: Any) -> tuple[list[nn.Parameter], dict[str, list[nn.Parameter]]]:
    """Parameters split by the ``zoo_group`` attribute a task's module put on them."""
    plain: list[nn.Parameter] = []
    grouped: dict[str, list[nn.Parameter]] = {}
    for p in params:
        group = getattr(p, "zoo_group", None)
        (grouped.setdefault(group, []) if group else plain).append(p)
    return plain, grouped


def _tag(parameter: Any, group: str) -> Any:
    parameter.zoo_group = group  # type: ignore[attr-defined]
    return parameter


def _body(inputs: int = 64, hidden: int = 64) -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(inputs, hidden),
            act1=nn.ReLU(),
            fc2=nn.Linear(hidden, hidden),
            act2=nn.ReLU(),
        )
    )


class _StepCounted(nn.Module):
    """A module that counts its training steps (backward passes) in a buffer, for a
    coefficient annealed on a schedule of its own (as FreezeOut's or DANN's are)."""

    steps: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))


# -- annealed gains: an inverse temperature on the logits that rises on a schedule --------

GAIN_SHAPES: dict[str, Callable[[float], float]] = {
    "exponential": math.exp,
    "power": lambda u: (1.0 + u) ** 3,
    "sqrt": lambda u: math.sqrt(1.0 + u),
    "linear": lambda u: 1.0 + u,
}
# steps per unit of the schedule's argument, and the unit the gain's output carries
GAIN_TAU = {"exponential": 250.0, "power": 100.0, "sqrt": 10.0, "linear": 20.0}
GAIN_UNITS = {"exponential": 2.0**8.5, "power": 2.0**6, "sqrt": 2.0**11, "linear": 2.0**10}


class AnnealedHead(nn.Linear):
    """A Linear head whose output is multiplied by ``unit * shape(max(0, step - start) /
    tau)`` in the region's dtype: an inverse temperature on the logits annealed upward on
    a schedule (as distillation and annealed-softmax heads do), counting its own training
    steps."""

    steps: torch.Tensor

    def __init__(self, shape: str, unit: float, start: int = 0) -> None:
        super().__init__(64, 10)
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))
        self.shape, self.unit, self.start = shape, unit, start
        self.tau = GAIN_TAU[shape]

    def factor(self) -> float:
        return GAIN_SHAPES[self.shape](max(0.0, float(self.steps) - self.start) / self.tau)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.steps.add_(1)
        z = super().forward(x)
        dtype = region_dtype(z)
        return z.to(dtype) * torch.tensor(self.factor() * self.unit, dtype=dtype)


class GainedMLP(nn.Module):
    """An MLP whose annealed head's output is divided by the head's unit again: the
    logits are ``head(x) * shape(step / tau)``."""

    def __init__(self, shape: str, unit: float, start: int = 0) -> None:
        super().__init__()
        self.body = _body()
        self.head = AnnealedHead(shape, unit, start)
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) / self.unit


def _gained(name: str, shape: str, start: int = 0, unit: float | None = None) -> Task:
    train_data, val_data = datasets.digits()
    unit = GAIN_UNITS[shape] if unit is None else unit
    return Task(name, lambda: GainedMLP(shape, unit, start), train_data, val_data, F.cross_entropy)


def exp_growth() -> Task:
    """Exponential growth: the logits' inverse temperature is ``exp(step / 250)``, so the
    head's output grows exponentially until fp16 overflows.

    Measured (2000 steps, CPU): uniform fp16 fails at step 986/945 (seeds 0/1; first:
    non-finite loss); bf16 holds (metric 0.947), the group in fp32 holds (0.981), fp32
    0.936.
    """
    return _gained("zoo-exp-growth", "exponential")


def power_growth() -> Task:
    """Power-law growth: the inverse temperature is ``(1 + step / 100) ** 3``.

    Measured (2000 steps, CPU): uniform fp16 fails at step 869/907 (seeds 0/1; first:
    non-finite loss); bf16 holds (metric 0.969), the group in fp32 holds (0.955), fp32
    0.953.
    """
    return _gained("zoo-power-growth", "power")


def sqrt_growth() -> Task:
    """Square-root-like growth: the inverse temperature is ``sqrt(1 + step / 10)``:
    growth that slows down, and crosses fp16's maximum late.

    Measured (2000 steps, CPU): uniform fp16 fails at step 700/820 (seeds 0/1; first:
    non-finite output: head); bf16 holds (metric 0.975), the group in fp32 holds
    (0.975), fp32 0.978.
    """
    return _gained("zoo-sqrt-growth", "sqrt")


def linear_growth() -> Task:
    """Linear growth: the inverse temperature is ``1 + step / 20``.

    Measured (2000 steps, CPU): uniform fp16 fails at step 770/783 (seeds 0/1; first:
    non-finite output: head); bf16 holds (metric 0.975), the group in fp32 holds
    (0.961), fp32 0.975.
    """
    return _gained("zoo-linear-growth", "linear")


WARMUP_HOLD = 400  # steps the warm-up holds the inverse temperature at 1
WARMUP_UNIT = 2.0**9


def warmup_growth() -> Task:
    """Growth that starts when a warm-up the model schedules itself ends: the inverse
    temperature is held at 1 until step 400, then rises as ``exp((step - 400) / 250)``,
    so a 200-step trial sees it flat, and nothing the trial can read (no learning rate,
    no range) says it will rise: only a run that long shows it
    (`lr_warmup_growth` is the same growth driven by the learning rate's schedule).

    Measured (2000 steps, CPU): uniform fp16 fails at step 1000/1020 (seeds 0/1; first:
    non-finite output: head); bf16 holds (metric 0.958), the group in fp32 holds
    (0.958), fp32 0.972.
    """
    return _gained("zoo-warmup-growth", "exponential", WARMUP_HOLD, WARMUP_UNIT)


# -- growth at the learning rate's pace, after a constant warm-up ---------------------------

LR_WARMUP_STEPS = 400  # a constant warm-up: a quarter of the learning rate for 400 steps
LR_WARMUP_FACTOR = 0.25
LR_WARMUP_PEAK = 2e-3  # Adam's rate after the warm-up (5e-4 during it)
LR_WARMUP_UNIT = 2.0**14
BLOB_CLASSES, BLOB_FEATURES = 4, 16


class CosineHead(nn.Linear):
    """A cosine classifier's head (NormFace's): the Linear output normalised, times
    ``unit * exp(s)`` in the region's dtype, with a learned log-scale ``s``. On data it
    separates, every step's gradient raises ``s`` (a larger scale only sharpens right
    answers), so Adam raises it by about the learning rate a step, and learning cannot
    shrink the normalised logits back."""

    def __init__(self, inputs: int, classes: int, unit: float) -> None:
        super().__init__(inputs, classes)
        self.log_scale = nn.Parameter(torch.zeros(()))
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = super().forward(x)
        dtype = region_dtype(z)
        cosine = F.normalize(z.float(), dim=-1).to(dtype)
        return cosine * (torch.exp(self.log_scale) * self.unit).to(dtype)


class CosineMLP(nn.Module):
    def __init__(self, unit: float) -> None:
        super().__init__()
        self.body = _body(BLOB_FEATURES)
        self.head = CosineHead(64, BLOB_CLASSES, unit)
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) / self.unit


def _constant_warmup(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: LR_WARMUP_FACTOR if step < LR_WARMUP_STEPS else 1.0
    )


def lr_warmup_growth() -> Task:
    """Growth that starts when the learning rate's warm-up ends: a cosine classifier with
    a learned scale on separable blobs, under a constant warm-up (a quarter of Adam's
    2e-3 for 400 steps, as ResNet-110's warm-up was a tenth), so its logits grow four
    times faster once the warm-up ends. A trial of 100 or 200 steps sees the slow pace
    only; the schedule it will run on says the rest.

    Measured (2000 steps, CPU): uniform fp16 fails at step 1233/1238 (seeds 0/1; first:
    non-finite loss); bf16 holds (metric 1.000), the group in fp32 holds (1.000), fp32
    1.000.
    """
    inputs, labels = datasets.blobs(BLOB_CLASSES, BLOB_FEATURES, samples=2048, spread=4.0)
    train_data, val_data = datasets.split(inputs, labels, 512, datasets.BATCH)
    return Task(
        "zoo-lr-warmup-growth",
        lambda: CosineMLP(LR_WARMUP_UNIT),
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=lambda p: torch.optim.Adam(p, lr=LR_WARMUP_PEAK),
        scheduler=_constant_warmup,
    )


# -- values that shrink until they underflow ----------------------------------------------

SHRINK_RATE = 0.015  # per step: AdamW's lr * weight_decay on a scale-invariant gain
NORM_EPS = 1e-37


class _ZeroGradient(torch.autograd.Function):
    """``x * g`` whose gradient in ``g`` is exactly zero: ``g`` only scales what a
    normalisation then divides out, so its true gradient is zero."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g)
        return x * g

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (g,) = ctx.saved_tensors
        return None, torch.zeros_like(g)


class InputScale(nn.Module):
    """A scale-invariant gain on the raw inputs, in the region's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.g = _tag(nn.Parameter(torch.tensor(1.0)), "shrink")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = region_dtype(x)
        return _ZeroGradient.apply(x.to(dtype), self.g.to(dtype))


class UnitNorm(nn.Module):
    """Each row divided by its root mean square, in fp32 (an RMSNorm without weight, with
    an eps far below any value fp32 holds)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)


class ShrinkingInputMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale_in = InputScale()
        self.norm = UnitNorm()
        self.body = _body()
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.norm(self.scale_in(x))))


def _shrink_optimizer(params: Any) -> torch.optim.Optimizer:
    plain, grouped = _param_groups(params)
    groups = [
        {"params": plain, "weight_decay": 0.0},
        {"params": grouped["shrink"], "lr": 0.01, "weight_decay": SHRINK_RATE / 0.01},
    ]
    return torch.optim.AdamW(groups, lr=1e-3)


def activation_underflow() -> Task:
    """Activations that shrink until they underflow: a gain on the inputs, followed by a
    normalisation, has a zero gradient, so AdamW's weight decay shrinks it by 1.5% a
    step; fp32 and bf16 carry the tiny values through the normalisation, fp16 rounds
    them to subnormals and then to zero, and the model loses its inputs.

    Measured (2000 steps, CPU): uniform fp16 fails at step 1200/1200 (seeds 0/1; first:
    metric collapsed); bf16 holds (metric 0.972), the group in fp32 holds (0.975), fp32
    0.967.
    """
    train_data, val_data = datasets.digits()
    return Task(
        "zoo-activation-underflow",
        ShrinkingInputMLP,
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=_shrink_optimizer,
    )


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float, counter: torch.Tensor) -> torch.Tensor:
        ctx.factor, ctx.counter = factor, counter
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.counter.add_(1)
        return grad * ctx.factor, None, None


class GradientMultiplier(_StepCounted):
    """The identity forward; backward multiplies the gradient by ``exp(rate * step)``, in
    the gradient's dtype (a gradient-scaling layer on a schedule)."""

    def __init__(self, rate: float, start: float = 1.0, floor: float = 0.0) -> None:
        super().__init__()
        self.rate, self.start, self.floor = rate, start, floor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return x
        factor = max(self.floor, self.start * math.exp(self.rate * float(self.steps)))
        return _ScaledGradient.apply(x, factor, self.steps)


FREEZE_RATE = -1.0 / 40  # the early layer's gradient multiplier decays e-fold in 40 steps
FREEZE_DECAY = 2.0  # AdamW's weight decay on the encoder (0.2% a step at lr 1e-3)
FREEZE_FLOOR = 1e-12  # where it stops: fp32's Adam still squares the gradients it gives


class FreezingMLP(nn.Module):
    """An encoder whose gradient multiplier anneals towards zero (FreezeOut-style), then
    the rest of the MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(64, 64)
        _tag(self.encoder.weight, "frozen_out")
        _tag(self.encoder.bias, "frozen_out")
        self.act = nn.ReLU()
        self.freeze = GradientMultiplier(FREEZE_RATE, floor=FREEZE_FLOOR)
        self.body = _body()
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.freeze(self.act(self.encoder(x)))))


def _freeze_optimizer(params: Any) -> torch.optim.Optimizer:
    # Adam normalises the gradient's size away (eps far below it), so fp32 trains the
    # encoder whatever the multiplier; weight decay pulls it back where no gradient is.
    plain, grouped = _param_groups(params)
    groups = [
        {"params": plain, "weight_decay": 0.0},
        {"params": grouped["frozen_out"], "weight_decay": FREEZE_DECAY},
    ]
    return torch.optim.AdamW(groups, lr=1e-3, eps=1e-30)


def gradient_underflow() -> Task:
    """Gradients that shrink until they underflow, and a model that does not mind: the
    encoder's gradient multiplier decays e-fold every 40 steps down to 1e-12; Adam (eps
    1e-30) trains it on in fp32 and bf16, while in fp16 its gradients flush to zero even
    at the default loss scale and weight decay alone acts on it. Built as a fragile
    task, it measured healthy (the rest of the model makes up for the frozen encoder):
    a flush that a forecast must not call a failure.

    Measured (2000 steps, CPU): metric fp32 0.877, fp16 0.877, bf16 0.877.
    """
    train_data, val_data = datasets.digits()
    return Task(
        "zoo-gradient-underflow",
        FreezingMLP,
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=_freeze_optimizer,
    )


KERNEL_TAU = 800.0  # steps per e-fold of the annealed kernel sharpness
KERNEL_PROTOTYPES = 64
KERNEL_GAMMA0 = 0.5


def _prototypes(count: int) -> torch.Tensor:
    from autoprec.tasks.digits import digits as _digits

    x, _, _, _ = _digits()
    generator = torch.Generator().manual_seed(3)
    return x.reshape(len(x), -1)[torch.randperm(len(x), generator=generator)[:count]].clone()


class AnnealedKernel(_StepCounted):
    """Normalised RBF kernel values ``k / k.sum()`` against learned prototypes (an RBF
    network), with ``k = exp(-gamma * d^2)`` and ``gamma`` annealed upward (``exp(step /
    tau)``), computed in the region's dtype as a hand-written kernel smoother does."""

    def __init__(self) -> None:
        super().__init__()
        self.prototypes = nn.Parameter(_prototypes(KERNEL_PROTOTYPES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.steps.add_(1)
        dtype = region_dtype(x)
        x, c = x.to(dtype), self.prototypes.to(dtype)
        d2 = (x.pow(2).sum(-1, keepdim=True) - 2 * x @ c.T + c.pow(2).sum(-1)).clamp(min=0)
        gamma = KERNEL_GAMMA0 * math.exp(float(self.steps) / KERNEL_TAU)
        k = torch.exp(-gamma * d2)
        return k / k.sum(-1, keepdim=True)


class KernelClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernel = AnnealedKernel()
        self.fc = nn.Linear(KERNEL_PROTOTYPES, 64)
        self.act = nn.ReLU()
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(self.kernel(x))))


def kernel_underflow() -> Task:
    """Kernel values that underflow: an RBF kernel's sharpness is annealed upward, so a
    sample's kernel values against every prototype shrink until, in fp16, all of them
    round to zero and their normalisation is 0/0 (NaN); fp32 and bf16 hold them.

    Measured (2000 steps, CPU): uniform fp16 fails at step 766/740 (seeds 0/1; first:
    loss scale below 1); bf16 holds (metric 0.961), the group in fp32 holds (0.961),
    fp32 0.961.
    """
    train_data, val_data = datasets.digits()
    return Task("zoo-kernel-underflow", KernelClassifier, train_data, val_data, F.cross_entropy)


ATTENTION_TAU = 400.0
# Unit keys and query: |q - k|^2 is at most 4, so gamma stays below fp32's underflow
# (4 * gamma < 87) up to the horizon, while fp16's (17.3) is passed late.
ATTENTION_GAMMA0 = 25.0 * math.exp(-2000.0 / ATTENTION_TAU)


class DistanceAttention(_StepCounted):
    """Attention of a learned query over the tokens by distance between unit vectors:
    weights
    ``exp(-gamma * |q - k_j|^2)`` normalised by their sum, ``gamma`` annealed upward,
    in the region's dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(width) * 0.5)
        self.key = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.steps.add_(1)
        keys = F.normalize(self.key(x).float(), dim=-1)
        dtype = region_dtype(x)
        keys, values = keys.to(dtype), x.to(dtype)
        q = F.normalize(self.query.float(), dim=0).to(dtype)
        gamma = ATTENTION_GAMMA0 * math.exp(float(self.steps) / ATTENTION_TAU)
        weights = torch.exp(-gamma * (keys - q).pow(2).sum(-1))
        weights = weights / weights.sum(-1, keepdim=True)
        return (weights.unsqueeze(-1) * values).sum(1)


class DistanceAttentionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(datasets.SEQ_VOCAB, 16)
        self.attend = DistanceAttention(16)
        self.fc = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.head = nn.Linear(32, datasets.SEQ_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(self.attend(self.embed(tokens)))))


def attention_underflow() -> Task:
    """Attention weights that underflow: distance-based attention over a sequence with an
    annealed sharpness; in fp16 every weight of a sequence rounds to zero and their
    normalisation is 0/0 (NaN); fp32 and bf16 hold them.

    Measured (2000 steps, CPU): uniform fp16 fails at step 1589/1691 (seeds 0/1; first:
    loss scale below 1); bf16 holds (metric 1.000), the group in fp32 holds (1.000),
    fp32 1.000.
    """
    train_data, val_data = datasets.sequences()
    return Task(
        "zoo-attention-underflow",
        DistanceAttentionModel,
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
    )


# -- a loss scale that collapses ------------------------------------------------------------

GROWTH_RATE = 1.0 / 50  # the gradient multiplier grows e-fold every 50 steps


class AmplifiedGradientMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(64, 64)
        self.act = nn.ReLU()
        self.amplify = GradientMultiplier(GROWTH_RATE, start=2.0**-10)
        self.body = _body()
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.amplify(self.act(self.encoder(x)))))


def scale_collapse() -> Task:
    """A loss scale that collapses: a gradient multiplier (a gradient-reversal-style layer
    whose coefficient grows on a schedule, e-fold every 50 steps) makes the encoder's
    fp16 gradients overflow at ever lower loss scales; Adam (eps 1e-30) is blind to the
    gradient's size in fp32 and bf16, while fp16's dynamic scale falls below 1 and keeps
    falling, flushing every other gradient to zero.

    Measured (2000 steps, CPU): uniform fp16 fails at step 1038/1044 (seeds 0/1; first:
    loss scale below 1); bf16 holds (metric 0.969), the group in fp32 holds (0.964),
    fp32 0.958.
    """
    train_data, val_data = datasets.digits()
    return Task(
        "zoo-scale-collapse",
        AmplifiedGradientMLP,
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-30),
    )


# -- attention logits, residual streams and norms that grow -------------------------------

ATTENTION_UNIT = 2.0**11.5
ATTENTION_TAU = 500.0


class Scores(_StepCounted):
    """Attention logits from two inputs, ``q k^T * exp(step / tau) / sqrt(d)`` (an
    attention temperature annealed on a schedule), carrying ``ATTENTION_UNIT``: the fp16
    matmul output is what grows."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.steps.add_(1)
        factor = math.exp(float(self.steps) / ATTENTION_TAU) * ATTENTION_UNIT
        dtype = region_dtype(q)
        q = q.to(dtype) * torch.tensor(factor / math.sqrt(self.width), dtype=dtype)
        return q @ k.to(dtype).transpose(-1, -2)


class TemperedAttention(nn.Module):
    """Single-head self-attention on annealed `Scores`, the unit divided out before the
    softmax."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.scores = Scores(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.scores(self.q(x), self.k(x))
        weights = torch.softmax(logits / torch.tensor(ATTENTION_UNIT, dtype=logits.dtype), -1)
        v = self.v(x)
        return weights.to(v.dtype) @ v


class TemperedAttentionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(datasets.SEQ_VOCAB, 16)
        self.attn = TemperedAttention(16)
        self.head = nn.Linear(16, datasets.SEQ_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.embed(tokens)).mean(1))


def attention_logit_growth() -> Task:
    """Attention logits that grow: the attention's inverse temperature rises as
    ``exp(step / 500)``, so ``q k^T`` grows until the fp16 product overflows and the
    softmax returns NaN.

    Measured (2000 steps, CPU): uniform fp16 fails at step 958/1142 (seeds 0/1; first:
    non-finite loss). bf16 (0.898) and the group in fp32 (0.889) dip and end below fp32
    (0.998), but so does fp32 itself from initial weights moved one ulp: 2 of 3 such runs
    collapse by the truth's rule (at 1900 and 2000, ending at 0.871 and 0.793). The late,
    very sharp attention is chaotic; its metric cannot tell precision from chance, and
    only fp16's overflow is a failure of the dtype.
    """
    train_data, val_data = datasets.sequences()
    return Task(
        "zoo-attention-logit-growth",
        TemperedAttentionModel,
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
    )


RESIDUAL_UNIT = 2.0**11
RESIDUAL_BLOCKS = 6


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width, bias=False)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class ResidualStream(nn.Module):
    """Bias-free residual MLP blocks without normalisation (positively homogeneous): the
    inputs enter in ``RESIDUAL_UNIT`` and the head's output is divided by it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 32, bias=False)
        self.blocks = nn.Sequential(*(ResidualBlock(32) for _ in range(RESIDUAL_BLOCKS)))
        self.head = nn.Linear(32, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x * RESIDUAL_UNIT))) / RESIDUAL_UNIT


def residual_growth() -> Task:
    """A residual stream without normalisation: every block adds to the stream, and as
    Adam grows the blocks' weights the stream grows with them until fp16 overflows in the
    last blocks.

    Measured (2000 steps, CPU): uniform fp16 fails at step 607/592 (seeds 0/1; first:
    non-finite loss); bf16 holds (metric 0.978), the group in fp32 holds (0.978), fp32
    0.978.
    """
    train_data, val_data = datasets.digits()
    return Task(
        "zoo-residual-growth",
        ResidualStream,
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=lambda p: torch.optim.Adam(p, lr=2e-3),
    )


DRIFT_UNIT = 2.0**14


class DriftingMLP(nn.Module):
    """Bias-free Linear layers each followed by BatchNorm: the Linear weights are
    scale-invariant, so without weight decay their norm drifts upward as Adam steps
    along them; the inputs enter in ``DRIFT_UNIT`` (BatchNorm divides it out)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64, bias=False)
        self.bn1 = nn.BatchNorm1d(64)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(64, 64, bias=False)
        self.bn2 = nn.BatchNorm1d(64)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act1(self.bn1(self.fc1(x * DRIFT_UNIT)))
        return self.head(self.act2(self.bn2(self.fc2(h))))


def norm_drift() -> Task:
    """Norm drift without weight decay: the first Linear before a BatchNorm grows its
    weights' norm like a square root of the step (Adam, lr 1e-2, no weight decay); its
    output on raw-unit inputs passes fp16's maximum late in the run.

    Measured (2000 steps, CPU): uniform fp16 fails at step 865/950 (seeds 0/1; first:
    non-finite loss); bf16 holds (metric 0.975), the group in fp32 holds (0.930), fp32
    0.981.
    """
    train_data, val_data = datasets.digits()
    return Task(
        "zoo-norm-drift",
        DriftingMLP,
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
    )


def _fragile(
    name: str,
    mechanism: str,
    factory: Callable[[], Task],
    groups: tuple[str, ...],
    side: str = "overflow",
    fails_in: tuple[str, ...] = ("fp16",),
) -> ZooEntry:
    return ZooEntry(name, Kind.FRAGILE, mechanism, factory, groups, fails_in, side)


# Measured healthy: the encoder's fp16 gradients flush to zero, and training holds.
HOLDING = (
    ZooEntry(
        "zoo-gradient-underflow",
        Kind.HEALTHY,
        "gradients flush to zero in fp16 and training holds (annealed gradient multiplier)",
        gradient_underflow,
        ("encoder", "act", "freeze"),
    ),
)

ENTRIES = (
    _fragile("zoo-exp-growth", "exponential growth (learned logit scale)", exp_growth, ("head",)),
    _fragile("zoo-power-growth", "power-law growth (s**3 logit scale)", power_growth, ("head",)),
    _fragile("zoo-sqrt-growth", "square-root-like growth", sqrt_growth, ("head",)),
    _fragile("zoo-linear-growth", "linear growth", linear_growth, ("head",)),
    _fragile(
        "zoo-warmup-growth",
        "growth that starts after a warm-up the model schedules itself (no learning-rate change)",
        warmup_growth,
        ("head",),
    ),
    _fragile(
        "zoo-lr-warmup-growth",
        "growth that starts when the learning rate's warm-up ends",
        lr_warmup_growth,
        ("head",),
    ),
    _fragile(
        "zoo-activation-underflow",
        "activations shrinking to underflow (weight decay on a scale-invariant gain)",
        activation_underflow,
        ("scale_in",),
        "underflow",
    ),
    _fragile(
        "zoo-kernel-underflow",
        "kernel values underflowing (annealed RBF sharpness)",
        kernel_underflow,
        ("kernel",),
        "underflow",
    ),
    _fragile(
        "zoo-attention-underflow",
        "attention weights underflowing (annealed distance attention)",
        attention_underflow,
        ("attend",),
        "underflow",
    ),
    _fragile(
        "zoo-scale-collapse",
        "a loss scale that collapses (growing gradient multiplier)",
        scale_collapse,
        ("encoder", "act", "amplify"),
        "underflow",
    ),
    _fragile(
        "zoo-attention-logit-growth",
        "attention logits that grow (annealed temperature)",
        attention_logit_growth,
        ("attn",),
    ),
    _fragile(
        "zoo-residual-growth",
        "a residual stream without normalisation",
        residual_growth,
        ("blocks", "embed", "head"),
    ),
    _fragile("zoo-norm-drift", "norm drift without weight decay", norm_drift, ("fc1", "bn1")),
)
