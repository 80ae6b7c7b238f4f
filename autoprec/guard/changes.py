"""What the guard changes, and why: pure decisions over plain data.

`promotions` reads one check's forecast (`autoprec.numerics.forecast.forecast` over the
range series the guard has watched so far, projected ``lookahead`` times the steps trained)
and names the low-precision layers to promote: a layer whose projected crossing of its
dtype's range falls within that horizon (the forecast's own verdict, at risk), or whose
largest |output| is or is projected to be within ``margin_bits`` of its dtype's largest
value. A series the forecast cannot tell is watched on, never promoted.

A flagged module may hold no parameters of its own (``attn.scores``, a parent whose own
arithmetic overflowed): the layers promoted are then the low-precision leaves below its
nearest ancestor that has any, so that the region around it widens with them.

`promoted_policy` turns the changes into the effective policy: one rule per change,
newest first, ahead of the policy's own rules (the first matching rule wins). The
policy stays plain data; a resumed run rebuilds it from the changes its checkpoint kept.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import autoprec.formats as formats
from autoprec.guard.settings import WIDTH, Guard
from autoprec.numerics.forecast import Forecast, Headroom, Outcome, RangeSeries, element_limits
from autoprec.numerics.fp8_telemetry import FLUSH_WARNING, ROLE_LABELS, Fp8Telemetry

if TYPE_CHECKING:
    from autoprec.precision.view import PolicyView

PROMOTE = "promote"
ROLLBACK = "rollback"
# The output dtypes whose range the guard watches: fp32's and bf16's overflow at 3.4e38.
NARROW = ("fp16", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class Change:
    """One change the guard made: at ``step``, the leaves below ``layer`` went from
    ``from_dtype`` to ``to_dtype`` because of ``reason``. A ``rollback`` went back to the
    copy of step ``restored_step`` first, and ``replayed`` says whether the lost steps
    were trained again on their own batches. ``headroom_bits``, ``trend`` and
    ``crossing_step``: the layer's headroom now, its fitted trend and projected crossing
    (None where the change came from a failure, not a trend)."""

    step: int
    action: str
    layer: str
    leaves: tuple[str, ...]
    from_dtype: str
    to_dtype: str
    reason: str
    headroom_bits: float | None = None
    trend: str | None = None
    crossing_step: int | None = None
    restored_step: int | None = None
    replayed: bool | None = None

    def describe(self) -> str:
        """One line: what changed at which step, and why."""
        what = f"{self.layer or 'the model'} {self.from_dtype} -> {self.to_dtype}"
        if self.action == ROLLBACK:
            again = "replayed" if self.replayed else "not replayed: the loop gives no batches"
            back = f"rolled back to step {self.restored_step} ({again}), "
            return f"step {self.step}: {back}{what}: {self.reason}"
        return f"step {self.step}: promoted {what}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["leaves"] = list(self.leaves)
        if self.headroom_bits is not None and not math.isfinite(self.headroom_bits):
            data["headroom_bits"] = None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Change:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["leaves"] = tuple(values.get("leaves", ()))
        return cls(**values)


def horizon(step: int, settings: Guard) -> int:
    """The step a check at ``step`` projects to: ``lookahead`` times the steps trained,
    and at least two checks ahead."""
    return max(math.ceil(settings.lookahead * (step + 1)), step + 2 * settings.check_every)


def promotions(
    ahead: Forecast, step: int, leaf_dtypes: dict[str, str], settings: Guard
) -> list[Change]:
    """The layers this check promotes, each once, the earliest crossing first."""
    found: list[Change] = []
    taken: set[str] = set()
    for room in ahead.layers:
        if room.dtype not in NARROW:
            continue
        why = _trigger(room, ahead.train_steps, settings)
        if why is None:
            continue
        _, owned = owning_leaves(room.layer, leaf_dtypes)
        widened = widening(
            tuple(leaf for leaf in owned if leaf not in taken), leaf_dtypes, settings
        )
        if widened is None:
            continue
        narrowest, target, leaves = widened
        taken.update(leaves)
        crossing = room.first_crossing
        found.append(
            Change(
                step,
                PROMOTE,
                room.layer,
                leaves,
                narrowest,
                target,
                why,
                headroom_bits=room.headroom_now_bits,
                trend=room.trend,
                crossing_step=None if crossing is None else crossing[0],
            )
        )
    return found


def inside_margin(series: RangeSeries, margin_bits: float) -> bool:
    """Whether some layer's latest largest |output| is within ``margin_bits`` of its
    dtype's largest value (no fit needed to see it)."""
    held = element_limits()
    for layer, values in series.act_max.items():
        dtype = series.dtypes.get(layer, "")
        largest = held[dtype].largest if dtype in held else math.inf
        latest = values[-1] if values else 0.0
        finite = 0 < latest < math.inf and largest < math.inf
        if finite and math.log2(largest / latest) < margin_bits:
            return True
    return False


