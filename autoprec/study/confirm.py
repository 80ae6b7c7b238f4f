"""The long confirmation of a search's choice (``--confirm-steps K``).

After the short trials, the chosen policy trains K steps beside fp32 trained as long, from
the same weights on the same batches. If it does not hold there (it stops on a non-finite
loss, has more non-finite losses than fp32, or its accuracy drop from fp32 at K steps is
past the tolerance), the next candidate in the choice's own ranking is confirmed, and so
on; fp32 itself always holds. The policy that held becomes the summary's best (so
best_policy.yaml, the parent run and ``autoprec best`` name it), and every long run is an
MLflow child run of its own kind, tagged ``autoprec.role = confirmation``.

Each long result is kept in the study (``CONFIRMATIONS_ATTR``), so that a continued study
confirms nothing twice and fp32 trained K steps is trained once; a K equal to the trials'
steps reuses the study's own baseline.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from autoprec.numerics.first_events import FirstEvent, FirstEvents
from autoprec.selection import select_best
from autoprec.space import policy_label
from autoprec.study._loop import trial_log
from autoprec.study._records import TrialRecord
from autoprec.study.confirmation import Confirmation, ConfirmationCheck
from autoprec.study.summary import candidates
from autoprec.study.summary_schema import Best, Summary
from autoprec.tracking import FLUSH_WAIT_S, INTERRUPTED_FLUSH_S, ROLE_TAG
from autoprec.trials.base import TrialState, measured, run_with_time_limit
from autoprec.trials.schedule import real_task
from autoprec.trials.training import Budget, EarlyStopping, TrialResult, run_trial

if TYPE_CHECKING:
    from autoprec.policy import Policy
    from autoprec.study._session import Session

CONFIRMATIONS_ATTR = "confirmations"  # study attribute: {str(K): {key: long result}}
CONFIRMATION_ROLE = "confirmation"  # the ROLE_TAG of a confirmation's child run
KIND_TAG = "autoprec.kind"  # a child run's kind of trial: "confirmation" for these runs
BASELINE = "baseline"


def confirmation_order(
    records: list[TrialRecord],
    baseline: TrialRecord,
    prefer: str,
    chosen: Any,
    retimed: dict[str, float] | None = None,
) -> list[TrialRecord]:
    """The candidates to confirm, in the choice's order: the chosen one, then the best
    feasible of those left by the same preference (`select_best`, on the re-timed step
    times where there are some), and so on until fp32, which ends the list."""
    by_key = {str(r.number): r for r in [baseline, *records]}
    order = [by_key[str(chosen)]]
    reference = candidates([baseline], retimed)[0]
    left = [c for c in candidates([baseline, *records], retimed) if c.feasible and c.key != chosen]
    while order[-1].number != BASELINE and left:
        best = select_best(left, prefer, reference)
        if best is None:
            break
        order.append(by_key[str(best.key)])
        left.remove(best)
    return order


def confirm_choice(
    session: Session, summary: Summary, retimed: dict[str, float]
) -> tuple[Summary, bool]:
    """The summary with its confirmation (and, where the choice did not hold, the policy
    that did as its best), and whether a Ctrl-C cut the confirmation short. Without
    ``confirm_steps`` the summary is returned as it is."""
    config = session.prepared.config
    if not config.confirm_steps:
        return summary, False
    assert session.baseline is not None
    order = confirmation_order(
        session.measured(), session.baseline, session.prepared.prefer, summary.best.number, retimed
    )
    confirmation = _Confirmer(session, summary, config.confirm_steps).run(order)
    return with_confirmation(summary, confirmation), confirmation.interrupted


def with_confirmation(summary: Summary, confirmation: Confirmation) -> Summary:
    """The summary holding the confirmation, its best the candidate that held (with its
    gains over fp32 as the summary measured them)."""
    summary = replace(summary, confirmation=confirmation)
    held = None if confirmation.held is None else summary.entry(confirmation.held)
    if held is None or held.key == summary.best.key:
        return summary
    base = summary.baseline
    speedup = measured(summary.time_ms(base), "time") / measured(summary.time_ms(held), "time")
    saving = 1.0 - measured(held.peak_memory_mb, "peak memory") / measured(
        base.peak_memory_mb, "peak memory"
    )
    return replace(summary, best=Best.of(held, speedup, saving))


def first_seen(result: TrialResult, fp32: TrialResult) -> FirstEvent | None:
    """What the telemetry saw first in a long run, not blaming low precision for a layer
    whose values went mostly zero in fp32's run as well."""
    also_in_fp32 = FirstEvents.from_list(fp32.first_events).flushed_layers()
    return FirstEvents.from_list(result.first_events).earliest(also_in_fp32)


