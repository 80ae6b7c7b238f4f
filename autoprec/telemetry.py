"""Gradient telemetry: what low precision would lose or break.

``grad_underflow_ratio`` is the share of *nonzero* fp32 gradient elements that would
flush to zero if held in fp16 at the current loss scale. Gradients that are truly zero
(a dead ReLU, an unused embedding row) are not counted as lost: a plain count of zeros
would count them too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class UnderflowCount:
    """Running totals of nonzero gradient elements and of those fp16 would flush to zero."""

    nonzero: int = 0
    flushed: int = 0

    def add(self, grads: Iterable[torch.Tensor], scale: float = 1.0) -> None:
        nonzero = flushed = None
        for grad in grads:
            scaled = grad.detach().float() * scale
            is_nonzero = scaled != 0
            lost = is_nonzero & (scaled.to(torch.float16) == 0)
            n, f = is_nonzero.sum(), lost.sum()
            nonzero = n if nonzero is None else nonzero + n
            flushed = f if flushed is None else flushed + f
        if nonzero is not None:
            self.nonzero += int(nonzero)
            self.flushed += int(flushed)

    @property
    def ratio(self) -> float:
        return self.flushed / self.nonzero if self.nonzero else 0.0
