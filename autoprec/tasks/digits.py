"""The digits data set (scikit-learn's 8x8 handwritten digits) as the built-in tasks and
the task zoo batch it: a fixed split, shuffled batches forever, flat or as images."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache

import torch

Batch = tuple[torch.Tensor, torch.Tensor]

BATCH_SIZE = 64
VAL_SHARE = 0.2


@cache
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images / 16.0, dtype=torch.float32)  # values in [0, 1]
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_val = int(len(labels) * VAL_SHARE)
    val, train = order[:n_val], order[n_val:]
    return images[train], labels[train], images[val], labels[val]


def batches(
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
        x, y, _, _ = digits()
        return batches(shape(x), y, seed, batch_size)

    def val_data() -> list[Batch]:
        _, _, x, y = digits()
        x = shape(x)
        return [(x[i : i + 256], y[i : i + 256]) for i in range(0, len(y), 256)]

    return train_data, val_data
