"""How a task's training data is split across the ranks of a trial.

A task sees its rank in one of two ways:

- its ``train_data`` takes ``(seed, rank, world)``: it yields rank ``rank``'s own batches
  of a world of ``world`` ranks (a ``DistributedSampler`` of its own, say);
- its ``train_data`` takes ``(seed)`` only, as every single-device task does: each batch
  it yields is the *global* batch, and rank ``r`` trains on the ``r``-th of ``world``
  equal slices of it along the batch dimension (`shard`). The global batch, and so the
  trial's hyperparameters, stay those of the single-device trial: under DDP the mean of
  the ranks' gradients is the gradient of the whole batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from autoprec._util.structures import map_tensors, tensors
from autoprec.errors import TaskError


def shard(batch: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s slice of one global batch: every tensor cut into ``world`` equal
    parts along its first (batch) dimension, containers kept (a ``(inputs, targets)``
    pair, a mapping). The batch size must divide by ``world``, so that every rank's
    loss weighs alike and the ranks' mean is the global batch's."""
    if not 0 <= rank < world:
        raise TaskError(f"shard: rank {rank} is not in a world of {world}")
    found = [t for t in tensors(batch) if t.dim() > 0]
    if not found:
        raise TaskError("shard: the batch holds no tensor with a batch dimension")
    size = int(found[0].shape[0])
    if any(int(t.shape[0]) != size for t in found):
        raise TaskError(
            "shard: the batch's tensors differ in their first dimension; give the task a "
            "train_data(seed, rank, world) that yields each rank's own batches"
        )
    if size % world:
        raise TaskError(
            f"shard: a batch of {size} does not split into {world} equal parts; use a batch "
            f"size that divides by {world}, or a train_data(seed, rank, world)"
        )
    part = size // world

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[rank * part : (rank + 1) * part] if tensor.dim() > 0 else tensor

    return map_tensors(cut, batch)


def takes_rank(train_data: Callable[..., Iterable[Any]]) -> bool:
    """Whether a task's ``train_data`` takes ``(seed, rank, world)``."""
    try:
        signature = inspect.signature(train_data)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(0, 0, 1)
    except TypeError:
        return False
    return True


def rank_train_data(
    train_data: Callable[..., Iterable[Any]], seed: int, rank: int, world: int
) -> Iterator[Any]:
    """Rank ``rank``'s batches of a task's ``train_data``: its own where it takes the rank,
    else its global batches `shard`-ed."""
    if takes_rank(train_data):
        yield from train_data(seed, rank, world)
        return
    for batch in train_data(seed):
        yield shard(batch, rank, world)


def check_shardable(train_data: Callable[..., Iterable[Any]], seed: int, world: int) -> None:
    """Before any store is opened: a task without its own ``(seed, rank, world)`` data
    must give global batches that split into ``world`` equal parts (`shard`)."""
    if world <= 1 or takes_rank(train_data):
        return
    first = next(iter(train_data(seed)), None)
    if first is None:
        return  # the task's own data check says it ran out
    try:
        shard(first, 0, world)
    except TaskError as error:
        message = str(error).removeprefix("shard: ")
        raise TaskError(f"--nproc-per-trial {world}: {message}") from None
