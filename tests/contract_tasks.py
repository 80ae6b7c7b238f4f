"""Tasks written only against the public Task contract. Worker processes and separate
commands load them by file path (``tests/contract_tasks.py:attr``), so this file imports
nothing from the tests."""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F

import autoprec


def make_tiny_task(name: str = "tiny", hidden: int = 32) -> autoprec.Task:
    """Four Gaussian blobs in 16 dimensions: learnable in a few dozen steps."""
    generator = torch.Generator().manual_seed(1)
    centers = torch.randn(4, 16, generator=generator) * 2.0
    labels = torch.randint(0, 4, (512,), generator=generator)
    inputs = centers[labels] + torch.randn(512, 16, generator=generator)

    def model() -> nn.Module:
        return nn.Sequential(
            OrderedDict(
                fc1=nn.Linear(16, hidden),
                norm=nn.LayerNorm(hidden),
                act=nn.ReLU(),
                head=nn.Linear(hidden, 4),
            )
        )

    def train_data(seed: int):
        return _epochs(inputs, labels, seed)

    def val_data():
        return [(inputs[384:], labels[384:])]

    return autoprec.Task(name, model, train_data, val_data, F.cross_entropy)


class Pause(nn.Module):
    """Sleeps on every forward pass: a trial long enough to be killed in the middle."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class Trap(nn.Module):
    """A layer that fails in the way real trials fail, by the dtype it runs in: under
    fp16 autocast it hangs, under bf16 it runs out of memory."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            if dtype == torch.float16:
                while True:  # a hang: only the per-trial time limit ends it
                    time.sleep(0.05)
            if dtype == torch.bfloat16:
                raise torch.OutOfMemoryError("tried to allocate 80.00 GiB")
        return self.inner(x)


class Boom(nn.Module):
    """Raises under fp16 autocast (the head's group decides)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if out.dtype == torch.float16:
            raise RuntimeError("boom: a bug that shows only in fp16")
        return out


def tiny() -> autoprec.Task:
    return make_tiny_task("tiny")


def slow_tiny() -> autoprec.Task:
    task = make_tiny_task("slow-tiny")
    build = task.model

    def model() -> nn.Module:
        net = build()
        net.add_module("pause", Pause(0.05))
        return net

    task.model = model
    return task


def trapped() -> autoprec.Task:
    task = make_tiny_task("trapped")
    build = task.model

    def model() -> nn.Module:
        net = build()
        net.fc1 = Trap(net.fc1)
        net.head = Boom(net.head)
        return net

    task.model = model
    return task


def make_lstm_task(name: str = "lstm") -> autoprec.Task:
    """Embedding + LSTM over token sequences: is token 3 in the sequence? On the CPU,
    oneDNN's LSTM runs in fp16 or bf16 only on inputs already in that dtype, and the
    embedding before it always hands it fp32."""
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, 32, (512, 12), generator=generator)
    labels = torch.randint(0, 2, (512,), generator=generator)
    where = torch.randint(0, 12, (512,), generator=generator)
    tokens[labels == 1, where[labels == 1]] = 3

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.lstm = nn.LSTM(16, 32, batch_first=True)
            self.head = nn.Linear(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(self.embed(x))
            return self.head(out.max(dim=1).values)

    return autoprec.Task(
        name,
        Net,
        lambda seed: _epochs(tokens, labels, seed),
        lambda: [(tokens[384:], labels[384:])],
        F.cross_entropy,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
    )


def _epochs(inputs: torch.Tensor, labels: torch.Tensor, seed: int):
    """Batches of 32 from the first 384 examples, reshuffled each epoch, for ever."""
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(384, generator=g)
        for i in range(0, 384 - 32 + 1, 32):
            index = order[i : i + 32]
            yield inputs[index], labels[index]


def scheduled() -> autoprec.Task:
    """The tiny task with a learning-rate warm-up over its first 50 steps (a scheduler)."""
    task = make_tiny_task("scheduled")
    task.scheduler = lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50)
    )
    return task
