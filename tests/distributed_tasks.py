"""Tiny tasks for trials across ranks, loaded by the ranks torchrun starts
(``tests/distributed_tasks.py:attr``), so this file imports nothing from the tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import autoprec

BATCH = 8  # global batch; divides by 2 ranks
INJECT_AT_FORWARD = 3  # the training forward on rank 1 whose gradients get an inf


class Block(nn.Module):
    def __init__(self, width: int, linear: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        self.fc = linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class _InfInGradient(torch.autograd.Function):
    """Identity forward; backward puts an inf in row 0 of the gradient only."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad


class PoisonedLinear(nn.Linear):
    """A Linear whose weight gradient gets one inf on rank 1, on one training forward:
    under FSDP2 it lands in rank 0's shard only (rows are sharded), so the ranks' own
    found-inf flags differ unless they are all-reduced. It counts its own training forwards:
    the copies autocast's probe runs alone (`autoprec.numerics.observe.probe`) count theirs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank == 1 and self.calls == INJECT_AT_FORWARD:
                weight = _InfInGradient.apply(weight)
        return F.linear(x, weight, self.bias)


class Net(nn.Module):
    def __init__(self, width: int = 16, poisoned: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        first = PoisonedLinear if poisoned else nn.Linear
        self.blocks = nn.Sequential(Block(width, first), Block(width))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.inp(x))))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    centers = torch.randn(4, 8, generator=generator) * 2.0
    labels = torch.randint(0, 4, (128,), generator=generator)
    return centers[labels] + torch.randn(128, 8, generator=generator), labels


def _task(name: str, poisoned: bool = False, width: int = 16) -> autoprec.Task:
    inputs, labels = _data()

    def train_data(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(96, generator=torch.Generator().manual_seed(seed))
        while True:
            for start in range(0, 96, BATCH):
                index = order[start : start + BATCH]
                yield inputs[index], labels[index]

    def val_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(inputs[96:112], labels[96:112]), (inputs[112:], labels[112:])]

    return autoprec.Task(
        name,
        lambda: Net(width, poisoned=poisoned),
        train_data,
        val_data,
        F.cross_entropy,
    )


def blocks() -> autoprec.Task:
    """Two residual blocks between an input layer and a head."""
    return _task("blocks")


def poisoned() -> autoprec.Task:
    """`blocks`, with one inf in rank 1's gradients on one step."""
    return _task("poisoned", poisoned=True)


def wide() -> autoprec.Task:
    """`blocks` at width 128: each block's weight (16,384 elements, 8,192 per rank under
    FSDP2) is large enough for torchao to quantise its optimizer state."""
    return _task("wide", width=128)
