"""A measured trial as a search reads it back from its study: the policy, what the trial
measured, and how it stands against the fp32 baseline. What kind of result a study holds
is its mode's (`autoprec.trials.base.Trials.result_type`), never guessed from the data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from autoprec.policy import Policy
from autoprec.study._studies import RECORD_ATTR
from autoprec.trials.base import Feasibility, Result

__all__ = ["Feasibility", "Result", "TrialRecord", "record_of", "result_of"]


@dataclass(frozen=True)
class TrialRecord:
    """One measured policy, as the progress display and the summary see it."""

    number: int | str
    policy: Policy
    result: Result
    accuracy_drop: float | None
    feasible: bool


def result_of(data: dict[str, Any], result_type: type[Result]) -> Result:
    """A stored result, read as the study's mode reads its results."""
    return result_type.from_dict(data)


def record_of(
    trial: FrozenTrial, feasibility: Feasibility, result_type: type[Result]
) -> TrialRecord:
    """A stored trial; feasibility follows the settings in force now."""
    attrs = trial.user_attrs[RECORD_ATTR]
    drop = attrs.get("accuracy_drop")
    result = result_of(attrs["result"], result_type)
    return TrialRecord(
        trial.number,
        Policy.from_dict(attrs["policy"]),
        result,
        drop,
        feasibility.judge(result, drop),
    )
