"""What the telemetry saw first: the mechanism and the layer that a failing run shows
earliest, so that its reason names the cause rather than where the damage surfaced.

A low-precision run can fail in three ways, and each leaves a first trace:
- **flush to zero**: a layer's low-precision outputs (or its parameters' gradients) go
  mostly to zero, where at the layer's first observation they were not: more than half
  of the values that were nonzero then (``MOSTLY_ZERO``). Values that shrink below the
  dtype's smallest subnormal flush; what follows (a division by their norm, a log) then
  turns non-finite, and that later layer is only where it shows;
- **overflow**: a layer's outputs are non-finite;
- **loss scale collapse**: a dynamic loss scale has backed off to its floor (1, or its
  ``min_scale``) from above it: every step's gradients overflow even unscaled.

`FirstEvents` keeps, per (mechanism, layer), the first step it was seen, fed from the
watched steps (every ``TELEMETRY_EVERY``-th) and from the one diagnostic forward a run
makes when it stops; `FirstEvents.earliest` is the first by step, then by the order in
which the layers completed their forwards on that step (an origin before the layers
that only pass its values on).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.structures import tensors

FLUSH = "flush to zero"
OVERFLOW = "overflow"
SCALE_COLLAPSE = "loss scale collapse"
MOSTLY_ZERO = 0.5  # the share of once-nonzero values that must be zero now
KEPT = 32  # first events a result keeps
_TORCH = {f.torch_dtype(): f.name for f in formats.all_formats() if f.torch_name}
# Which mechanism's words open a reason, when it is the earliest.
REASON_WORDS = {FLUSH: "underflow", OVERFLOW: "overflow", SCALE_COLLAPSE: "loss scale collapse"}


@dataclass(frozen=True)
class FirstEvent:
    """The first step one layer showed one mechanism (``layer`` None: the loss scale)."""

    mechanism: str
    step: int
    layer: str | None
    dtype: str | None
    detail: str
    order: int = 0  # the layer's place in the step's order of completion
    values: str = "outputs"  # what flushed: the layer's "outputs" or its "gradients"

    def describe(self) -> str:
        """``flush to zero in shrink (fp16) at step ~120: 97% of its outputs zero (3% at
        step 0)``"""
        where = "" if self.layer is None else f" in {self.layer} ({self.dtype or '?'})"
        return f"{self.mechanism}{where} at step ~{self.step}: {self.detail}"

    @property
    def words(self) -> str:
        """How a reason opens for it: ``underflow``, ``overflow``, ``loss scale collapse``."""
        return REASON_WORDS[self.mechanism]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FirstEvent:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class FirstEvents:
    """Per (mechanism, layer) the first event seen; the share of zeros each layer's
    outputs and gradients had when first observed."""

    events: dict[tuple[str, str, str], FirstEvent] = field(default_factory=dict)
    zero_start: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    scale_peak: float = 0.0

    def activation(
        self,
        layer: str,
        step: int,
        elements: float,
        nonfinite: float,
        zeros: float,
        dtype: str | None,
        order: int,
    ) -> None:
        """One layer's outputs on one step: ``elements`` values, of which ``nonfinite``
        are inf/NaN and ``zeros`` are exactly zero, held in ``dtype``."""
        if not elements:
            return
        if nonfinite:
            detail = f"{nonfinite / elements:.0%} of its outputs non-finite"
            self._add(FirstEvent(OVERFLOW, step, layer, dtype, detail, order))
            return
        self._zeros("outputs", layer, step, zeros / elements, dtype, order)

    def gradient(
        self, layer: str, step: int, elements: float, zeros: float, dtype: str | None, order: int
    ) -> None:
        """One layer's parameter gradients on one step (``dtype``: what it computes in)."""
        if elements:
            self._zeros("gradients", layer, step, zeros / elements, dtype, order)

    def loss_scale(self, step: int, scale: float, dynamic: bool, floor: float) -> None:
        """The loss scale a step trained with; a dynamic one that fell to ``floor``
        from above it has collapsed."""
        if not dynamic:
            return
        if scale > floor:
            self.scale_peak = max(self.scale_peak, scale)
        elif self.scale_peak > floor:
            detail = f"the dynamic loss scale fell to {scale:g} (from {self.scale_peak:g})"
            self._add(FirstEvent(SCALE_COLLAPSE, step, None, None, detail, -1))

    def earliest(self, also_in_fp32: Mapping[str, int] | None = None) -> FirstEvent | None:
        """The first event that low precision explains: by step, then by order of
        completion. A flush counts only in a layer whose dtype's range is narrower than
        fp32's toward zero (fp16, fp8: `narrow_range`), and not in a layer that
        ``also_in_fp32`` (layer: the step its values went mostly zero in the fp32 run)
        flushed as early or earlier: a ReLU that died, not a dtype's range. A layer fp32
        flushes only later (an annealed kernel: fp16's smallest subnormal is passed
        ~1400 steps before fp32's) is blamed on the dtype."""
        also_in_fp32 = also_in_fp32 or {}
        explained = [e for e in self.events.values() if _explained(e, also_in_fp32)]
        # A gradient flush stalls its layer and makes nothing non-finite: where the run
        # also overflowed or its scale collapsed, that is what broke it (a saturating
        # head's gradients flush on the way to its overflow).
        breaking = [e for e in explained if not _stalls(e)]
        return min(breaking or explained, key=lambda e: (e.step, e.order), default=None)

    def flushed_layers(self) -> dict[str, int]:
        """The layers whose values went mostly zero, in any dtype, and the first step each
        did (for an fp32 run: what its low-precision runs' flushes from that step on are
        not blamed for)."""
        return {e.layer: e.step for e in self.events.values() if e.mechanism == FLUSH and e.layer}

    @classmethod
    def from_list(cls, data: list[dict[str, Any]]) -> FirstEvents:
        events = [FirstEvent.from_dict(d) for d in data]
        return cls({_key(e): e for e in events})

    def to_list(self) -> list[dict[str, Any]]:
        """The ``KEPT`` earliest first events, the earliest first (a result's
        ``first_events``: what the first ones were matters, not how far it spread)."""
        ordered = sorted(self.events.values(), key=lambda e: (e.step, e.order))
        return [e.to_dict() for e in ordered[:KEPT]]

    def _zeros(
        self, what: str, layer: str, step: int, share: float, dtype: str | None, order: int
    ) -> None:
        key = (what, layer)
        start = self.zero_start.setdefault(key, (step, share))
        first_step, first_share = start
        if step == first_step or first_share >= 1.0:
            return
        if share >= MOSTLY_ZERO and (share - first_share) / (1.0 - first_share) >= MOSTLY_ZERO:
            detail = f"{share:.0%} of its {what} zero ({first_share:.0%} at step {first_step})"
            self._add(FirstEvent(FLUSH, step, layer, dtype, detail, order, what))

    def _add(self, event: FirstEvent) -> None:
        key = _key(event)
        if key not in self.events:
            self.events[key] = event


