"""Choosing among measured policies: the Pareto front and the best under a preference.

Pure functions over plain records, so the same choice can be made from a live study,
from summary.json, or in a test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TRAINING_PREFERENCES = ("speed", "memory", "balanced")
# The metrics each preference weighs, every one to be minimised.
PREFER_METRICS: dict[str, tuple[str, ...]] = {
    "speed": ("step_time_ms",),
    "memory": ("peak_memory_mb",),
    "balanced": ("step_time_ms", "peak_memory_mb"),
}
# Step times within this fraction of the fastest count as a tie: timing a shared machine
# is not finer than that. Peak memory within MEMORY_TIE of the least, and headroom within
# HEADROOM_TIE_BITS of the most, count as ties too (allocator rounding, one observed step).
# Memory is counted, not timed (exact bytes on the CPU, the allocator's peak on a device):
# its tie is narrow, so a policy that really stores less (a bf16 state beside an fp32 one,
# 0.6% of a peak) is not traded away for step time.
TIME_TIE = 0.05
MEMORY_TIE = 0.001
HEADROOM_TIE_BITS = 1.0


@dataclass(frozen=True)
class Candidate:
    """A measured policy: the baseline or a finished trial. ``identity`` names the policy
    itself (its rules as sorted JSON), so that a tie is broken the same way whatever the
    trials' numbers or order; ``headroom_bits`` is its least activation headroom as the
    trial measured it (None: not measured)."""

    key: Any  # trial number, or "baseline"
    accuracy: float
    peak_memory_mb: float
    step_time_ms: float
    feasible: bool
    identity: str = ""
    headroom_bits: float | None = None


def dominates(a: Candidate, b: Candidate) -> bool:
    """a is at least as good as b in accuracy, memory and time, and better in one."""
    at_least = (
        a.accuracy >= b.accuracy
        and a.peak_memory_mb <= b.peak_memory_mb
        and a.step_time_ms <= b.step_time_ms
    )
    better = (
        a.accuracy > b.accuracy
        or a.peak_memory_mb < b.peak_memory_mb
        or a.step_time_ms < b.step_time_ms
    )
    return at_least and better


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other candidate dominates, in input order."""
    return [c for c in candidates if not any(dominates(o, c) for o in candidates)]


def preference_score(
    metrics: Mapping[str, float], prefer: str, reference: Mapping[str, float]
) -> float:
    """How good a measured policy is for the preference, lower is better: the sum of its
    preferred metrics, each relative to ``reference`` (the fp32 baseline, or the best
    value seen). The one ranking every part of a search uses."""
    return sum(metrics[m] / reference[m] for m in PREFER_METRICS[prefer])


def _metrics(candidate: Candidate) -> dict[str, float]:
    return {"step_time_ms": candidate.step_time_ms, "peak_memory_mb": candidate.peak_memory_mb}


def rank_key(candidate: Candidate, prefer: str, reference: Candidate) -> float:
    """The preference score of a candidate against the reference (lower is better)."""
    return preference_score(_metrics(candidate), prefer, _metrics(reference))


def select_best(
    candidates: Sequence[Candidate], prefer: str = "speed", reference: Candidate | None = None
) -> Candidate | None:
    """The best feasible candidate, by one rule: the preferred objective first, then the
    ties within measurement noise broken by more headroom, then the other objectives,
    then the policy's identity.

    - ``speed``: lowest step time (within ``TIME_TIE`` of the fastest counts as equal);
    - ``memory``: lowest peak memory (within ``MEMORY_TIE`` of the least);
    - ``balanced``: lowest sum of step time and memory, each relative to ``reference``
      (the fp32 baseline), within ``TIME_TIE`` of the lowest.
    Among those tied: the most headroom (`Candidate.headroom_bits`, within
    ``HEADROOM_TIE_BITS`` of the most; a candidate that measured none stays), then the
    other objectives (``speed``: memory, then accuracy; ``memory``: step time, then
    accuracy; ``balanced``: accuracy), then the exact preferred figure, then the policy's
    identity (`Candidate.identity`) and its key. Every stage keeps a set defined by the
    best value in it, so the same candidates give the same choice in any order.
    """
    if prefer not in TRAINING_PREFERENCES:
        raise ValueError(f"prefer: expected one of {TRAINING_PREFERENCES}, got {prefer!r}")
    pool = [c for c in candidates if c.feasible]
    if not pool:
        return None
    base = reference or min(pool, key=_identity)

    def balanced(c: Candidate) -> float:
        return rank_key(c, "balanced", base)

    time, memory = _by("step_time_ms"), _by("peak_memory_mb")
    primary = {"speed": time, "memory": memory, "balanced": balanced}[prefer]
    Stage = tuple[Callable[[Candidate], float], float]
    others: dict[str, list[Stage]] = {
        "speed": [(memory, MEMORY_TIE), (_accuracy, 0.0)],
        "memory": [(time, TIME_TIE), (_accuracy, 0.0)],
        "balanced": [(_accuracy, 0.0)],
    }
    stages: list[Stage] = [
        (primary, MEMORY_TIE if prefer == "memory" else TIME_TIE),
        (_headroom, HEADROOM_TIE_BITS),
        *others[prefer],
    ]
    for metric, tie in stages:
        pool = _tied(pool, metric, tie, absolute=metric is _headroom)
    return min(pool, key=lambda c: (primary(c), _identity(c)))


def _by(name: str) -> Callable[[Candidate], float]:
    return lambda c: float(getattr(c, name))


def _accuracy(c: Candidate) -> float:
    return -c.accuracy


def _headroom(c: Candidate) -> float:
    """Less is better, as every stage reads it: the headroom negated; none measured ties."""
    return -math.inf if c.headroom_bits is None else -c.headroom_bits


def _identity(c: Candidate) -> tuple[str, str]:
    return c.identity, str(c.key)


def _tied(
    pool: list[Candidate], metric: Callable[[Candidate], float], tie: float, absolute: bool
) -> list[Candidate]:
    """The candidates within ``tie`` of the best (lowest) value: a fraction of it, or
    ``absolute`` units. Candidates whose value is -inf (none measured) are kept."""
    values = [metric(c) for c in pool]
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return pool
    best = min(finite)
    bound = best + tie if absolute else best + abs(best) * tie
    return [c for c, v in zip(pool, values, strict=True) if not math.isfinite(v) or v <= bound]
