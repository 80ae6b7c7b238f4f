"""Guided search: find the groups that must stay in higher precision in few trials.

A strategy proposes the next policy (as Optuna parameters) from the trials finished so
far and those running elsewhere; it keeps no state of its own, so a continued study or
several workers sharing one get the same proposals from the same history, in any order.
Pure: no Optuna objects, no MLflow.

`GuidedStrategy`, given the groups ranked riskiest first (by a profile):

1. seed: every group in one low dtype, for each low dtype the space allows (fp16 with
   the dynamic loss scaling of the space's anchors; fp8 as the uniform-fp8 anchor has
   it, the groups that cannot take fp8 in bf16 where they may);
2. bisect: per low dtype, the one whose seed did better for the preference first, the
   smallest k such that keeping the k riskiest groups in fp32 and the rest in that dtype
   is feasible. k = n is all fp32, feasible by definition; a pruned or failed trial
   counts as infeasible. The search gallops (k = 1, 2, 4, ...) and then halves the
   bracket, as the few layers that must stay in fp32 are usually a small prefix:
   about 2 log2(k) + 1 trials, never more than 2 log2(n) + 2. fp8 is bisected in the
   profile's fp8 order (each Linear's fp8 deviation against bf16, `autoprec.numerics.fp8_risk`)
   where it has one;
3. refine: try to drop single groups from the kept set (the risk order is a ranking,
   not an oracle), and, for fp16 and fp8 where the space also has bf16, to run the kept
   groups in bf16
   rather than fp32 (bf16 has fp32's range, so overflow-prone layers often survive in
   it, and it halves their activation memory).

In a space that searches optimizer states per group (`autoprec.optim.space`), the same
three phases run over the state groups, with every layer in its highest dtype: seed every
group in each quantised kind offered, bisect the groups in the order of what that kind's
quantiser lost on the fp32 baseline's real states (``state_losses``:
`autoprec.numerics.state_health.rank_state_groups`), keep the needed ones in fp32, then
try them in bf16 states. Layer proposals keep every state in its highest kind. Once a
feasible policy that moved only the layers and one that moved only the states are known
(after the seeds, and again at the end), the search combines them ("combine"): the best
of each for the preference, both levers at once.

When these are done, `propose` returns None and the caller hands the study to its
multi-objective sampler, which tunes the rest and the loss scale.

`FallbackStrategy` is the one-at-a-time fallback of Intel Neural Compressor, kept as a
reference point for benchmarks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from torch import nn

import autoprec.formats as formats
from autoprec.errors import AutoprecError, SpaceError
from autoprec.optim.state import STATE_BYTES_PER_ELEMENT
from autoprec.selection import PREFER_METRICS, TRAINING_PREFERENCES, preference_score
from autoprec.space import Group, SearchSpace, dtype_beside, space_rules
from autoprec.space.groups import formats_among, widest
from autoprec.space.loss_scale import torch_default_params

if TYPE_CHECKING:
    from autoprec.formats import Format
    from autoprec.numerics.state_health import GroupStateLoss
    from autoprec.optim.space import StateChoice

Proposal = tuple[dict[str, Any], str]
# The parameters of each lever: the layers' dtypes, the optimizer states and masters.
_LAYER_KEYS = ("dtype.",)
_STATE_KEYS = ("state.", "master.")


def _part(params: Mapping[str, Any], lever: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k.startswith(lever)}


@dataclass(frozen=True)
class Observation:
    """A finished trial as a strategy sees it.

    ``params`` are the trial's Optuna parameters (as `SearchSpace.suggest` or
    `SearchSpace.uniform_params` produce them); ``state`` is "complete", "pruned" or
    "failed"; ``feasible`` means completed with the accuracy drop within tolerance.
    """

    params: Mapping[str, Any]
    state: str
    feasible: bool
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Outcome:
    feasible: bool
    metrics: Mapping[str, float]
    params: Mapping[str, Any] = field(default_factory=dict)


class _Strategy:
    """What both strategies share: policies as dtype assignments, and what is known.

    Given the model (and the device kind), policies are told apart by what a trial of
    them measures (`Policy.identity`), so that two that run alike count as one; without
    it, by each group's dtype."""

    def __init__(
        self, space: SearchSpace, model: nn.Module | None = None, device: Any = None
    ) -> None:
        self.space = space
        self.model = model
        self.device = device
        self._keys: dict[str, str | None] = {}
        self.groups: tuple[Group, ...] = space.groups
        states = space_rules(space.mode).searched_states(space)
        self.state_groups: tuple[StateChoice, ...] = () if states is None else states.groups
        scales = space_rules(space.mode).scales_loss and bool(space.groups)
        scaling = torch_default_params(space.loss_scale) if scales else {}
        self._fp16_scaling = {k: v for k, v in scaling.items() if k.startswith("loss_scale.")}

    def propose(
        self, history: Sequence[Observation], pending: Sequence[Mapping[str, Any]] = ()
    ) -> Proposal | None:
        """The next parameters to try and the phase that proposes them ("seed", "bisect",
        "refine"; the fallback's "seed", "single", "accumulate"), or None when this
        strategy has nothing to try now: it is done, or what it needs next runs elsewhere
        (ask again once that finishes). Policies already measured (in ``history``) or
        running elsewhere (in ``pending``) are never proposed."""
        known: dict[str, _Outcome] = {}
        for observation in history:
            key = self._key(observation.params)
            if key is None:
                continue
            feasible = observation.state == "complete" and bool(observation.feasible)
            if key not in known or (feasible and not known[key].feasible):
                known[key] = _Outcome(feasible, dict(observation.metrics), dict(observation.params))
        busy = {self._key(params) for params in pending}
        for params, phase in self._plan(known, busy):
            key = self._key(params)
            if key not in known and key not in busy:
                return params, phase
        return None

    def _plan(self, known: dict[str, _Outcome], busy: set[str | None]) -> Iterator[Proposal]:
        raise NotImplementedError

    # -- policies as dtype assignments ----------------------------------------------------

    def _params(
        self, dtypes: Mapping[str, str], states: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """The parameters of a policy: layer ``dtypes`` by group, and in a space that
        searches optimizer states, ``states`` by state group (every other group, and
        every master weight, in its highest)."""
        params: dict[str, Any] = {f"dtype.{g.name}": dtypes[g.name] for g in self.groups}
        made = formats_among(dtypes.values())
        if any(f.scales_loss for f in made):
            params.update(self._fp16_scaling)
        if any(f.records_conversion for f in made) and len(self.space.fp8_recipes) > 1:
            params["fp8.recipe"] = self.space.anchor_recipe
        for choice in self.state_groups:
            params[f"state.{choice.name}"] = (states or {}).get(choice.name, _highest(choice))
            if len(choice.masters) > 1:
                params[f"master.{choice.name}"] = widest(choice.masters)
        return params

    def _assign(self, low: str, kept: set[str] | frozenset[str]) -> dict[str, str]:
        """Groups in ``kept`` in their highest dtype, the others in ``low`` where allowed;
        a group that cannot take fp8 runs beside it as the uniform-fp8 anchor runs it
        (`autoprec.space.dtype_beside`: bf16 where it may)."""

        def dtype(group: Group) -> str:
            if group.name in kept:
                return _high(group)
            if formats.get(low).converts:
                return dtype_beside(group, low)
            return low if low in group.dtypes else _high(group)

        return {g.name: dtype(g) for g in self.groups}

    def _key(self, params: Mapping[str, Any]) -> str | None:
        """What a trial of these parameters measures (`Policy.identity`); None for
        parameters of another space."""
        seen = json.dumps(dict(params), sort_keys=True, default=str)
        if seen not in self._keys:
            try:
                policy = self.space.policy(params)
                self._keys[seen] = policy.identity(self.model, self.device, mode=self.space.mode)
            except (KeyError, AutoprecError):
                self._keys[seen] = None
        return self._keys[seen]

    def _outcome(self, known: dict[str, _Outcome], params: Mapping[str, Any]) -> _Outcome | None:
        return known.get(self._key(params) or "")

    def _searchable(self, low: str, order: Sequence[str]) -> list[str]:
        """Groups of ``order`` that can run in ``low`` and also in something higher."""
        by_name = {g.name: g for g in self.groups}
        return [n for n in order if low in by_name[n].dtypes and _high(by_name[n]) != low]


# Headroom the start scale leaves below fp16's largest value (gradients grow as training
# goes on): 2**-4 of it.
_START_HEADROOM_LOG2 = 4


def fp16_start_scale_log2(space: SearchSpace, max_gradient: float | None) -> int | None:
    """The dynamic loss scale's start (log2) for the guided search's fp16 probes: the
    largest that keeps the largest gradient the profile saw ``2**-4`` under fp16's
    65504, within the space's ``init_scale_log2`` range, and never above torch's 2**16.
    A short trial then does not spend its first steps backing off from a scale that
    overflows (torch's default start costs one skipped step per halving), and the probes
    measure which layers are at risk. None: keep the space's default (no profile, or no
    such range)."""
    bounds = space.loss_scale.ranges.get("init_scale_log2")
    if max_gradient is None or not math.isfinite(max_gradient) or max_gradient <= 0 or not bounds:
        return None
    largest = min(f.limits.largest for f in formats.all_formats() if f.scales_loss)  # fp16's
    safe = math.floor(math.log2(largest / max_gradient)) - _START_HEADROOM_LOG2
    low, high = bounds
    return int(min(max(safe, low), high, 16))


def _highest(choice: StateChoice) -> str:
    """The state kind ``choice`` offers that stores the most (fp32 where it may)."""
    return max(choice.states, key=lambda kind: STATE_BYTES_PER_ELEMENT[kind])


def _state_kinds(groups: Sequence[StateChoice]) -> list[str]:
    """The kinds the guided search seeds and bisects, the fewest bytes first: every kind
    offered below fp32 except bf16 where narrower ones are offered (bf16 is where the
    refinement then tries the groups those keep)."""
    kinds = {kind for c in groups for kind in c.states}
    offered = kinds - {f.name for f in formats_among(kinds) if f.reference}
    if offered - {_wide()}:
        offered.discard(_wide())
    return sorted(offered, key=lambda kind: (STATE_BYTES_PER_ELEMENT[kind], kind))


def _high(group: Group) -> str:
    """The widest-ranged dtype ``group`` offers (a serving group may offer only int8)."""
    return widest(group.dtypes)


def _low_formats() -> list[Format]:
    """The formats below fp32 the guided search seeds: fp16, bf16, then fp8, then int8."""
    low = [
        f for f in formats.all_formats() if f.low_precision and (f.autocasts or f.policy_records)
    ]
    return sorted(low, key=lambda f: (not f.autocasts, not f.converts))


def _wide() -> str:
    """The low format with fp32's range (bf16): the refine phase tries kept groups in it."""
    autocast = [f for f in _low_formats() if f.autocasts]
    return max(autocast, key=lambda f: f.limits.range_bits).name


def _kept_in_wide(low: str) -> bool:
    """Whether the refine tries ``low``'s kept groups in `_wide`: a narrower training format."""
    made = formats.get(low)
    return bool(made.trains) and made.limits.range_bits < formats.get(_wide()).limits.range_bits


class GuidedStrategy(_Strategy):
    """Seed, bisect over the risk order, refine (see the module docstring).

    ``space`` is fitted to the model; ``risk_order`` names its groups riskiest first
    (groups it leaves out are taken as the least risky, in model order), and
    ``fp8_risk_order`` riskiest in fp8 first, the order fp8 is bisected in (groups it
    leaves out follow in ``risk_order``'s order); ``prefer``
    ("speed", "memory" or "balanced") decides which low dtype is searched first; with
    ``model`` and ``device``, policies that run alike count as one.
    """

    def __init__(
        self,
        space: SearchSpace,
        risk_order: Sequence[str],
        prefer: str = "speed",
        model: nn.Module | None = None,
        device: Any = None,
        max_gradient: float | None = None,
        fp8_risk_order: Sequence[str] | None = None,
        state_losses: Sequence[GroupStateLoss] = (),
    ) -> None:
        super().__init__(space, model, device)
        start = fp16_start_scale_log2(space, max_gradient)
        if start is not None:
            self._fp16_scaling["loss_scale.init_scale_log2"] = start
        if prefer not in TRAINING_PREFERENCES:
            raise AutoprecError(
                f"prefer: expected one of {', '.join(TRAINING_PREFERENCES)}, got {prefer!r}"
            )
        names = [g.name for g in self.groups]
        unknown = [n for n in risk_order if n not in names]
        if unknown:
            raise SpaceError(
                f"{space.source}: risk order names {unknown[0]!r}, not a group of the space "
                f"({', '.join(names)})"
            )
        ranked = list(dict.fromkeys(risk_order))
        self.risk_order = ranked + [n for n in names if n not in ranked]
        # fp8 is bisected in the profile's fp8 order (`autoprec.numerics.fp8_risk`) where it
        # has one.
        fp8_ranked = list(dict.fromkeys(fp8_risk_order or ()))
        stray = [n for n in fp8_ranked if n not in names]
        if stray:
            raise SpaceError(
                f"{space.source}: fp8 risk order names {stray[0]!r}, not a group of the space"
            )
        self.fp8_risk_order = fp8_ranked + [n for n in self.risk_order if n not in fp8_ranked]
        self.prefer = prefer
        # fp8 where the space offers it (training: torchao's float8 Linear layers); serving
        # spaces may also offer int8 (to the layers that take it).
        self.low_dtypes = [f.name for f in _low_formats() if self._searchable(f.name, names)]
        # Optimizer states (`autoprec.optim.space`): each kind a group could be stored in
        # below its highest, the fewest bytes first, bisected in the order of what that
        # kind's quantiser lost on the baseline's states (`StateSpace.risk_order`).
        state_names = [c.name for c in self.state_groups]
        kinds = _state_kinds(self.state_groups)
        self.state_kinds = [k for k in kinds if self._state_searchable(k, state_names)]
        states = space.optimizer_states
        self.state_risk_orders = {
            kind: states.risk_order(state_losses, kind) if states is not None else state_names
            for kind in self.state_kinds
        }

    def _plan(self, known: dict[str, _Outcome], busy: set[str | None]) -> Iterator[Proposal]:
        for low in self.low_dtypes:
            yield self._params(self._assign(low, set())), "seed"
        for kind in self.state_kinds:
            yield self._states_at(kind, set()), "seed"
        yield from self._combined(known)
        for low in self._dtype_order(known):
            converts = formats.get(low).converts
            order = self._searchable(low, self.fp8_risk_order if converts else self.risk_order)
            at = partial(self._layers_at, low)
            needed = yield from self._bisect(order, at, known, busy)
            if needed is not None:
                kept = yield from self._drop_singles(order[:needed], at, known, busy)
                if kept is not None and _kept_in_wide(low):
                    yield from self._in_bf16(kept, self._layers_in_bf16(low), known, busy)
        for kind in self.state_kinds:
            order = self._state_searchable(kind, self.state_risk_orders[kind])
            at = partial(self._states_at, kind)
            needed = yield from self._bisect(order, at, known, busy)
            if needed is not None:
                kept = yield from self._drop_singles(order[:needed], at, known, busy)
                if kept is not None and kind != _wide():
                    yield from self._in_bf16(kept, self._states_in_bf16(kind), known, busy)
        yield from self._combined(known)

    def _combined(self, known: dict[str, _Outcome]) -> Iterator[Proposal]:
        """Both levers at once: the layers of the best feasible policy (for the
        preference) that moved only the layers, with the states of the best feasible one
        that moved only the states; nothing until both are known."""
        if not self.state_groups:
            return
        high = self._params({g.name: _high(g) for g in self.groups})

        def moved_only(lever: tuple[str, ...], other: tuple[str, ...]) -> list[_Outcome]:
            return [
                o
                for o in known.values()
                if o.feasible
                and _part(o.params, other) == _part(high, other)
                and _part(o.params, lever) != _part(high, lever)
            ]

        layers = self._best(moved_only(_LAYER_KEYS, _STATE_KEYS))
        states = self._best(moved_only(_STATE_KEYS, _LAYER_KEYS))
        if layers is not None and states is not None:
            yield {**layers.params, **_part(states.params, _STATE_KEYS)}, "combine"

    def _best(self, outcomes: list[_Outcome]) -> _Outcome | None:
        """The outcome best for the preference, equals by the other objective (fp16 and
        bf16 layers weigh alike, and bf16 may be much faster), then the first; None for
        none."""
        wanted = PREFER_METRICS[self.prefer]
        scored = [
            o for o in outcomes if all(math.isfinite(o.metrics.get(m, math.nan)) for m in wanted)
        ]
        if not scored:
            return None
        best = {m: min(o.metrics[m] for o in scored) for m in wanted}
        other = [m for m in PREFER_METRICS["balanced"] if m not in wanted]

        def rank(outcome: _Outcome) -> tuple[float, ...]:
            then = [outcome.metrics.get(m, math.inf) for m in other]
            return (preference_score(outcome.metrics, self.prefer, best), *then)

        return min(scored, key=rank)

    def _layers_at(self, low: str, kept: set[str]) -> dict[str, Any]:
        return self._params(self._assign(low, kept))

    def _states_at(self, kind: str, kept: set[str]) -> dict[str, Any]:
        """Layers in their highest dtypes; state groups in ``kept`` in their highest kind,
        the others in ``kind`` where they offer it."""
        states = {
            c.name: kind if kind in c.states and c.name not in kept else _highest(c)
            for c in self.state_groups
        }
        return self._params({g.name: _high(g) for g in self.groups}, states)

    def _dtype_order(self, known: dict[str, _Outcome]) -> list[str]:
        """Low dtypes, the one whose seed did better for the preference first (a seed that
        measured nothing comes last)."""
        seeds = {d: self._outcome(known, self._layers_at(d, set())) for d in self.low_dtypes}
        wanted = PREFER_METRICS[self.prefer]
        measured = {
            d: o.metrics
            for d, o in seeds.items()
            if o is not None and all(math.isfinite(o.metrics.get(m, math.nan)) for m in wanted)
        }
        best = {m: min(v[m] for v in measured.values()) for m in wanted} if measured else {}

        def score(dtype: str) -> float:
            if dtype not in measured:
                return math.inf
            return preference_score(measured[dtype], self.prefer, best)

        def feasible(dtype: str) -> bool:
            outcome = seeds[dtype]
            return outcome is not None and outcome.feasible

        # A dtype whose uniform seed was feasible first: bisecting one whose seed failed
        # measures why it failed (a scaler's start-up, say) before which layers are at risk.
        return sorted(
            self.low_dtypes,
            key=lambda d: (not feasible(d), score(d), self.low_dtypes.index(d)),
        )

    def _bisect(
        self,
        order: list[str],
        at: Callable[[set[str]], dict[str, Any]],
        known: dict[str, _Outcome],
        busy: set[str | None],
    ) -> Generator[Proposal, None, int | None]:
        """Probe prefixes of ``order`` kept high (``at(kept)``: the policy's parameters);
        returns the smallest feasible prefix length once the bracket closes, None while
        probes are missing or running."""
        n = len(order)

        def state(k: int) -> bool | None:
            if k == n:
                return True  # every searchable group high: fp32 where the space has it
            outcome = self._outcome(known, at(set(order[:k])))
            return None if outcome is None else outcome.feasible

        states = {k: state(k) for k in range(n + 1)}
        hi = min(k for k, s in states.items() if s)
        lo = max((k for k, s in states.items() if s is False and k < hi), default=-1)
        if hi - lo == 1:
            return hi
        # The next probe, or while it runs elsewhere, the probes that follow either outcome.
        brackets = [(lo, hi)]
        while brackets:
            a, b = brackets.pop(0)
            if b - a <= 1:
                continue
            probe = _probe(a, b, galloping=b == n)
            params = at(set(order[:probe]))
            if self._key(params) not in busy:
                yield params, "seed" if probe == 0 else "bisect"
                return None
            brackets += [(a, probe), (probe, b)]
        return None

    def _drop_singles(
        self,
        kept: list[str],
        at: Callable[[set[str]], dict[str, Any]],
        known: dict[str, _Outcome],
        busy: set[str | None],
    ) -> Generator[Proposal, None, list[str] | None]:
        """Drop single groups from the kept set, least risky first (the last one was
        needed: keeping one fewer was infeasible); returns the groups still kept, or None
        after proposing a probe."""
        current = list(kept)
        for name in reversed(kept[:-1]):
            smaller = [n for n in current if n != name]
            params = at(set(smaller))
            outcome = self._outcome(known, params)
            if outcome is None:
                if self._key(params) not in busy:
                    yield params, "refine"
                    return None
            elif outcome.feasible:
                current = smaller
        return current

    def _in_bf16(
        self,
        kept: list[str],
        swap: tuple[list[str], Callable[[list[str], set[str]], dict[str, Any]]],
        known: dict[str, _Outcome],
        busy: set[str | None],
    ) -> Iterator[Proposal]:
        """The kept groups in bf16 rather than their highest: all of them at once; if that
        fails, one at a time, least risky first. ``swap``: the kept groups that may, and
        the parameters with a set of them in bf16."""
        swappable, at = swap
        names = [n for n in kept if n in swappable]
        if not names:
            return
        together = at(kept, set(names))
        outcome = self._outcome(known, together)
        if outcome is None or outcome.feasible or len(names) == 1:
            if outcome is None and self._key(together) not in busy:
                yield together, "refine"
            return
        accepted: set[str] = set()
        for name in reversed(names):
            params = at(kept, accepted | {name})
            outcome = self._outcome(known, params)
            if outcome is None:
                if self._key(params) not in busy:
                    yield params, "refine"
                    return
            elif outcome.feasible:
                accepted.add(name)

    def _layers_in_bf16(
        self, low: str
    ) -> tuple[list[str], Callable[[list[str], set[str]], dict[str, Any]]]:
        pair = {formats.reference().name, _wide()}
        swappable = [g.name for g in self.groups if pair <= set(g.dtypes)]

        def at(kept: list[str], in_bf16: set[str]) -> dict[str, Any]:
            return self._params({**self._assign(low, set(kept)), **dict.fromkeys(in_bf16, _wide())})

        return swappable, at

    def _states_in_bf16(
        self, kind: str
    ) -> tuple[list[str], Callable[[list[str], set[str]], dict[str, Any]]]:
        pair = {formats.reference().name, _wide()}
        swappable = [c.name for c in self.state_groups if pair <= set(c.states)]

        def at(kept: list[str], in_bf16: set[str]) -> dict[str, Any]:
            params = self._states_at(kind, set(kept))
            params.update({f"state.{name}": _wide() for name in in_bf16})
            return params

        return swappable, at

    def _state_searchable(self, kind: str, order: Sequence[str]) -> list[str]:
        """State groups of ``order`` that can take ``kind`` and also something that
        stores more."""
        by_name = {c.name: c for c in self.state_groups}
        return [n for n in order if kind in by_name[n].states and _highest(by_name[n]) != kind]


def _probe(lo: int, hi: int, galloping: bool) -> int:
    """The next prefix length to try strictly between ``lo`` (infeasible, or -1) and
    ``hi`` (feasible): 0, 1, 2, 4, ... while no smaller feasible one is known, then the
    middle of the bracket."""
    if galloping:
        step = max(lo + 1, 2 * lo)
        if step < hi:
            return step
    return (lo + hi) // 2


class FallbackStrategy(_Strategy):
    """One-at-a-time fallback in the style of Intel Neural Compressor.

    All groups in ``dtype`` (fp16 where the space has it, else bf16); if that is
    infeasible, each group alone back in fp32 (one trial each, in model order); if none
    of those is feasible, groups go back in fp32 cumulatively, ranked by the accuracy
    their single trials reached (best first), until the policy is feasible.
    """

    def __init__(
        self,
        space: SearchSpace,
        dtype: str | None = None,
        model: nn.Module | None = None,
        device: Any = None,
    ) -> None:
        super().__init__(space, model, device)
        names = [g.name for g in self.groups]
        low = [f.name for f in _low_formats() if f.autocasts]
        if dtype is None:
            dtype = next((d for d in low if self._searchable(d, names)), low[0])
        if dtype not in low:
            raise AutoprecError(f"dtype: expected {' or '.join(low)}, got {dtype!r}")
        self.low = dtype
        self.order = self._searchable(dtype, names)

    def _plan(self, known: dict[str, _Outcome], busy: set[str | None]) -> Iterator[Proposal]:
        if not self.order:
            return
        steps: list[tuple[set[str], str]] = [(set(), "seed")]
        if len(self.order) > 1:  # with one group, its fallback is the all-fp32 baseline
            steps += [({name}, "single") for name in self.order]
        singles: dict[str, _Outcome | None] = {}
        for kept, phase in steps:
            outcome = self._outcome(known, self._params(self._assign(self.low, kept)))
            if outcome is not None and outcome.feasible:
                return
            if phase == "single":
                singles[next(iter(kept))] = outcome
            yield self._params(self._assign(self.low, kept)), phase

        def accuracy(name: str) -> float:
            outcome = singles[name]
            value = None if outcome is None else outcome.metrics.get("accuracy")
            return -math.inf if value is None or not math.isfinite(value) else value

        ranked = sorted(self.order, key=lambda n: (-accuracy(n), self.order.index(n)))
        for count in range(2, len(ranked)):
            kept = set(ranked[:count])
            outcome = self._outcome(known, self._params(self._assign(self.low, kept)))
            if outcome is not None and outcome.feasible:
                return
            yield self._params(self._assign(self.low, kept)), "accumulate"
