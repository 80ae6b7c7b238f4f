"""Tasks whose modules meet other dtypes at their borders in every way real code does:
custom modules that ``torch.cat``, ``stack``, ``einsum`` or ``matmul`` their inputs with
other tensors, residual adds across dtypes, several inputs (positional, keyword, tuples,
dicts) and nested outputs; beside them an LSTM, a GRU, a CNN with BatchNorm and tiny
transformers. Written only against the Task contract, imported by the boundary and dtype
truth tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import autoprec
from autoprec import Policy, Rule
from autoprec.policy import parameterised_leaves

WIDTH = 16


class CatMix(nn.Module):
    """Joins its input with its own projection (``torch.cat``), as rotary embeddings and
    DenseNet blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([x, self.proj(x)], dim=-1))


class StackMix(nn.Module):
    """Stacks its input with two projections and averages them (``torch.stack``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x, self.a(x), self.b(x)]).mean(dim=0)


class EinsumAttention(nn.Module):
    """Attention over its input written with ``einsum`` and ``matmul``: the values are
    the input itself, beside the projections' queries and keys."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bsd,btd->bst", self.q(x), self.k(x)) / WIDTH**0.5
        return torch.matmul(scores.softmax(dim=-1), x)


class Residual(nn.Module):
    """``x + f(x)``: the add meets the input's dtype and the branch's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Gated(nn.Module):
    """A leaf with parameters of its own and no autocast op: ``x * sigmoid(gate)`` plus a
    bias, concatenated with its input and folded back."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(WIDTH))
        self.bias = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = torch.cat([x, x * torch.sigmoid(self.gate) + self.bias], dim=-1)
        return both[..., :WIDTH] + both[..., WIDTH:]


class TwoInputs(nn.Module):
    """Several inputs: a positional pair (a tuple), a keyword tensor and a dict; returns
    a dict and a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.mix = nn.Linear(2 * WIDTH, WIDTH)

    def forward(
        self, pair: tuple[torch.Tensor, torch.Tensor], *, context: torch.Tensor, extra: dict
    ) -> dict[str, Any]:
        left, right = pair
        joined = torch.cat([left, right + context, extra["bias"].expand_as(left)], dim=-1)
        mixed = self.mix(joined[..., : 2 * WIDTH]) + self.fc(left)
        return {"hidden": mixed, "parts": (left, torch.stack([right, context]).sum(0))}


class BoundaryNet(nn.Module):
    """Every kind of border above in one model, each custom module between layers that a
    random policy may put in the other low dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.cat = CatMix()
        self.stack = StackMix()
        self.attn = EinsumAttention()
        self.res = Residual()
        self.gated = Gated()
        self.side = nn.Linear(WIDTH, WIDTH)
        self.two = TwoInputs()
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.attn(self.stack(self.cat(h)))
        h = self.gated(self.res(h))
        side = self.side(h)
        out = self.two((h, side), context=h * 0.5, extra={"bias": side.mean(dim=1, keepdim=True)})
        h = out["hidden"] + out["parts"][1]
        return self.head(self.norm(h).mean(dim=1))


def _sequence_task(name: str, model: Callable[[], nn.Module], vocab: int = 0) -> autoprec.Task:
    generator = torch.Generator().manual_seed(3)
    if vocab:
        inputs: torch.Tensor = torch.randint(0, vocab, (256, 10), generator=generator)
        labels = (inputs[:, 0] % 3).long()
    else:
        inputs = torch.randn(256, 10, 8, generator=generator)
        labels = (inputs[:, 0, 0] > 0).long() + (inputs[:, 1, 1] > 0).long()

    def train_data(seed: int):
        g = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(192, generator=g)
            for i in range(0, 192, 32):
                yield inputs[order[i : i + 32]], labels[order[i : i + 32]]

    return autoprec.Task(
        name, model, train_data, lambda: [(inputs[192:], labels[192:])], F.cross_entropy
    )


def boundary_task() -> autoprec.Task:
    return _sequence_task("boundaries", BoundaryNet)


class RecurrentNet(nn.Module):
    """Embedding, LSTM, GRU, head: oneDNN's recurrent kernels on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(tokens))
        h, _ = self.gru(h)
        return self.head(h[:, -1])


def recurrent_task() -> autoprec.Task:
    return _sequence_task("recurrent", RecurrentNet, vocab=32)


class ConvNet(nn.Module):
    """Convolutions with BatchNorm and a skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(10, WIDTH, 3, padding=1)
        self.bn1 = nn.BatchNorm1d(WIDTH)
        self.conv2 = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.bn2 = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = h + F.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean(dim=-1))


def conv_task() -> autoprec.Task:
    return _sequence_task("conv-bn", ConvNet)


def random_mixed_policies(model: nn.Module, count: int, seed: int) -> list[Policy]:
    """``count`` policies that put each leaf with parameters in fp16 or bf16 at random
    (now and then fp32), under a random default, so that fp16 and bf16 layers meet."""
    leaves = [name for name, _ in parameterised_leaves(model)]
    rng = random.Random(seed)
    policies = []
    for index in range(count):
        rules = []
        for dtype in ("fp16", "bf16", "fp32"):
            weight = 0.15 if dtype == "fp32" else 0.45
            chosen = tuple(name for name in leaves if rng.random() < weight)
            if chosen:
                rules.append(Rule(dtype, patterns=chosen))
        default = rng.choice(("fp16", "bf16"))
        policies.append(Policy(rules=tuple(rules), default=default, name=f"random-{index}"))
    return policies
