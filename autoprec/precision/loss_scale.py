"""Loss-scale settings of a policy: plain, torch-free data with torch.amp.GradScaler's names
and defaults (`autoprec.precision.scaling` says what each mode does, and scales by them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from autoprec.errors import PolicyError

LOSS_SCALE_MODES = ("none", "static", "dynamic")
# The scale is a float32, as in torch: at most torch.finfo(torch.float32).max.
_FLOAT32_MAX = 3.4028234663852886e38
DYNAMIC_FIELDS = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
)


@dataclass(frozen=True)
class LossScale:
    """Loss-scale settings of a policy. Defaults are torch.amp.GradScaler's."""

    mode: str = "none"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in LOSS_SCALE_MODES:
            problems.append(f"mode: unknown mode {self.mode!r} (expected none, static or dynamic)")
        if not 0 < self.init_scale <= _FLOAT32_MAX:
            problems.append(
                f"init_scale: must be a positive float32 number, got {self.init_scale!r}"
            )
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            problems.append(
                f"growth_factor: must be a finite number above 1, got {self.growth_factor!r}"
            )
        if not 0 < self.backoff_factor < 1:
            problems.append(f"backoff_factor: must be between 0 and 1, got {self.backoff_factor!r}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            problems.append(
                f"growth_interval: must be a positive integer, got {self.growth_interval!r}"
            )
        if not (isinstance(self.hysteresis, int) and self.hysteresis >= 1):
            problems.append(f"hysteresis: must be a positive integer, got {self.hysteresis!r}")
        if not (math.isfinite(self.min_scale) and 0 <= self.min_scale <= self.init_scale):
            problems.append(f"min_scale: must be between 0 and init_scale, got {self.min_scale!r}")
        if problems:
            raise PolicyError(f"loss_scale.{problems[0]}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def to_dict(self) -> dict[str, Any]:
        """The settings that matter for this mode, as plain YAML-ready data."""
        if self.mode == "none":
            return {"mode": "none"}
        if self.mode == "static":
            return {"mode": "static", "init_scale": float(self.init_scale)}
        data = asdict(self)
        return {"mode": "dynamic", **{k: data[k] for k in DYNAMIC_FIELDS}}

    @classmethod
    def from_dict(cls, data: Any, where: str = "loss_scale") -> LossScale:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise PolicyError(f"{where}: expected a mapping, got {type(data).__name__}")
        known = {"mode", *DYNAMIC_FIELDS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"{where}.{unknown[0]}: unknown field (expected {sorted(known)})")
        values = dict(data)
        for key in ("init_scale", "growth_factor", "backoff_factor", "min_scale"):
            if key in values:
                values[key] = _number(values[key], f"{where}.{key}")
        for key in ("growth_interval", "hysteresis"):
            if key in values and not (
                isinstance(values[key], int) and not isinstance(values[key], bool)
            ):
                raise PolicyError(f"{where}.{key}: must be an integer, got {values[key]!r}")
        try:
            return cls(**values)
        except PolicyError as error:
            raise PolicyError(f"{where}.{str(error).removeprefix('loss_scale.')}") from None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{where}: must be a number, got {value!r}")
    return float(value)
