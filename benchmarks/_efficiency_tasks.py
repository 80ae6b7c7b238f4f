"""Tasks for the search-efficiency benchmark: small enough to enumerate every policy.

Each has seven layer groups searched over {fp32, fp16} (an Ascend 910A has no bf16),
with dynamic loss scaling fixed, so its space holds 2**7 = 128 policies. Each carries a
real fp16 hazard on raw (unnormalised) sensor inputs that only some groups may run in
fp32 to survive; the rest of the model trains in fp16 as well as in fp32.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from autoprec.space import SearchSpace
from autoprec.tasks import Task
from autoprec.tasks.builtin import QuadraticFeatures, digits_data

RAW_10_BIT = 1023.0  # raw 10-bit sensor counts instead of values in [0, 1]
RAW_12_BIT = 4095.0
LEARNING_RATE = 1e-2
ACCURACY_TOLERANCE = 0.02


class Interaction(nn.Module):
    """Pairwise interactions of two projections (as in factorisation machines): on raw
    inputs in the hundreds each projection is in the hundreds and their product passes
    fp16's largest value 65504."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.left = nn.Linear(in_features, out_features)
        self.right = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) * self.right(x)


class RawSensorMLP(nn.Module):
    """Energy and interaction features of raw counts, a LayerNorm, then a deep MLP."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.energy = QuadraticFeatures(64, 32)
        self.interact = Interaction(64, 32)
        self.norm = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.fc4 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.cat([self.energy(x), self.interact(x)], dim=-1))
        for layer in (self.fc1, self.fc2, self.fc3, self.fc4):
            h = F.relu(layer(h))
        return self.head(h)


class AttentionWeights(nn.Module):
    """Softmax of scaled query-key products. On unnormalised embeddings of raw counts
    the logits reach ~1e6: inf in fp16, a NaN softmax."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.query(x) @ self.key(x).transpose(-2, -1) / math.sqrt(x.shape[-1])
        return torch.softmax(logits.float(), dim=-1)


class RawTokenAttention(nn.Module):
    """A one-block transformer over the 8 rows of an 8x8 image (8 tokens of 8 raw counts),
    with the attention on the raw embeddings (no norm before it) and a pre-norm MLP."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.scores = AttentionWeights(dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.head = nn.Linear(8 * dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(len(x), 8, 8))
        h = self.norm1(h + self.out(self.scores(h).to(h.dtype) @ self.value(h)))
        h = self.norm2(h + self.fc2(F.relu(self.fc1(h))))
        return self.head(h.flatten(1))


def _adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LEARNING_RATE)  # type: ignore[arg-type]


def _task(name: str, model: Callable[[], nn.Module], input_scale: float, batch_size: int) -> Task:
    train_data, val_data = digits_data(flatten=True, input_scale=input_scale, batch_size=batch_size)
    return Task(name, model, train_data, val_data, F.cross_entropy, optimizer=_adam)


def raw_sensor_mlp() -> Task:
    return _task("raw-sensor-mlp", RawSensorMLP, RAW_10_BIT, 256)


def raw_token_attention() -> Task:
    return _task("raw-token-attention", RawTokenAttention, RAW_12_BIT, 128)


def fp16_space(name: str, groups: list[str]) -> SearchSpace:
    """Each named group on its own, fp32 or fp16, dynamic loss scaling as torch's
    GradScaler does it (nothing of it searched)."""
    return SearchSpace.from_dict(
        {
            "name": name,
            "accuracy_tolerance": ACCURACY_TOLERANCE,
            "dtypes": ["fp32", "fp16"],
            "groups": [{"name": g, "patterns": [g]} for g in groups],
            "loss_scale": {"modes": ["dynamic"]},
        },
        f"<{name}>",
    )


TASKS: dict[str, tuple[Callable[[], Task], list[str]]] = OrderedDict(
    {
        "raw-sensor-mlp": (
            raw_sensor_mlp,
            ["energy", "interact", "fc1", "fc2", "fc3", "fc4", "head"],
        ),
        "raw-token-attention": (
            raw_token_attention,
            ["embed", "scores", "value", "out", "fc1", "fc2", "head"],
        ),
    }
)


def task_and_space(name: str) -> tuple[Task, SearchSpace]:
    make, groups = TASKS[name]
    return make(), fp16_space(name, groups)