def fp8_promotions(
    telemetry: Fp8Telemetry, step: int, leaf_dtypes: dict[str, str], settings: Guard
) -> list[Change]:
    """The fp8 layers whose casts, over the steps watched since they were last installed,
    flushed more than `FLUSH_WARNING` of a tensor's nonzero values to zero or saturated
    any (the trials' own evidence, `Fp8Telemetry.evidence`): their outputs are held in the
    region around them, so their range shows in the casts, not in the outputs."""
    found = []
    for name, stats in telemetry.stats.items():
        worst = stats.worst()
        dtype = leaf_dtypes.get(name, "")
        converted = formats.known(dtype) and formats.get(dtype).records_conversion  # fp8
        target = settings.target(dtype) if converted else None
        if worst is None or target is None:
            continue
        role, cast = worst
        saturated = max(stats.casts.values(), key=lambda c: c.saturated)
        if cast.flushed_share > FLUSH_WARNING:
            why = (
                f"its fp8 cast flushes {cast.flushed_share:.1%} of its nonzero "
                f"{ROLE_LABELS[role]} to zero in {cast.format} (amax {cast.amax:.3g})"
            )
        elif saturated.saturated:
            why = (
                f"its fp8 cast saturates {saturated.saturated} values at "
                f"{saturated.format}'s largest"
            )
        else:
            continue
        found.append(Change(step, PROMOTE, name, (name,), "fp8", target, why))
    return found


def widening(
    leaves: tuple[str, ...], leaf_dtypes: dict[str, str], settings: Guard
) -> tuple[str, str, tuple[str, ...]] | None:
    """How the guard widens ``leaves``: from their narrowest dtype to the first of
    ``promote`` wider than it, and which of them are narrower than that (None: none is
    there, or none can go wider)."""
    narrowest = min((leaf_dtypes[leaf] for leaf in leaves), key=WIDTH.__getitem__, default=None)
    target = None if narrowest is None else settings.target(narrowest)
    if narrowest is None or target is None:
        return None
    return (
        narrowest,
        target,
        tuple(leaf for leaf in leaves if WIDTH[leaf_dtypes[leaf]] < WIDTH[target]),
    )


def _trigger(room: Headroom, projected_to: int, settings: Guard) -> str | None:
    """Why ``room`` must be promoted now (None: it may stay)."""
    largest = element_limits()[room.dtype].largest
    crossing = room.first_crossing
    if room.outcome == Outcome.AT_RISK and crossing is not None:
        step, side = crossing
        return (
            f"{side} projected at step ~{step} ({room.trend}), within the guard's horizon "
            f"(step {projected_to}); largest |output| {room.observed_amax:.4g}, "
            f"{room.headroom_now_bits:.1f} bits below {largest:g}"
        )
    if room.forecast_bits_at_n < settings.margin_bits:
        return (
            f"largest |output| {room.observed_amax:.4g} is {room.headroom_now_bits:.1f} bits "
            f"below {largest:g} now and {room.forecast_bits_at_n:.1f} projected at step "
            f"{projected_to} ({room.trend}): inside the {settings.margin_bits:g}-bit margin"
        )
    return None


def owning_leaves(layer: str, leaf_dtypes: dict[str, str]) -> tuple[str, tuple[str, ...]]:
    """The module whose leaves carry ``layer``'s dtype, and those of them below fp32:
    ``layer`` itself where any leaf with parameters is at or below it, else its nearest
    ancestor that has one (``""``: the whole model). A layer whose own leaves are all fp32
    owns none to widen: the guard does not widen its neighbours in its place."""
    name = layer
    while True:
        below = [leaf for leaf in leaf_dtypes if _at_or_below(leaf, name)]
        if below or not name:
            low = (leaf for leaf in below if WIDTH.get(leaf_dtypes[leaf], 3) < WIDTH["fp32"])
            return name, tuple(low)
        name = name.rpartition(".")[0]


def _at_or_below(leaf: str, name: str) -> bool:
    return not name or leaf == name or leaf.startswith(name + ".")


def _escape(name: str) -> str:
    """A module name as a glob pattern that matches it alone (fnmatch has no escape)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def promoted_policy(policy: PolicyView, changes: list[Change], prefix: str = "") -> PolicyView:
    """``policy`` with a rule per change ahead of its own, newest first. ``prefix``: the
    submodule the policy landed on (its rules name leaves below it)."""
    rules = []
    for change in reversed(changes):
        names = [_escape(leaf.removeprefix(prefix)) for leaf in change.leaves]
        if names:
            name = f"guard step {change.step}"
            rules.append({"name": name, "patterns": names, "dtype": change.to_dtype})
    return policy.with_leading_rules(rules)
