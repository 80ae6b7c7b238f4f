"""The study behind ``autoprec.search``: an Optuna study over a space of policies, each
trial a real short training (or serving) run.

```python
result = autoprec.search("digits-mlp", config=autoprec.SearchConfig(trials=12))
result = autoprec.search("digits-mlp", trials=12, prefer="memory")  # the same, as keywords
```

The modules of this package, in the order a search uses them:
- `config`: `SearchConfig`, the settings, checked;
- `session`: the checked inputs, the stores and the study's one-off set-up (parent run,
  profile, baseline, anchors), shared with the workers;
- `loop`: ask, claim, train, tell and log until the budget is met;
- `workers`: worker processes on this host, pinned to devices;
- `studies`: what many workers share through Optuna's storage (heartbeats, claims,
  leases, the queue on sqlite);
- `summary`: the candidates, the chosen best, summary.json and best_policy.yaml;
- `confirm` and `confirmation`: the long confirmation (``--confirm-steps``) and its types;
- `summary_schema`: the typed `Summary` and its JSON round trip; `summary_file` reads
  it back, checked;
- `events`: `Callbacks`, what a search reports while it runs.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autoprec.errors import SearchInterrupted
from autoprec.guard.settings import Guard
from autoprec.policy import Policy
from autoprec.space import SearchSpace
from autoprec.study._events import Callbacks
from autoprec.study._loop import run_trials
from autoprec.study._session import Prepared, Session, identity_of, prepare
from autoprec.study._workers import run_workers
from autoprec.study.config import SearchConfig
from autoprec.study.confirm import confirm_choice
from autoprec.study.summary import completed, numeric, summarize, write_outputs
from autoprec.study.summary_schema import ProfileRow, Summary
from autoprec.tasks import DEFAULT_TASK, Task
from autoprec.tracking import FLUSH_WAIT_S, INTERRUPTED_FLUSH_S, Tracker
from autoprec.trials import mode_named
from autoprec.trials.schedule import schedule_warning

__all__ = ["Callbacks", "SearchConfig", "SearchInterrupted", "SearchResult", "search"]


@dataclass
class SearchResult:
    """The chosen policy and the summary: ``summary`` as summary.json holds it, ``typed``
    the same as a `Summary`."""

    study: str
    best_policy: Policy
    summary: dict[str, Any]
    best_policy_path: Path
    summary_path: Path
    typed: Summary | None = None


def search(
    task: Task | str = DEFAULT_TASK,
    space: SearchSpace | str | Path | None = None,
    config: SearchConfig | None = None,
    callbacks: Callbacks | None = None,
    **settings: Any,
) -> SearchResult:
    """Search precision policies for a task and return the best one.

    ``config`` holds the settings (see `SearchConfig`); any of its fields may also be
    given as a keyword. Workers need ``task`` and ``space`` by name or path. Ctrl-C
    writes what was measured and raises `SearchInterrupted`.
    """
    started_s = time.perf_counter()
    prepared = prepare(task, space, SearchConfig.of(config, settings))
    session = Session.open(prepared, callbacks)
    warning = schedule_warning(prepared.task, prepared.model, prepared.config)
    if warning is not None:  # the trials see only the start of the task's warm-up
        session.callbacks.warning(warning)
    for note in prepared.space.notes:  # what the space left out (a library not installed)
        session.callbacks.warning(note)
    phases_s = {"setup": time.perf_counter() - started_s}
    session.set_up(_parent_params(prepared))
    set_up_s = time.perf_counter() - started_s - phases_s["setup"]
    # The baseline's phase: its run, the parent run and the anchors; the rest of the
    # set-up is the profile, the warm-up and the wait for MLflow, each its own phase.
    phases_s["baseline"] = set_up_s - sum(session.phases_s.values())
    confirmed, interrupted = _trials_and_confirmation(session, phases_s)
    return _finish(session, confirmed, interrupted, phases_s, started_s)


def _parent_params(prepared: Prepared) -> dict[str, Any]:
    config = prepared.config
    return {
        **prepared.settings,
        "trials": config.trials,
        "accuracy_tolerance": prepared.tolerance,
        "prefer": config.prefer or prepared.prefer,
        "sampler": config.sampler,
        "storage": config.public()["storage"],
    }


def _trials_and_confirmation(
    session: Session, phases_s: dict[str, float]
) -> tuple[dict[str, float], bool]:
    """The trials (here or in workers), then the side-by-side re-timing; a Ctrl-C keeps
    what was measured. The parent run is closed as KILLED if anything else stops it."""
    config = session.prepared.config
    finished_cleanly = False
    interrupted = False
    confirmed: dict[str, float] = {}
    mark_s, warm_s = time.perf_counter(), session.phases_s.get("warm_up", 0.0)
    try:
        try:
            if session.prepared.workers == 1:
                if len(session.measured()) < config.trials:
                    session.warm_up()
                run_trials(session.study, session.context(), config.trials, session.callbacks)
            else:
                run_workers(session, session.prepared.workers)
        except KeyboardInterrupt:  # Ctrl-C: keep what was measured, write it out, then stop
            interrupted = True
        phases_s["trials"] = _less_warm_up(session, mark_s, warm_s)
        mark_s, warm_s = time.perf_counter(), session.phases_s.get("warm_up", 0.0)
        if not interrupted:
            try:
                confirmed = session.confirm(config.confirm_top)
            except KeyboardInterrupt:  # the trials' own times stand
                interrupted = True
        phases_s["confirm"] = _less_warm_up(session, mark_s, warm_s)
        finished_cleanly = True
    finally:
        if not finished_cleanly:
            session.tracker.end_parent("KILLED")
            session.tracker.close()
    return confirmed, interrupted


def _less_warm_up(session: Session, mark_s: float, warm_s: float) -> float:
    """Seconds since ``mark_s``, less the warm-up run since (its own phase)."""
    warmed_s = session.phases_s.get("warm_up", 0.0) - warm_s
    return time.perf_counter() - mark_s - warmed_s


def _finish(
    session: Session,
    confirmed: dict[str, float],
    interrupted: bool,
    phases_s: dict[str, float],
    started_s: float,
) -> SearchResult:
    """The choice and the outputs: summary.json, best_policy.yaml, the parent run."""
    prepared, tracker = session.prepared, session.tracker
    trials = session.trials  # the mode: its part of the summary, and what it leaves behind
    assert session.baseline is not None
    mark_s = time.perf_counter()
    fields = trials.summary_part(prepared.feasibility)
    part = mode_named(trials.mode).summary_part_class()
    summary = summarize(
        session.study,
        session.space,
        session.baseline,
        prepared.feasibility,
        prepared.prefer,
        confirmed,
        _run_ids(tracker),
        None if fields is None or part is None else part(**fields),
    )
    if not interrupted:  # --confirm-steps: the choice trained as long (may change it)
        long_s = time.perf_counter()
        summary, interrupted = confirm_choice(_confirming(session, summary), summary, confirmed)
        phases_s["long_confirmation"] = time.perf_counter() - long_s
        mark_s += phases_s["long_confirmation"]  # its own phase, not the tracking's
    best_policy = _for_the_run(Policy.from_dict(summary.best.policy or {}), prepared)
    layers = trials.layer_table(best_policy, prepared.model)
    left = trials.leave_behind(best_policy, prepared.out_dir, prepared.task_spec, tracker)
    summary = completed(
        summary,
        settings=_settings(session),
        parent_run_id=tracker.parent_id,
        # Which Optuna study this is: a search with another --storage refuses these outputs.
        identity=identity_of(session.study, prepared.config.storage).to_dict(),
        interrupted=interrupted,
        profile=None
        if session.profile is None
        else [ProfileRow(m.rank, m.name, m.risk, m.reason) for m in session.profile.modules[:5]],
        layers=layers,
        left=left,
    )
    phases_s["tracking_flush"] = time.perf_counter() - mark_s
    summary.wall_time_s = time.perf_counter() - started_s
    # This invocation's phases, in seconds: set-up, profile, warm-up, the wait for MLflow
    # before the baseline, baseline, trials, re-timing, summary and MLflow's writes.
    summary.phase_time_s = {**phases_s, **session.phases_s}
    policy_path, summary_path = write_outputs(summary, best_policy, prepared.out_dir)
    best_key = summary.best.key
    tracker.finish_parent(
        best_key,
        numeric(summary.best.metrics),
        [policy_path, summary_path],
        status="KILLED" if interrupted else "FINISHED",
    )
    tracker.mark_children({e.key for e in summary.entries if e.pareto}, best_key)
    tracker.close(INTERRUPTED_FLUSH_S if interrupted else FLUSH_WAIT_S)
    data = summary.to_json()
    session.callbacks.done(data)
    result = SearchResult(prepared.study, best_policy, data, policy_path, summary_path, summary)
    if interrupted:
        raise SearchInterrupted(result)
    return result


def _for_the_run(policy: Policy, prepared: Prepared) -> Policy:
    """The chosen policy as best_policy.yaml holds it: under --guard with the guard's
    section (its defaults, promoting only to the dtypes the search's device runs), so that
    the user's ``policy.apply(model)`` runs guarded."""
    if not prepared.config.guard:
        return policy
    runs = tuple(d for d in Guard().promote if prepared.backend.supports(d))
    return replace(policy, guard=Guard(promote=runs))


def _confirming(session: Session, summary: Summary) -> Session:
    """The session the long confirmation runs in: as it is, or, when --train-steps is given
    without --confirm-steps and the chosen trial's forecast cannot tell, one that confirms
    the finalists at --train-steps (the forecast's honest path: the real length, trained).
    Under --guard the user's guarded run is that path: nothing is confirmed unasked."""
    config = session.prepared.config
    telemetry = summary.best.telemetry or {}
    unasked = not config.train_steps or config.guard or not telemetry.get("cannot_tell")
    if config.confirm_steps or unasked:
        return session
    long_config = copy.copy(config)  # the settings as given, but the confirmation's length
    object.__setattr__(long_config, "confirm_steps", config.train_steps)
    confirming = copy.copy(session)
    confirming.prepared = replace(session.prepared, config=long_config)
    return confirming


def _settings(session: Session) -> dict[str, Any]:
    """The settings summary.json records: the search's own, and what an export needs."""
    prepared, config = session.prepared, session.prepared.config
    settings = prepared.settings
    return {
        **settings,
        "task_spec": prepared.task_spec,  # for autoprec export
        **session.trials.summary_settings(),  # the checkpoint
        "trials": config.trials,
        "sampler": config.sampler,
        "prefer": config.prefer or prepared.prefer,
        "confirm_top": config.confirm_top,
        "confirm_steps": config.confirm_steps,
        # as the trials ran it (as-is for a task without a scheduler to compress)
        "trial_schedule": settings.get("trial_schedule", config.trial_schedule),
        "train_steps_asked": config.train_steps,  # None: the forecast's default horizon
        "forecast": config.forecast,
        "guard": config.guard,  # best_policy.yaml's guard: section; no trial extended
        "accuracy_tolerance": prepared.tolerance,
        "storage": config.public()["storage"],
        "tracking_uri": config.public()["tracking_uri"],
        "device_name": prepared.backend.name,
        "workers": prepared.workers,
        "devices": prepared.devices,
        "trial_timeout_s": session.trial_limit_s,
    }


def _run_ids(tracker: Tracker) -> dict[str, str]:
    """The child runs by key once the queued writes are done; none while the tracking
    store is unreachable (the summary then names no runs)."""
    if not tracker.flush(FLUSH_WAIT_S):
        return {}
    try:
        return tracker.run_ids()
    except Exception:  # gone since the flush: the next run of the study catches up
        return {}
