"""The zoo's data: seeded, generated or bundled (no downloads), cycled forever."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from autoprec.tasks.builtin import digits_data

Batch = tuple[torch.Tensor, torch.Tensor]
DataPair = tuple[Callable[[int], Iterator[Batch]], Callable[[], list[Batch]]]

BATCH = 32
SEQ_VOCAB = 16
SEQ_LENGTH = 12
SEQ_CLASSES = 4  # the label: which of tokens 0..3 occurs most often
SEQ_SAMPLES = 2048
SEQ_VAL = 512


def digits(batch_size: int = BATCH, input_scale: float = 1.0) -> DataPair:
    """scikit-learn's digits, flattened (64 features in [0, input_scale])."""
    return digits_data(flatten=True, input_scale=input_scale, batch_size=batch_size)


def digit_images(batch_size: int = BATCH) -> DataPair:
    return digits_data(flatten=False, batch_size=batch_size)


def _cycled(inputs: torch.Tensor, targets: torch.Tensor, seed: int, size: int) -> Iterator[Batch]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(targets), generator=generator)
        for start in range(0, len(order) - size + 1, size):
            index = order[start : start + size]
            yield inputs[index], targets[index]


def split(inputs: torch.Tensor, targets: torch.Tensor, val: int, batch_size: int) -> DataPair:
    """The last ``val`` samples held out; the rest cycled in a seeded order."""

    def train_data(seed: int) -> Iterator[Batch]:
        return _cycled(inputs[:-val], targets[:-val], seed, batch_size)

    def val_data() -> list[Batch]:
        return [(inputs[-val:], targets[-val:])]

    return train_data, val_data


def sequences(batch_size: int = BATCH) -> DataPair:
    """Token sequences; the label is the most frequent of tokens 0..3 (ties: the lowest)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SEQ_VOCAB, (SEQ_SAMPLES, SEQ_LENGTH), generator=generator)
    counts = torch.stack([(tokens == k).sum(1) for k in range(SEQ_CLASSES)], 1)
    labels = counts.argmax(1)
    return split(tokens, labels, SEQ_VAL, batch_size)


def blobs(
    classes: int = 4, features: int = 16, samples: int = 1024, spread: float = 2.0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs around ``classes`` random centres (the README's ``my_task.py`` data
    with its defaults)."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=generator) * spread
    labels = torch.randint(0, classes, (samples,), generator=generator)
    inputs = centers[labels] + torch.randn(samples, features, generator=generator)
    return inputs, labels


def regression(samples: int = 2048, features: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth nonlinear target of 8 features, with noise."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(samples, features, generator=generator)
    y = torch.sin(x[:, :1] * 1.5) + 0.5 * x[:, 1:2] * x[:, 2:3] + 0.3 * torch.cos(x[:, 3:4])
    y = y + 0.05 * torch.randn(samples, 1, generator=generator)
    return x, y
