"""What every trial's result shares, training or serving: its numeric metrics by the names
used everywhere (summary.json, MLflow, the tables), and a plain dict form for the study."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, ClassVar, Self


class Measured:
    """A mixin for result dataclasses; ``METRICS`` names the fields that are metrics."""

    METRICS: ClassVar[tuple[str, ...]] = ()
    # The time the search minimises, by its metric name, and what a person calls it.
    TIME_METRIC: ClassVar[str] = ""
    TIME_LABEL: ClassVar[str] = ""

    @property
    def time_ms(self) -> float | None:
        """The time the search minimises (``TIME_METRIC``), so that callers need not know
        which kind of result they hold."""
        return getattr(self, self.TIME_METRIC)

    def metrics(self) -> dict[str, float]:
        """The numeric metrics that were measured (None and non-finite values left out)."""
        values = {name: getattr(self, name) for name in self.METRICS}
        return {k: float(v) for k, v in values.items() if v is not None and math.isfinite(float(v))}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
        return cls(**{k: v for k, v in data.items() if k in fields})