def _key(event: FirstEvent) -> tuple[str, str, str]:
    return (event.mechanism, event.layer or "", event.values)


def _stalls(event: FirstEvent) -> bool:
    return event.mechanism == FLUSH and event.values == "gradients"


def _explained(event: FirstEvent, also_in_fp32: Mapping[str, int]) -> bool:
    if event.mechanism != FLUSH:
        return True
    fp32_step = also_in_fp32.get(event.layer or "")
    return narrow_range(event.dtype) and (fp32_step is None or fp32_step > event.step)


def narrow_range(dtype: str | None) -> bool:
    """Whether ``dtype``'s smallest normal is above fp32's: only there is a flush the
    dtype's range (bf16's is fp32's own: its values flush where fp32's do, and a bf16
    layer's outputs going zero sooner is a ReLU dying in its noise, not its range)."""
    if not formats.known(dtype):
        return False
    smallest = formats.get(str(dtype)).limits.smallest_normal
    return smallest > formats.reference().limits.smallest_normal


def diagnose_forward(
    model: nn.Module, run_forward: Callable[[], Any], events: FirstEvents, step: int
) -> str | None:
    """One forward of ``run_forward`` (no gradients), every module's outputs given to
    ``events`` as on ``step`` in order of completion; the first module whose output is
    not finite (the leaf that overflowed, or the parent whose own arithmetic did)."""
    seen: list[tuple[str, float, float, float, str | None]] = []
    handles = []
    for name, module in model.named_modules():
        if module is model:
            continue

        def hook(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
            floating = [t for t in tensors(output) if t.is_floating_point() and t.numel()]
            if not floating:
                return
            elements = sum(t.numel() for t in floating)
            nonfinite = sum(int((~torch.isfinite(t)).sum()) for t in floating)
            zeros = sum(int((t == 0).sum()) for t in floating)
            seen.append((name, elements, nonfinite, zeros, _TORCH.get(floating[0].dtype)))

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
    for order, (name, elements, nonfinite, zeros, dtype) in enumerate(seen):
        events.activation(name, step, elements, nonfinite, zeros, dtype, order)
    return next((name for name, _, nonfinite, _, _ in seen if nonfinite), None)
