"""A zoo entry: what the registry knows of one task."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from autoprec.tasks.base import Task


class Kind(enum.Enum):
    HEALTHY = "healthy"  # fp16 and bf16 train as fp32 does to 10x the trial
    FRAGILE = "fragile"  # fails in a low-precision dtype between 2x and 10x the trial
    BOUNDARY = "boundary"  # custom modules whose mixed fp16/bf16 policies must not crash


@dataclass(frozen=True)
class ZooEntry:
    """One zoo task: its name on the command line, kind, mechanism, the module patterns
    expected to fail (fragile: the group that must stay in fp32 or bf16; boundary: the
    modules whose inputs cross dtypes under a mixed policy), the dtypes it fails in, and
    the factory that builds it, and (fragile) the side of the range it fails on."""

    name: str
    kind: Kind
    mechanism: str
    factory: Callable[[], Task]
    failing_groups: tuple[str, ...] = ()
    fails_in: tuple[str, ...] = ()
    side: str = ""  # fragile: "overflow" (values grow past the range) or "underflow"

    def task(self) -> Task:
        return self.factory()
