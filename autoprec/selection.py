"""Choosing among measured policies: the Pareto front and the best under a preference.

Pure functions over plain records, so the same choice can be made from a live study,
from summary.json, or in a test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
# is not finer than that, and a tie goes to less memory, then higher accuracy.
TIME_TIE = 0.05


@dataclass(frozen=True)
class Candidate:
    """A measured policy: the baseline or a finished trial."""

    key: Any  # trial number, or "baseline"
    accuracy: float
    peak_memory_mb: float
    step_time_ms: float
    feasible: bool


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
    """The best feasible candidate.

    - ``speed``: lowest step time (within ``TIME_TIE`` of the fastest counts as equal),
      then lowest memory, then highest accuracy;
    - ``memory``: lowest peak memory, then lowest step time, then highest accuracy;
    - ``balanced``: lowest sum of step time and memory, each relative to ``reference``
      (the fp32 baseline; within ``TIME_TIE`` counts as equal), then highest accuracy.
    """
    if prefer not in TRAINING_PREFERENCES:
        raise ValueError(f"prefer: expected one of {TRAINING_PREFERENCES}, got {prefer!r}")
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return None
    if prefer == "memory":
        return min(feasible, key=lambda c: (c.peak_memory_mb, c.step_time_ms, -c.accuracy))
    if prefer == "speed":
        fastest = min(c.step_time_ms for c in feasible)
        tied = [c for c in feasible if c.step_time_ms <= fastest * (1 + TIME_TIE)]
        return min(tied, key=lambda c: (c.peak_memory_mb, -c.accuracy, c.step_time_ms))

    def score(c: Candidate) -> float:
        return rank_key(c, "balanced", reference or feasible[0])

    lowest = min(score(c) for c in feasible)
    tied = [c for c in feasible if score(c) <= lowest * (1 + TIME_TIE)]
    return min(tied, key=lambda c: (-c.accuracy, score(c)))
