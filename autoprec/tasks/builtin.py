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


def _batches(inputs: torch.Tensor, targets: torch.Tensor, seed: int) -> Iterator[Batch]:
    """Shuffled batches, a new permutation every epoch, forever."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(targets), generator=generator)
        for start in range(0, len(order) - BATCH_SIZE + 1, BATCH_SIZE):
            index = order[start : start + BATCH_SIZE]
            yield inputs[index], targets[index]


def digits_data(
    flatten: bool,
) -> tuple[Callable[[int], Iterator[Batch]], Callable[[], list[Batch]]]:
    """train_data and val_data callables for the digits split, as flat vectors or images."""

    def shape(images: torch.Tensor) -> torch.Tensor:
        return images.reshape(len(images), -1) if flatten else images.unsqueeze(1)

    def train_data(seed: int) -> Iterator[Batch]:
        x, y, _, _ = _digits()
        return _batches(shape(x), y, seed)

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


BUILTIN_TASKS: dict[str, Callable[[], Task]] = {
    "digits-mlp": digits_mlp,
    "digits-cnn": digits_cnn,
}
DEFAULT_TASK = "digits-mlp"
