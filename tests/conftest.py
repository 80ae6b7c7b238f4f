"""Shared fixtures: a tiny task built only against the public Task contract."""

from __future__ import annotations

from collections import OrderedDict

import pytest
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
        g = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(384, generator=g)
            for i in range(0, 384 - 32 + 1, 32):
                index = order[i : i + 32]
                yield inputs[index], labels[index]

    def val_data():
        return [(inputs[384:], labels[384:])]

    return autoprec.Task(name, model, train_data, val_data, F.cross_entropy)


@pytest.fixture
def tiny_task() -> autoprec.Task:
    return make_tiny_task()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty folder, so the default stores land under tmp_path/runs."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
    """A small real search (5 trials) on sqlite stores in its own folder."""
    folder = tmp_path_factory.mktemp("search")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        result = autoprec.search(make_tiny_task(), trials=5, steps=12, study="tiny", device="cpu")
    return folder, result
