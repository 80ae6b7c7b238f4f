"""A task that fails late in fp16 by underflow, and only there (tests of the long
confirmation, `autoprec.study.confirm`). Imports nothing from the tests, so that a
separate command can load it by path (``tests/underflow_task.py:underflow_task``).

Mechanism: a soft assignment of features to fixed centroids by a Gaussian kernel whose
width anneals with training (a temperature schedule, to a floor), normalised as
``k / k.sum()`` in fp32. The kernel's values ``exp(-d2 / width)`` shrink as the width
does: in fp16 they flush to zero once ``d2 / width`` passes about 17 (fp16's smallest
subnormal is 6e-8), and a row whose values all flushed divides 0 by 0. In bf16 and fp32
(smallest normal 1e-38) the floor's ``exp(-d2 / width)`` is far from zero, so both train on.
The kernel's own output is where the flush starts; the first non-finite output is the
head's, after the division.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import autoprec

CENTROIDS = 8
DECAY = 0.975  # the width's anneal per training step
FLOOR = 1 / 40  # the width's floor, as a share of its start


class Kernel(nn.Module):
    """Gaussian kernel values of features against fixed centroids, the width annealed on
    every training forward from ``start`` down to ``start * FLOOR``."""

    def __init__(self, dim: int, start: float) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        centroids = torch.randn(CENTROIDS, dim, generator=generator)
        self.register_buffer("centroids", centroids / centroids.norm(dim=1, keepdim=True))
        self.register_buffer("width", torch.tensor(start))
        self.floor = start * FLOOR

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.width.copy_(torch.clamp(self.width * DECAY, min=self.floor))
        with torch.no_grad():  # a hard assignment's weights: no gradient through them
            unit = h / (h.norm(dim=1, keepdim=True) + 1e-3)
            d2 = ((unit[:, None, :] - self.centroids[None].to(h.dtype)) ** 2).sum(-1)
            return torch.exp(-d2 / self.width.to(h.dtype))


class Assign(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.kernel = Kernel(32, start=1.0)
        self.mix = nn.Linear(CENTROIDS, 16)
        self.head = nn.Linear(32 + 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        k = self.kernel(h).float()
        weights = k / k.sum(dim=1, keepdim=True)  # 0/0 where a row flushed
        return self.head(torch.cat([h, self.mix(weights).to(h.dtype)], dim=1))


def underflow_task(name: str = "late-underflow") -> autoprec.Task:
    """Four Gaussian blobs in 16 dimensions, classified through the annealed kernel."""
    generator = torch.Generator().manual_seed(1)
    centers = torch.randn(4, 16, generator=generator) * 2.0
    labels = torch.randint(0, 4, (512,), generator=generator)
    inputs = centers[labels] + torch.randn(512, 16, generator=generator)

    def train_data(seed: int):
        order_generator = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(384, generator=order_generator)
            for i in range(0, 384, 64):
                yield inputs[order[i : i + 64]], labels[order[i : i + 64]]

    return autoprec.Task(
        name,
        Assign,
        train_data,
        lambda: [(inputs[384:], labels[384:])],
        F.cross_entropy,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
    )
