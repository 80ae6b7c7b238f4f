"""Loss scaling: the scaler, by the settings of `autoprec.precision.loss_scale.LossScale`
(plain data, torch's names and defaults).

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

import enum
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from autoprec.errors import LoopError
from autoprec.precision.loss_scale import DYNAMIC_FIELDS, LossScale


class _Stage(enum.Enum):
    """Where one optimizer is in the iteration, as GradScaler's ``OptState``."""

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    found_inf: bool = False


class LossScaler:
    """Scales the loss, unscales gradients in place, and decides whether a step is taken.

    The arithmetic is torch.amp.GradScaler's, op for op: the scale is a float32 tensor,
    unscaling multiplies by its reciprocal taken in float64, and the update is torch's own
    ``_amp_update_scale_`` (growth that would reach inf is refused, the scale may fall to 0
    without raising). So with ``hysteresis: 1`` and ``min_scale: 0`` the scale, the skipped
    steps and the gradients equal GradScaler's bit for bit, whatever the factors. The scale
    lives on the host: deciding to skip a step needs one host sync per step anyway (torch's
    GradScaler makes the same sync in ``step``). Each optimizer goes ready, unscaled,
    stepped, as in GradScaler: unscaling or stepping it twice in one iteration raises.
    """

    def __init__(self, settings: LossScale) -> None:
        self.settings = settings
        # On one rank of several: makes a found-inf flag (a float32 tensor) the maximum
        # over all ranks, so that every rank skips or steps together (`autoprec.distributed`).
        self.reduce_found_inf: Callable[[torch.Tensor], torch.Tensor] | None = None
        initial = settings.init_scale if settings.enabled else 1.0
        self._scale = torch.full((), initial, dtype=torch.float32)
        self._growth_tracker = torch.zeros((), dtype=torch.int32)
        self._overflows_in_a_row = 0
        self._optimizers: dict[int, _OptimizerState] = defaultdict(_OptimizerState)

    @property
    def scale(self) -> float:
        """The current scale, a float32 value (1.0 without scaling)."""
        return float(self._scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # A float32 scale times a float32 loss: the product GradScaler.scale computes.
        return loss * self.scale if self.settings.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the optimizer's gradients by the scale; True if any is inf or NaN."""
        if not self.settings.enabled:
            return False
        state = self._optimizers[id(optimizer)]
        if state.stage is _Stage.UNSCALED:
            raise LoopError(
                "unscale_() has already been called on this optimizer since the last update()"
            )
        if state.stage is _Stage.STEPPED:
            raise LoopError("unscale_() is being called after step()")
        state.found_inf = self._unscale_grads(optimizer)
        state.stage = _Stage.UNSCALED
        return state.found_inf

    def _unscale_grads(self, optimizer: torch.optim.Optimizer) -> bool:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    # A sharded (DTensor) gradient is unscaled as its local shard.
                    grad = getattr(param.grad, "_local_tensor", param.grad)
                    groups[(grad.device, grad.dtype)].append(grad)
        inv_scale = self._scale.double().reciprocal().float()
        found = [torch.zeros(())]
        with torch.no_grad():
            for (device, _), grads in groups.items():
                found_inf = torch.zeros((), device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, found_inf, inv_scale.to(device)
                )
                found.append(found_inf.to("cpu"))
        flag = torch.stack(found).sum()
        if self.reduce_found_inf is not None:
            flag = self.reduce_found_inf(flag)
        return bool(flag.item())

    def nonfinite(self, optimizer: torch.optim.Optimizer) -> bool:
        """Without scaling (a scale of 1, so unscaling changes nothing): whether any of the
        optimizer's gradients holds inf or NaN, decided across the ranks where
        ``reduce_found_inf`` is set; the check a step makes, one host sync."""
        if self.settings.enabled:
            raise LoopError("nonfinite() is for a scaler that scales nothing; call unscale_()")
        return self._unscale_grads(optimizer)

    def unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were unscaled in this iteration already."""
        return self._optimizers.get(id(optimizer), _OptimizerState()).stage is not _Stage.READY

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if needed, then step unless gradients overflowed. Returns whether it stepped."""
        if not self.settings.enabled:
            optimizer.step()
            return True
        state = self._optimizers[id(optimizer)]
        if state.stage is _Stage.STEPPED:
            raise LoopError("step() has already been called since the last update()")
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        if not state.found_inf:
            optimizer.step()
        state.stage = _Stage.STEPPED
        return not state.found_inf

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
        overflow = any(state.found_inf for state in self._optimizers.values())
        self._optimizers.clear()
        if self.settings.mode == "dynamic":
            self._update_dynamic(overflow)
        return overflow

    def _update_dynamic(self, overflow: bool) -> None:
        s = self.settings
        backoff = s.backoff_factor
        if overflow:
            self._overflows_in_a_row += 1
            if self._overflows_in_a_row < s.hysteresis:
                backoff = 1.0  # hold the scale; the clean-step count still restarts
            else:
                self._overflows_in_a_row = 0
        else:
            self._overflows_in_a_row = 0
        found_inf = torch.full((), float(overflow))
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf,
            s.growth_factor,
            backoff,
            s.growth_interval,
        )
        if s.min_scale > 0:
            self._scale.clamp_(min=s.min_scale)

    def state_dict(self) -> dict[str, Any]:
        """The scale, the clean-step count and every setting; the keys GradScaler's
        ``state_dict`` has come with its names, so either can load the other's."""
        return {
            "scale": self.scale,
            "growth_factor": self.settings.growth_factor,
            "backoff_factor": self.settings.backoff_factor,
            "growth_interval": self.settings.growth_interval,
            "_growth_tracker": int(self._growth_tracker),
            "mode": self.settings.mode,
            "init_scale": self.settings.init_scale,
            "hysteresis": self.settings.hysteresis,
            "min_scale": self.settings.min_scale,
            "overflows_in_a_row": self._overflows_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` (or GradScaler's, or an older autoprec's) holds; the
        settings it carries replace this scaler's, as GradScaler's ``load_state_dict`` does."""
        settings = {k: state[k] for k in ("mode", *DYNAMIC_FIELDS) if k in state}
        self.settings = replace(self.settings, **settings)
        self._scale.fill_(float(state["scale"]))
        tracker = state.get("_growth_tracker", state.get("clean_steps", 0))
        self._growth_tracker.fill_(int(tracker))
        self._overflows_in_a_row = int(state.get("overflows_in_a_row", 0))
