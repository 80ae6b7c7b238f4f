"""A measured trial as a search reads it back from its study: the policy, what the trial
measured, and how it stands against the fp32 baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from autoprec.inference.measure import InferenceResult
from autoprec.policy import Policy
from autoprec.search.studies import RECORD_ATTR
from autoprec.trial import TrialResult

Result = TrialResult | InferenceResult


@dataclass(frozen=True)
class Feasibility:
    """When a measured policy counts as good enough: its accuracy drop from fp32 at most
    ``tolerance``; for serving, also at least ``min_top1_agreement`` with fp32's top-1
    predictions and at most ``max_rel_deviation`` of relative output deviation, where the
    scenario sets them (the critical preset: every prediction as fp32's)."""

    tolerance: float
    min_top1_agreement: float | None = None
    max_rel_deviation: float | None = None

    def judge(self, result: Result, drop: float | None) -> bool:
        if result.state != "complete" or drop is None or drop > self.tolerance + 1e-12:
            return False
        if isinstance(result, InferenceResult):
            agreement, deviation = result.top1_agreement, result.max_rel_deviation
            if self.min_top1_agreement is not None and (
                agreement is None or agreement < self.min_top1_agreement - 1e-12
            ):
                return False
            if self.max_rel_deviation is not None and (
                deviation is None or deviation > self.max_rel_deviation
            ):
                return False
        return True


@dataclass(frozen=True)
class TrialRecord:
    """One measured policy, as the progress display and the summary see it."""

    number: int | str
    policy: Policy
    result: Result
    accuracy_drop: float | None
    feasible: bool


def result_of(data: dict[str, Any]) -> Result:
    """A stored result: a serving measurement (it has a latency), or a training trial's."""
    if "latency_p50_ms" in data:
        return InferenceResult.from_dict(data)
    return TrialResult.from_dict(data)


def record_of(trial: FrozenTrial, feasibility: Feasibility) -> TrialRecord:
    """A stored trial; feasibility follows the settings in force now."""
    attrs = trial.user_attrs[RECORD_ATTR]
    drop = attrs.get("accuracy_drop")
    result = result_of(attrs["result"])
    return TrialRecord(
        trial.number,
        Policy.from_dict(attrs["policy"]),
        result,
        drop,
        feasibility.judge(result, drop),
    )