class _Confirmer:
    """The long runs of one confirmation: fp32 first, then each candidate in turn."""

    def __init__(self, session: Session, summary: Summary, steps: int) -> None:
        prepared = session.prepared
        self.session, self.summary, self.steps = session, summary, steps
        self.task = real_task(prepared.task)  # the schedule as the real run has it
        self.budget = Budget(steps=steps, seed=prepared.budget.seed)
        limit_s = session.trial_limit_s
        self.limit_s = limit_s * steps / prepared.budget.steps if limit_s else 0.0
        self.stored: dict[str, Any] = dict(
            (session.study.user_attrs.get(CONFIRMATIONS_ATTR) or {}).get(str(steps)) or {}
        )

    def run(self, order: list[TrialRecord]) -> Confirmation:
        confirmation = Confirmation(self.steps, chosen_before=self.summary.best.number)
        try:
            fp32, confirmation.fp32_reused = self._fp32()
            confirmation.fp32_accuracy = fp32.accuracy
            if fp32.state != TrialState.COMPLETE or fp32.accuracy is None:
                confirmation.reason = (
                    f"fp32 itself did not train {self.steps} steps ({fp32.reason}); "
                    "the short trials' choice stands"
                )
                return confirmation
            stopping = None
            if self.session.prepared.config.early_stopping:
                # Judged at K steps, by accuracy: a loss that trails fp32's on the way
                # (bf16's often does, early) does not end a long run; a scaler stuck
                # at its floor and non-finite losses in a row still do.
                stopping = replace(EarlyStopping.from_baseline(fp32), reference_losses=())
            for record in order:
                check = self._check(record, fp32, stopping)
                confirmation.checks.append(check)
                self.session.callbacks.confirmation_end(check)
                if check.held:
                    confirmation.held = record.number
                    break
        except KeyboardInterrupt:  # the short trials' choice stands; what ran is kept
            confirmation.interrupted = True
            confirmation.reason = "interrupted (Ctrl-C); the short trials' choice stands"
            self.session.callbacks.warning(
                f"interrupted (Ctrl-C) during the confirmation at {self.steps} steps: the "
                "short trials' choice stands; writing what was measured"
            )
        self._add_run_ids(confirmation)
        return confirmation

    # -- the runs ---------------------------------------------------------------------------

    def _fp32(self) -> tuple[TrialResult, bool]:
        """fp32 trained K steps: kept from an earlier confirmation, the study's baseline
        when the trials trained as long (on the real run's schedule), or trained now."""
        session = self.session
        assert session.baseline is not None
        if BASELINE in self.stored:
            return TrialResult.from_dict(self.stored[BASELINE]), True
        if self.steps == session.prepared.budget.steps and self.task is session.prepared.task:
            # Confirmed only where trials train (--confirm-steps): a training result.
            return cast("TrialResult", session.baseline.result), True
        session.callbacks.confirmation_start("fp32", self.steps)
        result = self._train(BASELINE, session.baseline.policy, None)
        return result, False

    def _check(
        self, record: TrialRecord, fp32: TrialResult, stopping: EarlyStopping | None
    ) -> ConfirmationCheck:
        label = self._label(record)
        key = str(record.number)
        if key == BASELINE:  # the reference holds by definition: nothing to train
            return ConfirmationCheck(
                BASELINE, label, True, str(fp32.state), None, fp32.accuracy, 0.0, fp32.steps_run
            )
        reused = key in self.stored
        if reused:
            result = TrialResult.from_dict(self.stored[key])
        else:
            self.session.callbacks.confirmation_start(label, self.steps)
            result = self._train(key, record.policy, stopping, fp32)
        held, reason, drop = self._verdict(result, fp32)
        first = None if held else first_seen(result, fp32)
        return ConfirmationCheck(
            record.number,
            label,
            held,
            str(result.state),
            reason,
            result.accuracy,
            drop,
            result.steps_run,
            result.nonfinite_steps,
            result.overflow_steps,
            reused,
            mechanism=None if first is None else first.mechanism,
            layer=None if first is None else first.layer,
            first_step=None if first is None else first.step,
        )

    def _train(
        self,
        key: str,
        policy: Policy,
        stopping: EarlyStopping | None,
        fp32: TrialResult | None = None,
    ) -> TrialResult:
        """One long run, recorded in the study and as an MLflow child run of its own."""
        session, tracker = self.session, self.session.tracker
        run_key, name, tags = self._run_names(key)
        backend = session.prepared.backend
        tracker.start_trial(run_key, name, tags)
        try:
            result = run_with_time_limit(
                lambda: run_trial(self.task, policy, backend, self.budget, stopping),
                self.limit_s,
                lambda reason: TrialResult(TrialState.FAILED, reason),
            )
        except BaseException:
            tracker.kill_trial(run_key, "interrupted during the confirmation")
            raise
        self.stored[key] = result.to_dict()
        all_stored = dict(session.study.user_attrs.get(CONFIRMATIONS_ATTR) or {})
        all_stored[str(self.steps)] = self.stored
        session.study.set_user_attr(CONFIRMATIONS_ATTR, all_stored)
        if fp32 is None:  # the reference itself: it holds if it trained
            held, drop = result.state == TrialState.COMPLETE, 0.0
        else:
            held, _, drop = self._verdict(result, fp32)
        record = TrialRecord(key, policy, result, drop, held)
        tags = {**tags, "held": str(held).lower()}
        tracker.log_trial(trial_log(run_key, name, session.space, record, tags))
        return result

    def _verdict(self, result: TrialResult, fp32: TrialResult) -> tuple[bool, str | None, Any]:
        """Whether a long run holds against fp32's, and if not, what failed (with what
        the telemetry saw first, where the reason does not already say it)."""
        held, reason, drop = self._judge(result, fp32)
        if held or reason is None:
            return held, reason, drop
        first = first_seen(result, fp32)
        if first is not None and first.describe() not in reason:
            reason = f"{reason}; the telemetry saw first: {first.describe()}"
        return held, reason, drop

    def _judge(self, result: TrialResult, fp32: TrialResult) -> tuple[bool, str | None, Any]:
        if result.state != TrialState.COMPLETE or result.accuracy is None:
            return False, result.reason or f"the run ended {result.state}", None
        drop = measured(fp32.accuracy, "accuracy") - result.accuracy
        if result.nonfinite_steps > fp32.nonfinite_steps:
            return (
                False,
                f"non-finite loss on {result.nonfinite_steps} of {result.steps_run} steps "
                f"(fp32: {fp32.nonfinite_steps})",
                drop,
            )
        feasibility = self.session.prepared.feasibility
        if drop > feasibility.tolerance + 1e-12:
            return (
                False,
                f"accuracy drop {drop:.4f} from fp32 at {self.steps} steps is past the "
                f"tolerance {feasibility.tolerance:g}",
                drop,
            )
        if not feasibility.judge(result, drop):  # the result's own bounds (its forecast)
            return False, result.reason or f"outside the bounds at {self.steps} steps", drop
        return True, None, drop

    # -- names ------------------------------------------------------------------------------

    def _run_names(self, key: str) -> tuple[str, str, dict[str, str]]:
        """The child run's key, name and tags: ``confirm-2000-7``, ``c2000 t007 ...``."""
        entry = self.summary.entry(key)
        short = "fp32" if key == BASELINE else f"t{int(key):03d}"
        label = "" if entry is None or entry.is_baseline else f" {policy_label(entry.params)}"
        tags = {
            ROLE_TAG: CONFIRMATION_ROLE,
            KIND_TAG: CONFIRMATION_ROLE,
            "confirms": key,
            "confirm_steps": str(self.steps),
        }
        return f"confirm-{self.steps}-{key}", f"c{self.steps} {short}{label}", tags

    def _label(self, record: TrialRecord) -> str:
        entry = self.summary.entry(record.number)
        if entry is None or entry.is_baseline:
            return "fp32 baseline"
        return f"{entry.label} [{policy_label(entry.params)}]"

    def _add_run_ids(self, confirmation: Confirmation) -> None:
        """The MLflow child runs of the long runs, once written (none while the tracking
        store is unreachable)."""
        tracker = self.session.tracker
        if not tracker.flush(INTERRUPTED_FLUSH_S if confirmation.interrupted else FLUSH_WAIT_S):
            return
        try:
            run_ids = tracker.run_ids()
        except Exception:  # gone since the flush: the summary names no runs
            return
        confirmation.fp32_mlflow_run_id = run_ids.get(f"confirm-{self.steps}-{BASELINE}")
        for check in confirmation.checks:
            check.mlflow_run_id = run_ids.get(f"confirm-{self.steps}-{check.key}")
