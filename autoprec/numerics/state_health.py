"""How much a parameter's quantised optimizer state loses, read from the state itself.

torchao's 8-bit (and 4-bit, fp8) states quantise each block of 256 (128) values against
the block's largest: a value below the smallest code (3.25e-7 of the block's maximum for
the unsigned 8-bit map of ``exp_avg_sq``) is stored as zero. Where a rarely updated entry
(an embedding row of a rare token beside frequent ones in its block) keeps a first moment
but loses its second, Adam's denominator falls to ``eps`` and the next updates are
``lr * exp_avg / eps``: the entry blows up. ``collapsed_share`` counts those entries;
``zero_second_moment_share`` counts every second moment stored as zero (an entry never
updated is zero too: the state alone cannot tell an underflow from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class StateHealth:
    """One parameter's optimizer state, as stored."""

    parameter: str
    module_type: str
    stored_as: str  # the state tensor's class name, or its dtype for a plain tensor
    elements: int
    zero_second_moment_share: float  # exp_avg_sq entries stored as exactly zero
    collapsed_share: float  # ... where exp_avg is not zero: updates of lr * exp_avg / eps

    @property
    def quantised(self) -> bool:
        return not self.stored_as.startswith("torch.")

    def reason(self, threshold: float = 0.0) -> str | None:
        """One line naming the parameter and the mechanism, where entries collapsed."""
        if self.collapsed_share <= threshold:
            return None
        return (
            f"{self.parameter} ({self.module_type}, {self.stored_as} states): exp_avg_sq "
            f"underflows to 0 in {self.collapsed_share:.2%} of entries whose exp_avg is not "
            "zero, so their updates are lr * exp_avg / eps and blow up"
        )


def state_health(model: nn.Module, optimizer: Any) -> list[StateHealth]:
    """Every trainable parameter with an Adam state (``exp_avg``, ``exp_avg_sq``), in
    ``named_parameters()`` order; of a sharded state (FSDP2), this rank's shard."""
    modules = dict(model.named_modules())
    found = []
    for name, parameter in model.named_parameters():
        state = optimizer.state.get(parameter) if hasattr(optimizer.state, "get") else None
        if not state or "exp_avg_sq" not in state or "exp_avg" not in state:
            continue
        second, first = _local(state["exp_avg_sq"]), _local(state["exp_avg"])
        stored = type(second)
        stored_as = (
            f"torch.{second.dtype}".replace("torch.torch.", "torch.")
            if stored is torch.Tensor
            else stored.__name__
        )
        second_values = _values(second)
        first_values = _values(first)
        zero = second_values == 0
        collapsed = zero & (first_values != 0)
        count = second_values.numel()
        found.append(
            StateHealth(
                name,
                type(modules[name.rpartition(".")[0]]).__name__,
                stored_as,
                count,
                float(zero.sum()) / count,
                float(collapsed.sum()) / count,
            )
        )
    return found


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor's shard (under FSDP2: this rank's part of the state), else itself."""
    return getattr(tensor, "_local_tensor", tensor)


def _values(tensor: torch.Tensor) -> torch.Tensor:
    dequantize = getattr(tensor, "dequantize", None)
    if type(tensor) is not torch.Tensor and dequantize is not None:
        return dequantize().float()
    return tensor.detach().float()
