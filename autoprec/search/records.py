"""A measured trial as a search reads it back from its study: the policy, what the trial
measured, and how it stands against the fp32 baseline."""

from __future__ import annotations

from dataclasses import dataclass

from optuna.trial import FrozenTrial

from autoprec.policy import Policy
from autoprec.search.studies import RECORD_ATTR
from autoprec.trial import TrialResult


@dataclass(frozen=True)
class TrialRecord:
    """One measured policy, as the progress display and the summary see it."""

    number: int | str
    policy: Policy
    result: TrialResult
    accuracy_drop: float | None
    feasible: bool


def record_of(trial: FrozenTrial, tolerance: float) -> TrialRecord:
    """A stored trial; feasibility follows the tolerance in force now."""
    attrs = trial.user_attrs[RECORD_ATTR]
    drop = attrs.get("accuracy_drop")
    return TrialRecord(
        trial.number,
        Policy.from_dict(attrs["policy"]),
        TrialResult.from_dict(attrs["result"]),
        drop,
        drop is not None and drop <= tolerance + 1e-12,
    )
