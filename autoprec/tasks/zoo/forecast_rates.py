"""The range forecast measured as a classifier on the zoo (issue 27).

Each zoo task is trained as a search's trials train it (`autoprec.trials.training.run_trial`,
stopped early against fp32 trained the same way), under uniform fp16 (dynamic loss
scaling), uniform bf16 and, for a fragile task, fp16 with its failing group in fp32. A
trial's verdict is what the search makes of it: ``stopped`` (the trial itself failed),
``at risk`` (the forecast crosses within the run; infeasible by default), ``cannot tell``
(kept feasible; the trial was extended, or is confirmed at --train-steps) or ``clear``.
Its truth is the zoo's long run of the same task and policy (`autoprec.tasks.zoo.truth`,
``benchmarks/zoo_truth.json``): the failure step, if any, within the forecast's horizon
(10x the trial's steps).

The rates (`Rates`): false alarms (trials at risk whose long run holds within the
horizon: healthy and boundary ones, and fragile ones that fail later or not in that
policy), recall (trials that fail within the horizon, at risk or stopped), and the share
of predicted crossing steps within 2x of the real failure step; each for the overflow
side and the underflow side (flush to zero, gradients, a collapsing loss scale) alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from autoprec.numerics.forecast import Forecast
from autoprec.policy import LossScale, Policy, Rule
from autoprec.trials.base import TrialState

HEALTHY, FRAGILE, BOUNDARY = "healthy", "fragile", "boundary"
OVERFLOW, UNDERFLOW = "overflow", "underflow"
FLAGGED = ("at risk", "stopped")


@dataclass(frozen=True)
class Verdict:
    """One trial's verdict beside its truth."""

    task: str
    kind: str
    policy: str
    steps: int
    outcome: str  # stopped, at risk, cannot tell, clear
    side: str | None  # the side the forecast (or the trial's failure) names
    predicted_step: int | None  # the forecast's first crossing (the stop's step)
    failure_step: int | None  # the long run's first failure (None: it holds to its end)
    truth_side: str | None
    extended_steps: int = 0
    reason: str | None = None

    @property
    def horizon(self) -> int:
        return 10 * self.steps

    @property
    def fails_within(self) -> bool:
        return self.failure_step is not None and self.failure_step <= self.horizon

    @property
    def flagged(self) -> bool:
        return self.outcome in FLAGGED

    @property
    def within_2x(self) -> bool | None:
        """Whether the predicted crossing is within 2x of the real failure (None: there is
        no pair to compare: not flagged by the forecast, or no failure)."""
        if self.outcome != "at risk" or self.predicted_step is None or not self.fails_within:
            return None
        assert self.failure_step is not None
        real = max(self.failure_step, 1)
        return real / 2 <= max(self.predicted_step, 1) <= 2 * real


def _side_of(text: str | None) -> str | None:
    if not text:
        return None
    low = ("shrinks below", "gradient underflow", "loss scale", "underflow", "flush", "scale")
    return UNDERFLOW if any(word in text for word in low) else OVERFLOW


def _truth_side(run: dict[str, Any]) -> str | None:
    """The mechanism of a long run's first failure: overflow (a non-finite output or loss)
    or underflow (a flush to zero, a collapsing scale, a metric that collapsed first)."""
    events = {
        OVERFLOW: [run.get("first_nonfinite_output_step"), run.get("first_nonfinite_loss_step")],
        UNDERFLOW: [
            run.get("first_flush_step"),
            run.get("scale_collapse_step"),
            run.get("metric_collapse_step"),
        ],
    }
    firsts = {
        side: min((s for s in steps if s is not None), default=None)
        for side, steps in events.items()
    }
    found = [(step, side) for side, step in firsts.items() if step is not None]
    return min(found)[1] if found else None


def policies(kind: str, failing_groups: Iterable[str]) -> list[tuple[str, Policy]]:
    """The policies a task's trials are judged under, by the labels of the truth table."""
    chosen = [("fp16", Policy.uniform("fp16")), ("bf16", Policy.uniform("bf16"))]
    groups = tuple(failing_groups)
    if kind == FRAGILE and groups:
        keep = Policy((Rule("fp32", groups),), "fp16", LossScale("dynamic"), name="g")
        chosen.append(("fp16+group-fp32", keep))
    return chosen


