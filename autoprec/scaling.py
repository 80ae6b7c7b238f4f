"""Loss scaling: the settings (plain data, torch's names and defaults) and the scaler.

Three modes:
- ``none``: the loss is not scaled; every step is taken.
- ``static``: the loss is multiplied by ``init_scale``, which never changes; a step whose
  gradients overflow is skipped.
- ``dynamic``: as ``torch.amp.GradScaler``: start at ``init_scale``, multiply by
  ``growth_factor`` after ``growth_interval`` clean steps in a row, multiply by
  ``backoff_factor`` on overflow. Two additions: ``hysteresis`` (back off only after that
  many overflowing steps in a row; 1 is torch's behaviour) and ``min_scale`` (a floor;
  0 is torch's behaviour, no floor).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import torch

from autoprec.errors import PolicyError

MODES = ("none", "static", "dynamic")
_DYNAMIC_FIELDS = (
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
        if self.mode not in MODES:
            problems.append(f"mode: unknown mode {self.mode!r} (expected none, static or dynamic)")
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            problems.append(f"init_scale: must be a positive number, got {self.init_scale!r}")
        if not self.growth_factor > 1:
            problems.append(f"growth_factor: must be above 1, got {self.growth_factor!r}")
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
        return {"mode": "dynamic", **{k: data[k] for k in _DYNAMIC_FIELDS}}

    @classmethod
    def from_dict(cls, data: Any, where: str = "loss_scale") -> LossScale:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise PolicyError(f"{where}: expected a mapping, got {type(data).__name__}")
        known = {"mode", *_DYNAMIC_FIELDS}
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


class LossScaler:
    """Scales the loss, unscales gradients in place, and decides whether a step is taken.

    The scale lives on the host: deciding to skip a step needs one host sync per step
    anyway (torch's GradScaler makes the same sync in ``step``).
    """

    def __init__(self, settings: LossScale) -> None:
        self.settings = settings
        self.scale = float(settings.init_scale) if settings.enabled else 1.0
        self._clean_steps = 0
        self._overflows_in_a_row = 0
        self._unscaled: set[int] = set()
        self._found_inf: dict[int, bool] = {}

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.settings.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the optimizer's gradients by the scale; True if any is inf or NaN."""
        key = id(optimizer)
        if not self.settings.enabled:
            return False
        if key in self._unscaled:
            return self._found_inf[key]
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    groups[(param.grad.device, param.grad.dtype)].append(param.grad)
        found = []
        for (device, _), grads in groups.items():
            found_inf = torch.zeros(1, device=device)
            inv_scale = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            found.append(found_inf.to("cpu", non_blocking=False))
        overflow = bool(torch.cat(found).sum().item()) if found else False
        self._unscaled.add(key)
        self._found_inf[key] = overflow
        return overflow

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if needed, then step unless gradients overflowed. Returns whether it stepped."""
        overflow = self.unscale_(optimizer)
        if not overflow:
            optimizer.step()
        return not overflow

    @property
    def at_floor(self) -> bool:
        """Whether a skipping scaler has no lower scale left to try (static scaling, or
        dynamic at its floor or below 1): its skips are then the policy's failure, not
        the start-up backoff of a high initial scale."""
        if self.settings.mode == "static":
            return True
        return self.settings.mode == "dynamic" and self.scale <= max(self.settings.min_scale, 1.0)

    def update(self) -> bool:
        """Adjust the scale after the optimizers of this iteration stepped; True on overflow."""
        overflow = any(self._found_inf.values())
        self._unscaled.clear()
        self._found_inf.clear()
        if self.settings.mode != "dynamic":
            return overflow
        s = self.settings
        if overflow:
            self._clean_steps = 0
            self._overflows_in_a_row += 1
            if self._overflows_in_a_row >= s.hysteresis:
                self.scale = max(self.scale * s.backoff_factor, s.min_scale)
                self._overflows_in_a_row = 0
        else:
            self._overflows_in_a_row = 0
            self._clean_steps += 1
            if self._clean_steps >= s.growth_interval:
                self.scale *= s.growth_factor
                self._clean_steps = 0
        return overflow

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "overflows_in_a_row": self._overflows_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_in_a_row = int(state["overflows_in_a_row"])
