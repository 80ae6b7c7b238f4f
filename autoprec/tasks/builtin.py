"""Built-in tasks on scikit-learn's bundled digits data (8x8 images, 10 classes).

No downloads: the data ships inside scikit-learn. The split and the batch order are
fixed by seeds, so every trial of a search sees the same data in the same order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import cache

import torch
from torch import nn
from torch.nn import functional as F

from autoprec.tasks.base import Batch, Task

BATCH_SIZE = 64
VAL_SHARE = 0.2


@cache
def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images / 16.0, dtype=torch.float32)  # values in [0, 1]
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_val = int(len(labels) * VAL_SHARE)
    val, train = order[:n_val], order[n_val:]
    return images[train], labels[train], images[val], labels[val]


def _batches(
    inputs: torch.Tensor, targets: torch.Tensor, seed: int, batch_size: int
) -> Iterator[Batch]:
    """Shuffled batches, a new permutation every epoch, forever."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(targets), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            yield inputs[index], targets[index]


def digits_data(
    flatten: bool, input_scale: float = 1.0, batch_size: int = BATCH_SIZE
) -> tuple[Callable[[int], Iterator[Batch]], Callable[[], list[Batch]]]:
    """train_data and val_data callables for the digits split, as flat vectors or images,
    with pixel values in [0, input_scale]."""

    def shape(images: torch.Tensor) -> torch.Tensor:
        images = images * input_scale
        return images.reshape(len(images), -1) if flatten else images.unsqueeze(1)

    def train_data(seed: int) -> Iterator[Batch]:
        x, y, _, _ = _digits()
        return _batches(shape(x), y, seed, batch_size)

    def val_data() -> list[Batch]:
        _, _, x, y = _digits()
        x = shape(x)
        return [(x[i : i + 256], y[i : i + 256]) for i in range(0, len(y), 256)]

    return train_data, val_data


def mlp(hidden: int = 256) -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(64, hidden),
            norm1=nn.LayerNorm(hidden),
            act1=nn.ReLU(),
            fc2=nn.Linear(hidden, hidden),
            norm2=nn.LayerNorm(hidden),
            act2=nn.ReLU(),
            head=nn.Linear(hidden, 10),
        )
    )


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head for 8x8 single-channel images."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(2 * width * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.head(torch.flatten(x, 1))


def digits_mlp() -> Task:
    """The default task: a 3-layer MLP with LayerNorm on flattened digits."""
    train_data, val_data = digits_data(flatten=True)
    return Task("digits-mlp", mlp, train_data, val_data, F.cross_entropy)


def digits_cnn() -> Task:
    """A small CNN with BatchNorm on 8x8 digit images."""
    train_data, val_data = digits_data(flatten=False)
    return Task("digits-cnn", SmallCNN, train_data, val_data, F.cross_entropy)


# -- fragile tasks: real failure mechanisms of plain fp16, trainable in fp32 and bf16 ---

RAW_SENSOR_SCALE = 1023.0  # raw 10-bit sensor counts instead of values in [0, 1]
SMALL_LOSS_WEIGHT = 2.0**-20  # a loss weighted this low has gradients below fp16's range
FRAGILE_BATCH = 256


class QuadraticFeatures(nn.Module):
    """A projection followed by its square (an energy feature): on raw inputs in the
    hundreds, the squares reach ~1e5, past fp16's largest value 65504."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h * h


def overflow_mlp(hidden: int = 256) -> nn.Module:
    """Quadratic features of unnormalised inputs, a LayerNorm, then an MLP."""
    return nn.Sequential(
        OrderedDict(
            features=QuadraticFeatures(64, 64),
            norm_in=nn.LayerNorm(64),
            fc1=nn.Linear(64, hidden),
            act1=nn.ReLU(),
            fc2=nn.Linear(hidden, hidden),
            act2=nn.ReLU(),
            head=nn.Linear(hidden, 10),
        )
    )


def digits_overflow() -> Task:
    """Overflow: on raw 10-bit inputs the quadratic features pass 65504.

    Uniform fp16 produces inf in ``features`` (its ``h * h``) and diverges whatever the scale
    (the overflow is in the forward pass); keeping that layer in fp32 or bf16 (fp32's
    range) fixes it while the layers behind the LayerNorm run in fp16.
    """
    train_data, val_data = digits_data(
        flatten=True, input_scale=RAW_SENSOR_SCALE, batch_size=FRAGILE_BATCH
    )
    return Task("digits-overflow", overflow_mlp, train_data, val_data, F.cross_entropy)


def _small_weight_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets) * SMALL_LOSS_WEIGHT


def _adam_small_eps(params: object) -> torch.optim.Optimizer:
    # Adam normalises gradient size away, so fp32 trains on a tiny loss as on a plain one
    # once eps is below the gradients' magnitude.
    return torch.optim.Adam(params, lr=1e-3, eps=1e-20)  # type: ignore[arg-type]


def digits_underflow() -> Task:
    """Underflow: a loss weighted by 2**-20 puts the gradients near 1e-9, under fp16's
    smallest subnormal (6e-8).

    Uniform fp16 without loss scaling flushes them to zero and stops learning; a loss
    scale of 2**10 or more, or bf16 (fp32's range), trains as fp32 does.
    """
    train_data, val_data = digits_data(flatten=True, batch_size=FRAGILE_BATCH)
    return Task(
        "digits-underflow",
        lambda: mlp(256),
        train_data,
        val_data,
        _small_weight_loss,
        optimizer=_adam_small_eps,
    )


BUILTIN_TASKS: dict[str, Callable[[], Task]] = {
    "digits-mlp": digits_mlp,
    "digits-cnn": digits_cnn,
    "digits-overflow": digits_overflow,
    "digits-underflow": digits_underflow,
}
DEFAULT_TASK = "digits-mlp"
