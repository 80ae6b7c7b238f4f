"""The few collectives a trial across ranks needs, on the process group torchrun set up:
one float or flag reduced over the ranks, and small per-rank records gathered.

Every rank must call each of these the same number of times in the same order (they are
collectives); the trial's loop is the same on every rank, so it does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def communication_device(device: torch.device, group: Any = None) -> torch.device:
    """Where a collective's tensors live: the CPU under gloo, the rank's device under
    nccl and hccl (which only take device tensors)."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else device


def mean_over_ranks(device: torch.device, group: Any = None) -> Callable[[float], float]:
    """``value -> the mean of value over the ranks``; a non-finite value on any rank makes
    the mean non-finite, so every rank decides alike on it."""
    where = communication_device(device, group)

    def mean(value: float) -> float:
        tensor = torch.tensor(value, dtype=torch.float64, device=where)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return float(tensor) / dist.get_world_size(group)

    return mean


def max_over_ranks(
    device: torch.device, group: Any = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``flag -> its maximum over the ranks`` (a found-inf flag: one rank's overflow is
    every rank's, as torch's ``ShardedGradScaler`` all-reduces it); returned on the CPU."""
    where = communication_device(device, group)

    def maximum(flag: torch.Tensor) -> torch.Tensor:
        tensor = flag.detach().to(device=where, dtype=torch.float32).clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor.cpu()

    return maximum


def gather_records(record: dict[str, Any], group: Any = None) -> list[dict[str, Any]]:
    """Every rank's ``record`` (small, JSON-ready), in rank order, on every rank."""
    records: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(records, record, group=group)
    return records
