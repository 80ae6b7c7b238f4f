"""The guard's settings: plain, torch-free data, as a policy's YAML section ``guard:`` holds
them and ``policy.apply(model, guard=Guard(...))`` takes them.

Defaults are written in the signature and explained once here:

- ``check_every=50``: one step in 50 is watched (every module's largest |output|, the
  parameters' gradients, one host transfer); the other 49 carry no hook and no host sync.
- ``margin_bits=3.0``: a low-precision layer is promoted when its largest |output| is, or
  is projected to be within ``lookahead`` of the run so far, less than 3 bits from its
  dtype's largest value (the forecast's own margin for a projected level,
  ``autoprec.numerics.forecast.LEVEL_MARGIN_BITS``), or projected to cross it.
- ``lookahead=2.0``: trends are projected to twice the steps trained so far (the
  forecast's own error, ``NEAR_HORIZON``), and never less than two checks ahead.
- ``snapshot_every=200``: the weights, the optimizers' state, the loss scaler and the
  random generators are copied every 200 steps (a multiple of ``check_every``); a step
  that fails where loss scaling does not explain it goes back to that copy.
- ``snapshot_dir=None``: copies are kept in memory (on the host: one copy of the
  weights and the optimizer state); a directory keeps them there instead, as
  ``guard-snapshot.pt``, written whole or not at all.
- ``promote=("bf16", "fp32")``: where a layer may go, in order: fp8 and fp16 to bf16
  first, bf16 to fp32.
- ``max_rollbacks=8``: a run that needs more rollbacks than this stops with a
  `GuardError` rather than loop.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from autoprec.errors import GuardError

# Widest last: a layer is promoted to the first target of ``promote`` wider than its dtype.
WIDTH = {"fp8": 0, "fp16": 1, "bf16": 2, "fp32": 3}
PROMOTION_TARGETS = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class Guard:
    """How a guarded run watches its low-precision layers, and what it may change."""

    check_every: int = 50
    margin_bits: float = 3.0
    lookahead: float = 2.0
    snapshot_every: int = 200
    snapshot_dir: str | None = None
    promote: tuple[str, ...] = ("bf16", "fp32")
    max_rollbacks: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "promote", tuple(self.promote))
        problem = _problem(self)
        if problem is not None:
            raise GuardError(f"guard.{problem}")

    def target(self, dtype: str) -> str | None:
        """Where a layer in ``dtype`` is promoted to: the first of ``promote`` wider than it
        (None: nowhere, it is as wide as the guard allows)."""
        width = WIDTH.get(dtype, WIDTH["fp32"])
        return next((t for t in self.promote if WIDTH[t] > width), None)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["promote"] = list(self.promote)
        if self.snapshot_dir is None:
            del data["snapshot_dir"]
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = "guard") -> Guard:
        """The settings of a policy's ``guard:`` section (``true`` or ``{}``: the defaults)."""
        if data is True or data is None:
            return cls()
        if not isinstance(data, dict):
            raise GuardError(f"{where}: expected a mapping of settings or true, got {data!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise GuardError(f"{where}.{unknown[0]}: unknown setting (expected {known})")
        values = dict(data)
        if isinstance(values.get("promote"), str):
            values["promote"] = [values["promote"]]
        if "promote" in values and not isinstance(values["promote"], list | tuple):
            raise GuardError(f"{where}.promote: expected a list of dtypes")
        try:
            return cls(**values)
        except GuardError as error:
            raise GuardError(f"{where}{str(error).removeprefix('guard')}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _problem(guard: Guard) -> str | None:
    """What is wrong with ``guard``'s settings, as ``field: why`` (None: nothing)."""
    if not _is_int(guard.check_every) or not 1 <= guard.check_every <= 100_000:
        return (
            "check_every: expected a whole number of steps from 1 to 100000, "
            f"got {guard.check_every!r}"
        )
    if not _is_number(guard.margin_bits) or not 0 <= guard.margin_bits <= 16:
        return f"margin_bits: expected a number of bits from 0 to 16, got {guard.margin_bits!r}"
    if not _is_number(guard.lookahead) or not 1 <= guard.lookahead <= 100:
        return (
            "lookahead: expected a multiple of the steps so far from 1 to 100, "
            f"got {guard.lookahead!r}"
        )
    if not _is_int(guard.snapshot_every) or guard.snapshot_every < 1:
        return f"snapshot_every: expected a whole number of steps, got {guard.snapshot_every!r}"
    if guard.snapshot_every % guard.check_every:
        return (
            f"snapshot_every: {guard.snapshot_every} is not a multiple of check_every "
            f"({guard.check_every}): a copy is taken at a step the guard has checked"
        )
    if guard.snapshot_dir is not None and not (
        isinstance(guard.snapshot_dir, str) and guard.snapshot_dir
    ):
        return f"snapshot_dir: expected a directory's path, got {guard.snapshot_dir!r}"
    if not guard.promote:
        return "promote: expected at least one dtype to promote to (bf16, fp32)"
    for dtype in guard.promote:
        if dtype not in PROMOTION_TARGETS:
            return (
                f"promote: {dtype!r} is not a dtype a layer can be promoted to "
                f"(expected some of {', '.join(PROMOTION_TARGETS)})"
            )
    widths = [WIDTH[d] for d in guard.promote]
    if widths != sorted(set(widths)):
        return "promote: expected dtypes from narrow to wide, each once (bf16 before fp32)"
    if not _is_int(guard.max_rollbacks) or guard.max_rollbacks < 0:
        return f"max_rollbacks: expected a whole number, got {guard.max_rollbacks!r}"
    return None
