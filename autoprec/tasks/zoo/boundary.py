"""Mixed-boundary zoo tasks: custom modules whose inputs cross dtypes under a mixed
fp16/bf16 policy. Each trains in fp32, fp16 and bf16 alike; what they test is that a
policy putting the custom module in one low-precision dtype and its neighbours in the
other runs at all (the shapes that crashed with ``Unexpected floating ScalarType in
at::autocast::prioritize``): ``torch.cat``, ``torch.stack``, ``einsum`` and ``matmul``
on a module's inputs, several inputs, and residual adds across dtypes.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from autoprec.tasks.base import Task
from autoprec.tasks.zoo import datasets
from autoprec.tasks.zoo._entry import Kind, ZooEntry


def _weight(out_features: int, in_features: int) -> nn.Parameter:
    weight = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return nn.Parameter(weight)


class ConcatLinear(nn.Module):
    """A leaf with its own weights: concatenates its input with a learned context vector
    (``torch.cat``) and projects the result."""

    def __init__(self, in_features: int, context: int, out_features: int) -> None:
        super().__init__()
        self.context = nn.Parameter(torch.randn(context) * 0.1)
        self.weight = _weight(out_features, in_features + context)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([x, self.context.expand(x.shape[0], -1)], dim=-1)
        return F.linear(joined, self.weight, self.bias)


class ConcatModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(64, 32)
        self.act = nn.ReLU()
        self.fuse = ConcatLinear(32, 8, 32)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fuse(self.act(self.encoder(x)))))


def cat_boundary() -> Task:
    """A custom module that ``torch.cat``s its input with a learned context vector.

    Measured (2000 steps, CPU): metric fp32 0.967, fp16 0.967, bf16 0.967; mixed
    bf16+boundary-fp16: crash, fp16+boundary-bf16: crash.
    """
    train_data, val_data = datasets.digits()
    return Task("zoo-cat-boundary", ConcatModel, train_data, val_data, F.cross_entropy)


class BilinearMix(nn.Module):
    """A leaf with two inputs combined by ``einsum`` through its own weight tensor."""

    def __init__(self, left: int, right: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, left, right) / math.sqrt(left * right))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,oij,bj->bo", a, self.weight, b) + self.bias


class TwoBranchModel(nn.Module):
    """Two branches over halves of the input, joined by a bilinear ``einsum``."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(32, 16)
        self.right = nn.Linear(32, 16)
        self.mix = BilinearMix(16, 16, 32)
        self.act = nn.ReLU()
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.tanh(self.left(x[:, :32])), torch.tanh(self.right(x[:, 32:]))
        return self.head(self.act(self.mix(a, b)))


def einsum_boundary() -> Task:
    """A custom module with two inputs from two branches, joined by ``einsum``.

    Measured (2000 steps, CPU): metric fp32 0.953, fp16 0.953, bf16 0.955; mixed
    bf16+boundary-fp16: trains, fp16+boundary-bf16: trains.
    """
    train_data, val_data = datasets.digits()
    return Task("zoo-einsum-boundary", TwoBranchModel, train_data, val_data, F.cross_entropy)


class GatedStack(nn.Module):
    """A leaf that ``torch.stack``s its several inputs and mixes them with learned,
    softmax-normalised gates."""

    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.gates = nn.Parameter(torch.zeros(inputs))

    def forward(self, *branches: torch.Tensor) -> torch.Tensor:
        stacked = torch.stack(branches, dim=0)
        weights = torch.softmax(self.gates, 0).to(stacked.dtype)
        return torch.einsum("k,k...->...", weights, stacked)


class StackModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branch1 = nn.Linear(64, 32)
        self.branch2 = nn.Linear(64, 32)
        self.branch3 = nn.Linear(64, 32)
        self.mixture = GatedStack(3)
        self.act = nn.ReLU()
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.mixture(self.branch1(x), self.branch2(x), self.branch3(x))
        return self.head(self.act(mixed))


def stack_boundary() -> Task:
    """A custom module that ``torch.stack``s three branches' outputs (several inputs).

    Measured (2000 steps, CPU): metric fp32 0.975, fp16 0.975, bf16 0.975; mixed
    bf16+boundary-fp16: crash, fp16+boundary-bf16: crash.
    """
    train_data, val_data = datasets.digits()
    return Task("zoo-stack-boundary", StackModel, train_data, val_data, F.cross_entropy)


class Attention(nn.Module):
    """A leaf taking queries and keys/values as separate inputs: ``matmul`` of its inputs
    with its own projections, softmax, ``matmul`` with the values."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.wq = _weight(width, width)
        self.wk = _weight(width, width)
        self.width = width

    def forward(self, queries: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        q, k = queries @ self.wq.T, memory @ self.wk.T
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.width), dim=-1)
        return weights @ memory


class ResidualAttentionModel(nn.Module):
    """Embeddings, a cross-attention leaf over the sequence, a residual add of the
    attention's output to the embeddings (across dtypes when they differ), mean pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(datasets.SEQ_VOCAB, 16)
        self.queries = nn.Linear(16, 16)
        self.attend = Attention(16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, datasets.SEQ_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attend(self.queries(x), x)
        return self.head(self.norm(x).mean(1))


def matmul_residual_boundary() -> Task:
    """A custom attention leaf with two inputs (``matmul`` on both) and a residual add of
    its output to a tensor from another region.

    Measured (2000 steps, CPU): metric fp32 1.000, fp16 1.000, bf16 1.000; mixed
    bf16+boundary-fp16: trains, fp16+boundary-bf16: trains.
    """
    train_data, val_data = datasets.sequences()
    return Task(
        "zoo-matmul-residual-boundary",
        ResidualAttentionModel,
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
    )


def _boundary(name: str, mechanism: str, factory: object, groups: tuple[str, ...]) -> ZooEntry:
    return ZooEntry(name, Kind.BOUNDARY, mechanism, factory, groups)  # type: ignore[arg-type]


ENTRIES = (
    _boundary("zoo-cat-boundary", "torch.cat of a module's input", cat_boundary, ("fuse",)),
    _boundary(
        "zoo-einsum-boundary", "einsum of two inputs from two branches", einsum_boundary, ("mix",)
    ),
    _boundary("zoo-stack-boundary", "torch.stack of several inputs", stack_boundary, ("mixture",)),
    _boundary(
        "zoo-matmul-residual-boundary",
        "matmul of two inputs, residual add across dtypes",
        matmul_residual_boundary,
        ("attend",),
    ),
)