def judge_task(name: str, steps: int, table: dict[str, Any]) -> list[Verdict]:
    """The verdicts of one zoo task's trials of ``steps`` steps, beside the truth."""
    from autoprec.devices import get_backend
    from autoprec.tasks.zoo import ZOO
    from autoprec.trials.training import Budget, EarlyStopping, run_trial

    entry = ZOO[name]
    row = table["tasks"].get(name)
    if row is None:
        return []
    kind = entry.kind.value
    task = entry.task()
    backend = get_backend("cpu")
    budget = Budget(steps=steps)
    baseline = run_trial(task, Policy.uniform("fp32"), backend, budget)
    stopping = EarlyStopping.from_baseline(baseline) if baseline.state == "complete" else None
    verdicts = []
    for label, policy in policies(kind, entry.failing_groups):
        runs = row["runs"].get(label) or []
        if not runs:
            continue
        truth = runs[0]  # seed 0: the trials' own seed
        result = run_trial(task, policy, backend, budget, stopping)
        ahead = Forecast.from_dict(result.forecast) if result.forecast else None
        step: int | None
        if result.state != TrialState.COMPLETE:
            outcome, side, step = "stopped", _side_of(result.reason), result.steps_run
        elif result.at_risk is not None:
            crossing = ahead.crossing() if ahead is not None else None
            outcome, side = "at risk", _side_of(result.at_risk)
            step = crossing[0] if crossing else (ahead.trial_steps if ahead else None)
        elif result.cannot_tell is not None:
            outcome, side, step = "cannot tell", None, None
        else:
            outcome, side, step = "clear", None, None
        verdicts.append(
            Verdict(
                name,
                kind,
                label,
                steps,
                outcome,
                side,
                step,
                truth.get("failure_step"),
                entry.side or _truth_side(truth),
                ahead.extended_steps if ahead else 0,
                result.at_risk or result.cannot_tell or result.reason,
            )
        )
    return verdicts


@dataclass(frozen=True)
class Rates:
    """The forecast's rates over a set of verdicts (None where there is nothing to count)."""

    trials: int
    false_alarms: int  # trials at risk whose run holds within the horizon
    holding: int  # trials whose run holds within the horizon
    flagged_failing: int  # trials that fail within the horizon, flagged or stopped
    failing: int  # trials that fail within the horizon
    within_2x: int
    compared: int  # flagged by the forecast with a real failure to compare
    cannot_tell: int
    extended: int

    @property
    def false_alarm_rate(self) -> float | None:
        return self.false_alarms / self.holding if self.holding else None

    @property
    def recall(self) -> float | None:
        return self.flagged_failing / self.failing if self.failing else None

    @property
    def crossing_within_2x(self) -> float | None:
        return self.within_2x / self.compared if self.compared else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "false_alarm_rate": self.false_alarm_rate,
            "recall": self.recall,
            "crossing_within_2x": self.crossing_within_2x,
        }


def rates(verdicts: Iterable[Verdict], side: str | None = None) -> Rates:
    """The rates over ``verdicts``; with ``side``, those of one side: false alarms named
    on it, recall of the runs that fail by it (a flag on either side counts: the trial is
    kept from the user), crossing steps of the flags on it."""
    chosen = list(verdicts)
    holding = [v for v in chosen if not v.fails_within]
    failing = [v for v in chosen if v.fails_within and (side is None or v.truth_side == side)]
    alarms = [v for v in holding if v.outcome == "at risk" and (side is None or v.side == side)]
    compared = [v for v in chosen if v.within_2x is not None and (side is None or v.side == side)]
    return Rates(
        trials=len(chosen),
        false_alarms=len(alarms),
        holding=len(holding),
        flagged_failing=sum(v.flagged for v in failing),
        failing=len(failing),
        within_2x=sum(bool(v.within_2x) for v in compared),
        compared=len(compared),
        cannot_tell=sum(v.outcome == "cannot tell" for v in chosen),
        extended=sum(v.extended_steps > 0 for v in chosen),
    )


def _percent(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{100 * value:.0f}%"


def rates_table(verdicts: list[Verdict]) -> str:
    """The rates as a Markdown table: all trials, then each side."""
    lines = [
        "| side | trials | false alarms | recall (fail within 10x) | crossing within 2x "
        "| cannot tell (extended) |",
        "|---|---|---|---|---|---|",
    ]
    for side in (None, OVERFLOW, UNDERFLOW):
        r = rates(verdicts, side)
        lines.append(
            f"| {side or 'all'} | {r.trials} | {r.false_alarms}/{r.holding} "
            f"({_percent(r.false_alarm_rate)}) | {r.flagged_failing}/{r.failing} "
            f"({_percent(r.recall)}) | {r.within_2x}/{r.compared} "
            f"({_percent(r.crossing_within_2x)}) | {r.cannot_tell} ({r.extended}) |"
        )
    return "\n".join(lines)


def verdicts_table(verdicts: list[Verdict]) -> str:
    lines = [
        "| task | kind | policy | steps | verdict | predicted | real failure | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        reason = (v.reason or "").replace("|", "/")[:140]
        lines.append(
            f"| {v.task} | {v.kind} | {v.policy} | {v.steps} | {v.outcome}"
            f"{' (extended)' if v.extended_steps else ''} | {v.predicted_step or '-'} | "
            f"{v.failure_step if v.failure_step is not None else '-'} | {reason} |"
        )
    return "\n".join(lines)
