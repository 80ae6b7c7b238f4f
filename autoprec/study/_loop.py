"""The trial loop of a search: ask a trial, claim it, train it, tell and log it, until
the study holds its budget of measured trials; in the search's own process or in each
worker process.

A trial this process holds is not left running: one cut off by Ctrl-C or an error is
failed in Optuna (not counted), its MLflow run closed as KILLED, and an anchor it
carried queued again. A trial whose process dies, or that another worker failed first
(its heartbeat went stale), is failed by heartbeat (see `autoprec.study._studies`).
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState

from autoprec.devices import Backend
from autoprec.policy import Policy
from autoprec.profile.guided import GuidedStrategy, Observation
from autoprec.space import SearchSpace, policy_label
from autoprec.study._events import Callbacks, Progress
from autoprec.study._records import Feasibility, TrialRecord, record_of
from autoprec.study._studies import (
    CLAIM_ATTR,
    RECORD_ATTR,
    STEPPED_BACK_ATTR,
    Ledger,
    claim,
    fail_stale,
    finished,
    heartbeat,
)
from autoprec.tasks import Task
from autoprec.tracking import Tracker, TrialLog
from autoprec.trials.base import Result, Trials, TrialState, measured, run_with_time_limit

POLL_S = 1.0  # how often a waiting worker reads the study again
# Sampled policies identical to one already measured are not trained again; after this
# many in a row the space is taken as exhausted.
MAX_DUPLICATES_IN_A_ROW = 25
# How Optuna records a trial that ended in each state.
_STATES = {
    TrialState.COMPLETE: OptunaState.COMPLETE,
    TrialState.PRUNED: OptunaState.PRUNED,
    TrialState.FAILED: OptunaState.FAIL,
}


@dataclass(frozen=True, kw_only=True)
class TrialContext:
    """What every trial of a study shares: the task, the fitted space, the device, where
    results go, the fp32 baseline they are judged against and when they are feasible,
    and what a trial is (the mode's `autoprec.trials.base.Trials`)."""

    task: Task
    space: SearchSpace
    backend: Backend
    tracker: Tracker
    baseline: TrialRecord
    feasibility: Feasibility
    trials: Trials
    model: Any  # the task's model, for resolving policies (never trained)
    prefer: str = "speed"
    trial_timeout_s: float = 0.0  # 0: no limit
    guide: GuidedStrategy | None = None  # proposes trials before the sampler does
    _records: dict[int, TrialRecord] = field(default_factory=dict, repr=False)

    def identity(self, policy: Policy) -> str:
        """What a trial of the policy measures on this model and device."""
        return policy.identity(self.model, self.backend, mode=self.space.mode)

    def progress(self, study: optuna.Study, total: int) -> Progress:
        """Where the study stands now (each trial's record read once)."""
        records = []
        for t in finished(study):
            if t.number not in self._records:
                self._records[t.number] = record_of(t, self.feasibility, self.trials.result_type)
            records.append(self._records[t.number])
        return Progress(len(records), total, records, self.baseline, self.prefer)


def run_trials(study: optuna.Study, ctx: TrialContext, trials: int, callbacks: Callbacks) -> int:
    """Ask, claim, train, tell and log until the study holds ``trials`` measured trials
    (whoever measured them); the number measured here."""
    callbacks.trials_start(ctx.progress(study, trials))
    keys: dict[int, str] = {}

    def measured(t: FrozenTrial) -> str:
        if t.number not in keys:
            keys[t.number] = t.user_attrs.get(CLAIM_ATTR) or ctx.identity(
                Policy.from_dict(t.user_attrs[RECORD_ATTR]["policy"])
            )
        return keys[t.number]

    baseline_key = ctx.identity(ctx.baseline.policy)
    measured_here = 0
    duplicates_in_a_row = 0
    while True:
        fail_stale(study)
        ledger = Ledger.read(study)
        if len(ledger.recorded) >= trials:
            return measured_here
        if len(ledger.recorded) + len(ledger.running) >= trials:
            time.sleep(POLL_S)  # the last trials run elsewhere: wait, in case one dies
            continue
        if ctx.guide is not None:
            _guide(study, ctx, ledger)
        trial = None
        try:
            with interrupts_held():  # a trial asked for is never lost to a Ctrl-C
                trial = study.ask()
            with heartbeat(study, trial):
                policy = ctx.space.suggest(trial)
                key = ctx.identity(policy)
                verdict = claim(study, trial, key, trials, measured, baseline_key)
                if verdict.step_back:  # the last slots, or this policy, are taken
                    _step_back(study, trial, verdict.step_back)
                    continue
                if verdict.duplicate_of is not None:
                    trial.set_user_attr("duplicate_of", verdict.duplicate_of)
                    study.tell(trial, state=OptunaState.PRUNED)
                    duplicates_in_a_row += 1
                    if duplicates_in_a_row >= MAX_DUPLICATES_IN_A_ROW:
                        callbacks.exhausted(len(ledger.recorded))
                        return measured_here
                    continue
                duplicates_in_a_row = 0
                record = _measure(study, trial, policy, ctx, callbacks)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Failed by another worker while this one held it (no heartbeat for the
            # grace, e.g. a long wait for the sqlite lock): that worker closed its run
            # and queued its anchor again. Ask again.
            continue
        except BaseException as error:  # Ctrl-C, or a bug: the trial is not left running
            if trial is not None:
                _abandon(study, trial, error, ctx.tracker)
            raise
        measured_here += 1
        callbacks.trial_end(record, ctx.progress(study, trials))


def _guide(study: optuna.Study, ctx: TrialContext, ledger: Ledger) -> None:
    """Queue the guided strategy's next proposal once the queue is empty (anchors and
    earlier proposals first, so that each proposal knows what came before it)."""
    assert ctx.guide is not None
    if any(t.state == OptunaState.WAITING for t in ledger.trials.values()):
        return
    history = [Observation(ctx.space.uniform_params("fp32"), TrialState.COMPLETE, True)]
    for t in ledger.recorded.values():
        record = record_of(t, ctx.feasibility, ctx.trials.result_type)
        history.append(
            Observation(t.params, record.result.state, record.feasible, _objectives(record))
        )
    pending = [
        t.params or t.system_attrs.get("fixed_params", {})
        for t in ledger.trials.values()
        if t.state in (OptunaState.WAITING, OptunaState.RUNNING)
    ]
    proposal = ctx.guide.propose(history, pending)
    if proposal is not None:
        params, phase = proposal
        study.enqueue_trial(params, user_attrs={"guided": phase})


def _measure(
    study: optuna.Study,
    trial: optuna.Trial,
    policy: Policy,
    ctx: TrialContext,
    callbacks: Callbacks,
) -> TrialRecord:
    """Train one claimed trial; its MLflow child run is open while it runs."""
    anchor = trial.user_attrs.get("anchor")
    callbacks.trial_start(trial.number, policy)
    ctx.tracker.start_trial(
        str(trial.number),
        _run_name(trial.number, anchor, ctx.space, policy),
        _trial_tags(trial.number, anchor),
    )
    result = run_with_time_limit(
        lambda: ctx.trials.measure(policy), ctx.trial_timeout_s, ctx.trials.failed
    )
    return _tell_and_log(study, trial, policy, result, ctx)


def _objectives(record: TrialRecord) -> dict[str, float]:
    """What the guided strategy weighs, named as the training search names it (a serving
    trial's time is its latency)."""
    result = record.result
    values = {
        "accuracy": result.accuracy,
        "peak_memory_mb": result.peak_memory_mb,
        "step_time_ms": result.time_ms,
    }
    return {k: float(v) for k, v in values.items() if v is not None}


def _run_name(number: int, anchor: str | None, space: SearchSpace, policy: Policy) -> str:
    """``t007 fc1=bf16 fc2=fp32 ...`` or ``t000 uniform-fp16``."""
    return f"t{number:03d} " + (anchor or policy_label(space.flat_params(policy)))


def _trial_tags(number: int, anchor: str | None) -> dict[str, str]:
    tags = {"autoprec.role": "trial", "trial_number": str(number)}
    if anchor:
        tags["anchor"] = anchor
    return tags


def trial_log(
    key: str, name: str, space: SearchSpace, record: TrialRecord, tags: dict[str, str]
) -> TrialLog:
    """What a trial's MLflow child run holds, from what the study recorded of it."""
    result = record.result
    tags = {
        **tags,
        **result.run_tags(),
        "state": str(result.state),
        "feasible": str(record.feasible).lower(),
    }
    if result.reason:
        tags["reason"] = result.reason[:4000]
    if result.retries:  # why it was run again (a launch that lost a rank)
        tags["retries"] = "; ".join(result.retries)[:4000]
    drop = record.accuracy_drop
    extra = {} if drop is None else {"accuracy_drop": drop}
    return TrialLog(key, name, space.flat_params(record.policy), result, extra, tags, record.policy)


def logged_trial(
    trial: FrozenTrial, space: SearchSpace, feasibility: Feasibility, result_type: type[Result]
) -> TrialLog:
    """The child run of a recorded trial, as the trial loop logged it (to write it again
    when the tracking store could not take it then)."""
    record = record_of(trial, feasibility, result_type)
    anchor = trial.user_attrs.get("anchor")
    name = _run_name(trial.number, anchor, space, record.policy)
    return trial_log(str(trial.number), name, space, record, _trial_tags(trial.number, anchor))


def _tell_and_log(
    study: optuna.Study,
    trial: optuna.Trial,
    policy: Policy,
    result: Result,
    ctx: TrialContext,
) -> TrialRecord:
    drop = None
    if result.state == TrialState.COMPLETE and result.accuracy is not None:
        drop = measured(ctx.baseline.result.accuracy, "accuracy") - result.accuracy
        trial.set_constraint("accuracy_drop", drop - ctx.feasibility.tolerance)
    feasible = ctx.feasibility.judge(result, drop)
    record = TrialRecord(trial.number, policy, result, drop, feasible)
    # One storage write for everything autoprec keeps about the trial.
    trial.set_user_attr(
        RECORD_ATTR,
        {
            "policy": policy.to_dict(),
            "result": result.to_dict(),
            "accuracy_drop": drop,
            "feasible": feasible,
        },
    )
    if result.state == TrialState.COMPLETE:
        objectives = (result.accuracy, result.peak_memory_mb, result.time_ms)
        study.tell(trial, [measured(value, "objective") for value in objectives])
    else:
        study.tell(trial, state=_STATES[result.state])
    anchor = trial.user_attrs.get("anchor")
    name = _run_name(trial.number, anchor, ctx.space, policy)
    ctx.tracker.log_trial(
        trial_log(str(trial.number), name, ctx.space, record, _trial_tags(trial.number, anchor))
    )
    return record


def _step_back(study: optuna.Study, trial: optuna.Trial, why: str) -> None:
    """Give up a trial without training it: the budget's last slots are claimed, or
    another worker is measuring the same policy."""
    try:
        trial.set_user_attr(STEPPED_BACK_ATTR, why)
        study.tell(trial, state=OptunaState.FAIL)
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
        return
    requeue_anchor(study, trial)
    time.sleep(random.uniform(0, POLL_S))  # two that stepped back ask apart


def _abandon(
    study: optuna.Study, trial: optuna.Trial, error: BaseException, tracker: Tracker
) -> None:
    """A trial cut off by Ctrl-C or an error: failed in Optuna (not counted), marked
    interrupted, its MLflow run closed as KILLED, and an anchor queued again."""
    interrupted = isinstance(error, KeyboardInterrupt)
    try:
        if interrupted:
            trial.set_user_attr("interrupted", True)
        study.tell(trial, state=OptunaState.FAIL)
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
        return  # already told
    reason = "interrupted (Ctrl-C)" if interrupted else f"{type(error).__name__}: {error}"
    tracker.kill_trial(str(trial.number), reason)
    requeue_anchor(study, trial)


def requeue_anchor(study: optuna.Study, trial: optuna.Trial | FrozenTrial) -> None:
    """An anchor that was not measured is measured later (or when the study continues)."""
    anchor = trial.user_attrs.get("anchor")
    if anchor:
        study.enqueue_trial(trial.params, user_attrs={"anchor": anchor})


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """A Ctrl-C during the block takes effect when the block ends; a second one at once
    (in the main thread; elsewhere Ctrl-C does not arrive)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # None: a handler installed from C, which cannot be put back
        return
    caught: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if caught:  # asked twice: stop waiting
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        caught.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        signal.raise_signal(signal.SIGINT)  # to the handler in force: Python's raises
