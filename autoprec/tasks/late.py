"""A late-failure task: activations that grow from ordinary training dynamics until fp16
overflows, long after a short trial has ended.

A classifier divides its logits by a large fixed temperature (as a calibrated or
distilled head does) and has no normalisation in the way. To become confident it must
grow the head's raw outputs by four orders of magnitude; Adam's steady steps (about
``lr`` per weight per step, whatever the gradient's size) grow fc1, fc2 and the head
together, so the head's largest output grows as a power of the step. Nothing counts
steps: the growth is the loss being minimised. fp32 and bf16 (fp32's range) train on;
uniform fp16 survives the default trial (200 steps) and its head overflows 65504 a few
hundred steps later, well before five times the trial.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F

from autoprec.tasks.base import Task
from autoprec.tasks.digits import digits_data

LATE_TEMPERATURE = 1e4  # logits = head output / temperature
LATE_HIDDEN = 128
LATE_LR = 2e-3


class TemperedMLP(nn.Module):
    """fc1, fc2 and a head with ReLUs and no normalisation; the head's outputs are divided
    by ``LATE_TEMPERATURE`` in the root's forward, so they are the values that grow."""

    def __init__(self, hidden: int = LATE_HIDDEN) -> None:
        super().__init__()
        self.body = nn.Sequential(
            OrderedDict(
                fc1=nn.Linear(64, hidden),
                act1=nn.ReLU(),
                fc2=nn.Linear(hidden, hidden),
                act2=nn.ReLU(),
            )
        )
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) / LATE_TEMPERATURE


def _adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LATE_LR)  # type: ignore[arg-type]


def late_overflow() -> Task:
    """Late overflow: the head's outputs grow under training and pass fp16's 65504 after
    the trial has ended (see the module's docstring)."""
    train_data, val_data = digits_data(flatten=True)
    return Task(
        "late-overflow", TemperedMLP, train_data, val_data, F.cross_entropy, optimizer=_adam
    )
