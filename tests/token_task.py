"""A token's class from its embedding, trained with AdamW: the smallest task whose
optimizer states torchao and bitsandbytes quantise (the embedding and the first Linear
weight have 4,096 elements, their minimum). A file of its own, so that a subprocess can
name it as ``tests/token_task.py:token_task``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import autoprec


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def token_task(optimizer: Callable[[Any], torch.optim.Optimizer] = adamw) -> autoprec.Task:
    """64 tokens, each embedded 64 wide, in 4 classes."""
    generator = torch.Generator().manual_seed(2)
    classes = torch.randint(0, 4, (64,), generator=generator)

    def model() -> nn.Module:
        return nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def train_data(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        while True:
            tokens = torch.randint(0, 64, (32,), generator=g)
            yield tokens, classes[tokens]

    def val_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
        tokens = torch.arange(64)
        return [(tokens, classes[tokens])]

    return autoprec.Task(
        "tokens", model, train_data, val_data, F.cross_entropy, optimizer=optimizer
    )
