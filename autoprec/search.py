"""The search: an Optuna study over a space of policies, each trial a real short training.

Order of work, so that bad input never touches a store:
1. load and check the task, the space, the device and every option;
2. open the Optuna study (created once; continued when it exists and fits) and the
   MLflow experiment;
3. set the study up once, under its set-up lease: the MLflow parent run, the fp32
   baseline (kept in the study, logged as a child run) and the anchors (uniform fp16
   and bf16); a process that finds another doing it waits;
4. ask, claim, train, tell and log until the study holds ``trials`` measured trials, in
   this process or in ``workers`` worker processes (several hosts may join the same
   study with the same command);
5. choose the best feasible policy (accuracy drop within tolerance) by the preference,
   and write ``runs/<study>/best_policy.yaml`` and ``summary.json``.

A trial whose process dies stops sending heartbeats: the next worker to look fails it
in Optuna, closes its MLflow child run as KILLED, and the budget counts only trials
that were measured to an end.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autoprec.devices import DTYPES, Backend, get_backend
from autoprec.errors import AutoprecError, StoreError, first_line
from autoprec.guided import GuidedStrategy
from autoprec.loop import (
    POLL_S,
    ProgressCallback,
    TrialContext,
    TrialRecord,
    WarmUp,
    finished,
    record_of,
    requeue_anchor,
    run_trials,
)
from autoprec.policy import Policy
from autoprec.profile import Profile, profile_task
from autoprec.selection import PREFERENCES, Candidate, pareto_front, select_best
from autoprec.space import DEFAULT_SPACE, SearchSpace, builtin_spaces, load_space
from autoprec.studies import (
    HEARTBEAT_INTERVAL_S,
    RECORD_ATTR,
    RUN_ATTR,
    Lease,
    Ledger,
    fail_stale,
    open_storage,
    worker_id,
)
from autoprec.tasks import DEFAULT_TASK, Task, check_task, check_task_data, load_task
from autoprec.tracking import (
    DEFAULT_TRACKING_URI,
    Tracker,
    absolute_sqlite_uri,
    check_tracking_uri,
)
from autoprec.trial import Budget, EarlyStopping, TrialResult, run_trial, time_side_by_side
from autoprec.workers import (
    WorkerSpec,
    local_device,
    parse_devices,
    start_workers,
    wait_for_workers,
)

DEFAULT_STORAGE = "sqlite:///runs/optuna.db"
DEFAULT_RUNS_DIR = Path("runs")
# guided: profile-ranked seeding and bisection (autoprec.guided), then TPE.
SAMPLERS = ("guided", "tpe", "nsga2", "random")
PROFILE_ATTR = "profile"  # study attribute: the ranking the groups and guidance use
OBJECTIVES = ("accuracy", "peak_memory_mb", "step_time_ms")
DIRECTIONS = ("maximize", "minimize", "minimize")
CONFIRMED_ATTR = "confirmed_step_time_ms"  # study attribute: side-by-side re-timings
# Default per-trial time limit: this many times the fp32 baseline's trial, at least
# TRIAL_TIMEOUT_MIN_S (fp16 can be 20x slower than fp32 where it has no native kernels).
TRIAL_TIMEOUT_FACTOR = 25
TRIAL_TIMEOUT_MIN_S = 300.0
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass
class SearchResult:
    study: str
    best_policy: Policy
    summary: dict[str, Any]
    best_policy_path: Path
    summary_path: Path


def default_space_for(task_name: str) -> str:
    """The shipped space named after the task if there is one, else the generic one."""
    return task_name if task_name in builtin_spaces() else DEFAULT_SPACE


def search(
    task: Task | str = DEFAULT_TASK,
    space: SearchSpace | str | Path | None = None,
    *,
    trials: int = 12,
    steps: int = 200,
    device: str | Backend = "auto",
    study: str | None = None,
    storage: str = DEFAULT_STORAGE,
    tracking_uri: str = DEFAULT_TRACKING_URI,
    seed: int = 0,
    accuracy_tolerance: float | None = None,
    prefer: str = "speed",
    sampler: str = "guided",
    runs_dir: str | Path = DEFAULT_RUNS_DIR,
    confirm_top: int = 3,
    early_stopping: bool = True,
    workers: int | None = None,
    devices: str | Sequence[str] | None = None,
    trial_timeout_s: float | None = None,
    heartbeat_s: int = HEARTBEAT_INTERVAL_S,
    progress: ProgressCallback | None = None,
) -> SearchResult:
    """Search precision policies for a task and return the best one.

    ``trials`` is the study's total, whoever runs them: continuing a study, or joining it
    from another host, runs only what is missing. ``workers`` processes share the work on
    this host (default: one per device listed, else 1), pinned round-robin to
    ``devices`` (``"npu:0-7"``, ``"cuda:0,cuda:1"``);
    workers need ``task`` and ``space`` by name or path. A trial running past
    ``trial_timeout_s`` (None: 25x the fp32 baseline's trial, at least 300 s; 0: no
    limit) fails with that reason. Unless ``prefer="memory"``, the ``confirm_top``
    fastest feasible policies are timed again side by side with the baseline before the
    choice (0 skips that). With ``early_stopping``, hopeless trials stop early.
    """
    started_s = time.perf_counter()
    notify = progress or (lambda event, data: None)

    # 1. Everything the user gave is checked before any store is opened.
    device_list = parse_devices(devices)
    if workers is None:  # one per listed device
        workers = max(1, len(device_list))
    if not isinstance(workers, int) or workers < 1:
        raise AutoprecError(f"--workers: expected a positive integer, got {workers!r}")
    if workers > 1 and not (isinstance(task, str) and isinstance(space, str | Path | None)):
        raise AutoprecError(
            "--workers: worker processes load the task and the space themselves; "
            "name them (built-in name, module:attr or file.py:attr; a space name or file)"
        )
    task_spec = task if isinstance(task, str) else None
    space_spec = str(space) if isinstance(space, str | Path) else None
    task = load_task(task) if isinstance(task, str) else task
    model = check_task(task)
    if not isinstance(space, SearchSpace):
        space_spec = space_spec or default_space_for(task.name)
        space = load_space(space_spec)
    if device_list:
        backend, *_ = [get_backend(d) for d in device_list]  # each must be there
        if device != "auto" and get_backend(device).kind != backend.kind:
            raise AutoprecError(f"--device {device!r} and --devices {devices!r} disagree")
    else:
        backend = get_backend(device)
        device_list = [str(backend.device)] if backend.kind != "cpu" else ["cpu"]
    supported = {d for d in DTYPES if backend.supports(d)}
    unfitted = space
    space = unfitted.fit(model, device=backend).restrict(supported)  # fitted to a profile later
    if not isinstance(confirm_top, int) or confirm_top < 0:
        raise AutoprecError(f"--confirm-top: expected an integer >= 0, got {confirm_top!r}")
    if not isinstance(trials, int) or trials < 1:
        raise AutoprecError(f"--trials: expected a positive integer, got {trials!r}")
    if trial_timeout_s is not None and not (
        isinstance(trial_timeout_s, int | float) and trial_timeout_s >= 0
    ):
        raise AutoprecError(
            f"--trial-timeout: expected seconds >= 0 (0: no limit), got {trial_timeout_s!r}"
        )
    if not isinstance(heartbeat_s, int) or heartbeat_s < 1:
        raise AutoprecError(f"--heartbeat: expected whole seconds >= 1, got {heartbeat_s!r}")
    budget = Budget(steps=steps, seed=seed)
    check_task_data(task, model, budget.steps, budget.seed)
    if prefer not in PREFERENCES:
        raise AutoprecError(f"--prefer: expected one of {', '.join(PREFERENCES)}, got {prefer!r}")
    if sampler not in SAMPLERS:
        raise AutoprecError(f"--sampler: expected one of {', '.join(SAMPLERS)}, got {sampler!r}")
    tolerance = space.accuracy_tolerance if accuracy_tolerance is None else accuracy_tolerance
    if not (isinstance(tolerance, int | float) and math.isfinite(tolerance) and tolerance >= 0):
        raise AutoprecError(f"--accuracy-tolerance: expected a number >= 0, got {tolerance!r}")
    study_name = study or task.name
    if not STUDY_NAME.match(study_name):
        raise AutoprecError(
            f"--study {study_name!r}: use letters, digits, '.', '-' and '_' (at most 100)"
        )
    _check_storage_url(storage)
    check_tracking_uri(tracking_uri)
    runs_dir = Path(runs_dir)
    settings = {
        "task": task.name,
        "space": space.name,
        "space_fingerprint": space.fingerprint(),
        "steps": budget.steps,
        "seed": budget.seed,
        "device": backend.kind,
    }

    # 2. Stores: both reachable before either is written to.
    tracker = Tracker(tracking_uri, study_name, runs_dir)
    storage_url = absolute_sqlite_uri(storage)
    try:
        optuna_storage = open_storage(storage_url, heartbeat_s, _on_stale(tracker))
    except Exception as error:  # unreachable server, missing driver, bad credentials
        raise StoreError(f"Optuna storage {storage}: {first_line(error)}") from None
    optuna_study = _open_study(
        study_name,
        optuna_storage,
        sampler,
        seed,
        settings,
        trials,
    )
    fail_stale(optuna_study)
    _close_cut_off_runs(optuna_study, tracker)
    phases_s = {"setup": time.perf_counter() - started_s}

    # 3. Set-up, once per study; then 4. the trials.
    # Until the baseline sets the default, an explicit limit or the minimum applies.
    warm = WarmUp(
        task,
        space,
        backend,
        budget,
        TRIAL_TIMEOUT_MIN_S if trial_timeout_s is None else float(trial_timeout_s),
    )
    parent_params = {
        **settings,
        "trials": trials,
        "accuracy_tolerance": tolerance,
        "prefer": prefer,
        "sampler": sampler,
        "storage": storage,
    }
    needs_profile = sampler == "guided" or unfitted.auto is not None
    parent_id, baseline, profile, space = _set_up(
        optuna_study,
        tracker,
        parent_params,
        task,
        _Fitting(unfitted, model, backend, needs_profile),
        backend,
        budget,
        warm,
        notify,
        runs_dir / study_name,
    )
    phases_s["baseline"] = time.perf_counter() - started_s - phases_s["setup"]
    limit_s = (
        max(TRIAL_TIMEOUT_MIN_S, TRIAL_TIMEOUT_FACTOR * baseline.result.run_time_s)
        if trial_timeout_s is None
        else float(trial_timeout_s)
    )
    status = "KILLED"
    interrupted = False
    try:
        stopper = EarlyStopping.from_baseline(baseline.result) if early_stopping else None
        context = TrialContext(
            task,
            space,
            backend,
            budget,
            tracker,
            parent_id,
            baseline,
            tolerance,
            stopper,
            model,
            limit_s,
            _guidance(sampler, space, model, profile, prefer),
        )
        try:
            if workers == 1:
                if len(Ledger.read(optuna_study).recorded) < trials:
                    warm.ensure()
                run_trials(optuna_study, context, trials, prefer, notify)
            else:
                spec = dict(
                    task=task_spec,
                    space=space_spec,
                    study=study_name,
                    storage=storage_url,
                    tracking_uri=absolute_sqlite_uri(tracking_uri),
                    runs_dir=str(runs_dir.resolve()),
                    trials=trials,
                    steps=budget.steps,
                    seed=budget.seed,
                    prefer=prefer,
                    sampler=sampler,
                    tolerance=float(tolerance),
                    early_stopping=early_stopping,
                    trial_timeout_s=limit_s,
                    heartbeat_s=heartbeat_s,
                )
                _run_workers(optuna_study, context, spec, workers, device_list, prefer, notify)
        except KeyboardInterrupt:  # Ctrl-C: keep what was measured, write it out, then stop
            interrupted = True
        mark_s = time.perf_counter()
        confirmed: dict[str, float] = {}
        if not interrupted:
            try:
                confirmed = _confirm_step_times(
                    optuna_study, context, prefer, confirm_top, notify, warm
                )
            except KeyboardInterrupt:  # the trials' own times stand
                interrupted = True
        phases_s["confirm"] = time.perf_counter() - mark_s
        status = "FINISHED"
    finally:
        if status != "FINISHED":
            tracker.end_parent(parent_id, status)

    # 5. Choice and outputs.
    summary = summarize(optuna_study, space, baseline, tolerance, prefer, confirmed)
    summary["settings"] = {
        **settings,
        "trials": trials,
        "sampler": sampler,
        "prefer": prefer,
        "accuracy_tolerance": tolerance,
        "storage": storage,
        "tracking_uri": tracking_uri,
        "device_name": backend.name,
        "workers": workers,
        "devices": device_list,
        "trial_timeout_s": limit_s,
    }
    summary["mlflow_parent_run_id"] = parent_id
    summary["interrupted"] = interrupted
    summary["profile"] = (
        None
        if profile is None
        else [
            {"rank": m.rank, "module": m.name, "risk": m.risk, "reason": m.reason}
            for m in profile.modules[:5]
        ]
    )
    best_policy = Policy.from_dict(summary["best"]["policy"])
    summary["best"]["layers"] = best_policy.layer_table(model, backend)
    out_dir = runs_dir / study_name
    out_dir.mkdir(parents=True, exist_ok=True)
    best_policy_path = best_policy.save(out_dir / "best_policy.yaml")
    summary["wall_time_s"] = time.perf_counter() - started_s
    summary["phase_time_s"] = phases_s  # this invocation's set-up, warm-up and re-timing
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n")
    best = summary["best"]
    entries = [summary["baseline"], *summary["trials"]]
    tracker.finish_parent(
        parent_id,
        best.get("mlflow_run_id"),
        _numeric(best["metrics"]),
        best_policy_path,
        summary_path,
        status="KILLED" if interrupted else "FINISHED",
    )
    tracker.mark_children(
        {e["mlflow_run_id"] for e in entries if e["pareto"] and e["mlflow_run_id"]},
        best.get("mlflow_run_id"),
        [e["mlflow_run_id"] for e in entries if e["mlflow_run_id"]],
    )
    notify("done", {"summary": summary})
    result = SearchResult(study_name, best_policy, summary, best_policy_path, summary_path)
    if interrupted:
        raise SearchInterrupted(result)
    return result


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during the trials: the running trial was recorded as interrupted (failed in
    Optuna, not counted), and the summary and best policy so far were written."""

    def __init__(self, result: SearchResult) -> None:
        super().__init__(f"search interrupted; results so far in {result.summary_path}")
        self.result = result


@dataclass(frozen=True)
class _Fitting:
    """How the space meets the model: fitted to the profile where one is used (its
    riskiest modules become groups of their own in a ``groups: auto`` space)."""

    unfitted: SearchSpace
    model: Any
    backend: Backend
    needs_profile: bool

    def space(self, profile: Profile | None) -> SearchSpace:
        supported = {d for d in DTYPES if self.backend.supports(d)}
        return self.unfitted.fit(self.model, profile, self.backend).restrict(supported)


def _guidance(
    sampler: str, space: SearchSpace, model: Any, profile: Profile | None, prefer: str
) -> GuidedStrategy | None:
    if sampler != "guided" or profile is None:
        return None
    order = [name for name, _ in space.group_risk(profile, model)]
    return GuidedStrategy(space, order, prefer)


def _check_storage_url(url: str) -> None:
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:
        raise StoreError(
            f"--storage {url!r}: not a database URL (e.g. sqlite:///runs/optuna.db)"
        ) from None
    if parsed.get_backend_name() not in ("sqlite", "postgresql", "mysql"):
        raise StoreError(f"--storage {url!r}: expected a sqlite, postgresql or mysql URL")
    if parsed.get_backend_name() == "sqlite" and parsed.database:
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


def _make_sampler(
    name: str, seed: int, trials: int, worker: int = 0
) -> optuna.samplers.BaseSampler:
    """The study's sampler; each worker seeds its own (seed + worker index)."""
    seed += worker
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(
            seed=seed, population_size=max(4, min(20, trials // 2))
        )
    # TPE, also after guidance. constant_liar: a running trial counts as a poor result,
    # so that workers asking at the same time are steered apart.
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=max(4, trials // 3), multivariate=True, constant_liar=True
    )


def _open_study(
    name: str,
    storage: optuna.storages.BaseStorage,
    sampler: str,
    seed: int,
    settings: dict[str, Any],
    trials: int,
    worker: int = 0,
) -> optuna.Study:
    """Create the study, or load it when it exists and was run with the same settings."""
    where = getattr(storage, "url", "the Optuna storage")
    try:
        existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage)}.get(name)
        if existing is not None:
            old = {k: existing.user_attrs.get(k) for k in settings}
            changed = [k for k in settings if old[k] is not None and old[k] != settings[k]]
            if changed:
                key = changed[0]
                raise StoreError(
                    f"study {name!r} in {where} was run with {key}={old[key]!r}, not "
                    f"{settings[key]!r}; use another --study or the same settings"
                )
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            sampler=_make_sampler(sampler, seed, trials, worker),
            directions=list(DIRECTIONS),
            load_if_exists=True,
        )
    except StoreError:
        raise
    except Exception as error:
        raise StoreError(f"Optuna storage {where}: {first_line(error)}") from None
    if existing is None:
        for key, value in settings.items():
            study.set_user_attr(key, value)
    return study


def _on_stale(tracker: Tracker) -> Callable[[optuna.Study, FrozenTrial], None]:
    """What happens to a trial whose worker died: its MLflow child run is closed as
    KILLED, and an anchor is queued again (Optuna has already failed the trial)."""

    def on_stale(study: optuna.Study, trial: FrozenTrial) -> None:
        if RECORD_ATTR in trial.user_attrs:  # measured and logged before the worker died
            return
        run_id = trial.user_attrs.get(RUN_ATTR)
        if run_id:
            tracker.close_killed(run_id, "its worker stopped sending heartbeats (killed?)")
        requeue_anchor(study, trial)

    return on_stale


def _close_cut_off_runs(study: optuna.Study, tracker: Tracker) -> None:
    """Failed trials whose MLflow run is still open (their worker died while the
    tracking store was unreachable): closed as KILLED now."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        run_id = t.user_attrs.get(RUN_ATTR)
        if run_id and RECORD_ATTR not in t.user_attrs:
            tracker.close_if_open(run_id, "its trial was failed before its run was closed")


def _set_up(
    study: optuna.Study,
    tracker: Tracker,
    parent_params: dict[str, Any],
    task: Task,
    fitting: _Fitting,
    backend: Backend,
    budget: Budget,
    warm: WarmUp,
    notify: ProgressCallback,
    out_dir: Path,
) -> tuple[str, TrialRecord, Profile | None, SearchSpace]:
    """The study's parent run, profile, baseline and anchors, made once: by whoever
    holds the set-up lease; a process that finds it held waits for the holder. Also
    returns the space fitted to the model and the profile, for the trials."""
    lease = Lease(study, "setup", worker_id())
    waiting = False
    while True:
        attrs = study.user_attrs
        parent_id = attrs.get("mlflow_parent_run_id")
        ready = attrs.get("baseline") is not None and attrs.get("anchors_enqueued")
        if fitting.needs_profile:
            ready = ready and attrs.get(PROFILE_ATTR) is not None
        if ready and parent_id and tracker.has_run(parent_id):
            tracker.start_parent(parent_id, parent_params)  # reopened: RUNNING again
            profile = _stored_profile(study)
            space = fitting.space(profile)
            baseline = _baseline(study, task, space, backend, budget, tracker, parent_id)
            return parent_id, baseline, profile, space
        if lease.acquire():
            break
        if not waiting:
            notify("waiting", {"holder": lease.holder()})
            waiting = True
        time.sleep(2 * POLL_S)
    parent_id = None
    try:
        parent_id = tracker.start_parent(
            study.user_attrs.get("mlflow_parent_run_id"), parent_params
        )
        study.set_user_attr("mlflow_parent_run_id", parent_id)
        profile = _stored_profile(study)
        if fitting.needs_profile and profile is None:
            notify("profile", {})
            profile = profile_task(task, backend, seed=budget.seed)
            path = profile.save(out_dir / "profile.json")
            tracker.log_profile(profile, path, parent_id)
            study.set_user_attr(PROFILE_ATTR, profile.brief())
            notify("profiled", {"profile": profile, "path": path})
        space = fitting.space(profile)
        if study.user_attrs.get("baseline") is None:
            notify("baseline", {})
            warm.ensure()
        baseline = _baseline(study, task, space, backend, budget, tracker, parent_id)
        if not study.user_attrs.get("anchors_enqueued"):
            for name, params in space.anchors().items():
                study.enqueue_trial(params, user_attrs={"anchor": name})
            study.set_user_attr("anchors_enqueued", True)
    except BaseException:  # Ctrl-C or an error during set-up: the parent run is closed
        if parent_id is not None:
            tracker.end_parent(parent_id, "KILLED")
        raise
    finally:
        lease.release()
    return parent_id, baseline, profile, space


def _stored_profile(study: optuna.Study) -> Profile | None:
    data = study.user_attrs.get(PROFILE_ATTR)
    return None if data is None else Profile.from_dict(data)


def _baseline(
    study: optuna.Study,
    task: Task,
    space: SearchSpace,
    backend: Backend,
    budget: Budget,
    tracker: Tracker,
    parent_id: str,
) -> TrialRecord:
    """The stored fp32 baseline, or (under the set-up lease) a new one."""
    policy = space.policy(space.uniform_params("fp32"))
    stored = study.user_attrs.get("baseline")
    if stored is not None:
        return TrialRecord(
            "baseline",
            policy,
            TrialResult.from_dict(stored["result"]),
            0.0,
            True,
            stored.get("mlflow_run_id"),
        )
    cut_off = study.user_attrs.get("baseline_run_started")
    if cut_off:  # a baseline whose process died: its run is closed, and it runs again
        tracker.close_killed(cut_off, "the search stopped before the baseline finished")
    tags = {"autoprec.role": "baseline"}
    run_id = tracker.start_child(parent_id, "baseline-fp32", tags)
    study.set_user_attr("baseline_run_started", run_id)
    try:
        result = run_trial(task, policy, backend, budget)
    except BaseException:
        tracker.close_killed(run_id, "interrupted during the baseline")
        raise
    if result.state != "complete":
        tracker.log_trial(run_id, space.flat_params(policy), result, {}, tags, policy)
        raise AutoprecError(
            f"task {task.name!r}: the fp32 baseline did not train ({result.reason}); "
            "fix the task before searching"
        )
    tracker.log_trial(
        run_id,
        space.flat_params(policy),
        result,
        {"accuracy_drop": 0.0},
        {**tags, "state": "complete", "feasible": "true"},
        policy,
    )
    study.set_user_attr("baseline", {"result": result.to_dict(), "mlflow_run_id": run_id})
    return TrialRecord("baseline", policy, result, 0.0, True, run_id)


def _run_workers(
    study: optuna.Study,
    ctx: TrialContext,
    spec: dict[str, Any],
    workers: int,
    devices: list[str],
    prefer: str,
    notify: ProgressCallback,
) -> None:
    """Start ``workers`` processes on this host, pinned round-robin to ``devices``, and
    follow the study until they are done."""
    pinned = [devices[i % len(devices)] for i in range(workers)]
    cores = os.cpu_count() or 1
    threads = max(1, cores // workers)  # on the CPU, the workers share its cores
    specs = [
        WorkerSpec(index=i, device=local_device(d), threads=threads, **spec)
        for i, d in enumerate(pinned)
    ]
    notify(
        "workers",
        {
            "workers": workers,
            "devices": pinned,
            "cores": cores,
            "threads": threads,
            "kind": ctx.backend.kind,
        },
    )
    records = [record_of(t, ctx.tolerance) for t in finished(study)]
    seen = {r.number for r in records}
    notify(
        "start",
        {
            "total": spec["trials"],
            "done": len(records),
            "records": records,
            "baseline": ctx.baseline,
        },
    )

    def poll() -> None:
        records = [record_of(t, ctx.tolerance) for t in finished(study)]
        for record in records:
            if record.number not in seen:
                seen.add(record.number)
                notify(
                    "trial_end",
                    {
                        "record": record,
                        "done": len(seen),
                        "total": spec["trials"],
                        "records": records,
                        "baseline": ctx.baseline,
                        "prefer": prefer,
                    },
                )

    log_dir = Path(spec["runs_dir"]) / spec["study"] / "workers"
    processes = start_workers(specs, pinned, log_dir)
    codes = wait_for_workers(processes, poll)
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed and len(finished(study)) < spec["trials"]:
        raise AutoprecError(
            f"worker {failed[0]} stopped with status {codes[failed[0]]} before the budget "
            f"was met; see {log_dir / f'worker-{failed[0]}.log'}"
        )


def run_worker(spec: WorkerSpec) -> int:
    """A worker process: join the study, run trials until its budget is met; the number
    of trials measured here."""
    task = load_task(spec.task)
    model = check_task(task)
    backend = get_backend(spec.device)
    unfitted = load_space(spec.space or default_space_for(task.name))
    supported = {d for d in DTYPES if backend.supports(d)}
    budget = Budget(steps=spec.steps, seed=spec.seed)
    tracker = Tracker(spec.tracking_uri, spec.study, Path(spec.runs_dir))
    study = optuna.load_study(
        study_name=spec.study,
        storage=open_storage(spec.storage, spec.heartbeat_s, _on_stale(tracker)),
        sampler=_make_sampler(spec.sampler, spec.seed, spec.trials, spec.index + 1),
    )
    fingerprint = unfitted.fit(model, device=backend).restrict(supported).fingerprint()
    if study.user_attrs.get("space_fingerprint") != fingerprint:
        raise AutoprecError(f"study {spec.study!r}: this worker's space differs from the study's")
    profile = _stored_profile(study)
    space = _Fitting(unfitted, model, backend, profile is not None).space(profile)
    parent_id = study.user_attrs["mlflow_parent_run_id"]
    baseline = _baseline(study, task, space, backend, budget, tracker, parent_id)
    stopper = EarlyStopping.from_baseline(baseline.result) if spec.early_stopping else None
    ctx = TrialContext(
        task,
        space,
        backend,
        budget,
        tracker,
        parent_id,
        baseline,
        spec.tolerance,
        stopper,
        model,
        spec.trial_timeout_s,
        _guidance(spec.sampler, space, model, profile, spec.prefer),
    )
    if len(finished(study)) < spec.trials:
        WarmUp(task, space, backend, budget, spec.trial_timeout_s).ensure()

    def log(event: str, data: dict[str, Any]) -> None:
        if event == "trial_end":
            r = data["record"]
            print(f"trial {r.number}: {r.result.state} {r.result.reason or ''}", flush=True)

    return run_trials(study, ctx, spec.trials, spec.prefer, log)


def candidates(
    records: list[TrialRecord], confirmed: dict[str, float] | None = None
) -> list[Candidate]:
    """Completed records as candidates. A confirmed step time replaces the trial's own;
    the others are scaled by the baseline's confirmed-to-own ratio, so that all compare."""
    confirmed = confirmed or {}
    scale = 1.0
    baseline = next((r for r in records if r.number == "baseline"), None)
    if baseline is not None and "baseline" in confirmed:
        scale = confirmed["baseline"] / baseline.result.step_time_ms
    return [
        Candidate(
            r.number,
            r.result.accuracy,
            r.result.peak_memory_mb,
            confirmed.get(str(r.number), r.result.step_time_ms * scale),
            r.feasible,
        )
        for r in records
        if r.result.state == "complete" and r.result.accuracy is not None
    ]


def best_record(
    records: list[TrialRecord],
    baseline: TrialRecord,
    prefer: str,
    confirmed: dict[str, float] | None = None,
) -> TrialRecord:
    """The best feasible record (the fp32 baseline is always a feasible candidate). Once
    the fastest were re-timed side by side, the choice is among those."""
    pool = [baseline, *records]
    if confirmed:
        pool = [r for r in pool if str(r.number) in confirmed]
    chosen = select_best(
        candidates(pool, confirmed), prefer, reference=candidates([baseline], confirmed)[0]
    )
    return next(r for r in pool if chosen is not None and r.number == chosen.key)


def _confirm_step_times(
    study: optuna.Study,
    ctx: TrialContext,
    prefer: str,
    top: int,
    notify: ProgressCallback,
    warm: WarmUp | None = None,
) -> dict[str, float]:
    """Re-time the ``top`` best feasible policies (by step time, or by the balanced score)
    and the baseline side by side.

    Kept in the study, and measured again only when the set of candidates changes.
    """
    if prefer == "memory" or top <= 0:
        return {}
    records = [record_of(t, ctx.tolerance) for t in finished(study)]
    base = candidates([ctx.baseline])[0]

    def rank(c: Candidate) -> float:  # the preference decides which few are re-timed
        if prefer == "balanced":
            return c.step_time_ms / base.step_time_ms + c.peak_memory_mb / base.peak_memory_mb
        return c.step_time_ms

    fastest = sorted((c for c in candidates(records) if c.feasible), key=rank)[:top]
    if not fastest:
        return {}
    keys = ["baseline", *(str(c.key) for c in fastest)]
    stored = study.user_attrs.get(CONFIRMED_ATTR) or {}
    if sorted(stored) == sorted(keys):
        return stored
    by_number = {str(r.number): r for r in records}
    policies = [ctx.baseline.policy, *(by_number[k].policy for k in keys[1:])]
    notify("confirm", {"count": len(keys)})
    if warm is not None:
        warm.ensure()
    times_ms = time_side_by_side(ctx.task, policies, ctx.backend, ctx.budget)
    confirmed = dict(zip(keys, times_ms, strict=True))
    study.set_user_attr(CONFIRMED_ATTR, confirmed)
    return confirmed


def summarize(
    study: optuna.Study,
    space: SearchSpace,
    baseline: TrialRecord,
    tolerance: float,
    prefer: str,
    confirmed: dict[str, float] | None = None,
) -> dict[str, Any]:
    """summary.json: the baseline, every trial, the Pareto front, and the chosen best.

    Where step times were confirmed side by side, the front and the choice use them.
    """
    confirmed = confirmed or {}
    trials = {t.number: t for t in finished(study)}
    records = [record_of(t, tolerance) for t in trials.values()]
    front_keys = {c.key for c in pareto_front(candidates([baseline, *records], confirmed))}
    best = best_record(records, baseline, prefer, confirmed)

    def step_time_ms(r: TrialRecord) -> float:
        return confirmed.get(str(r.number), r.result.step_time_ms)

    def entry(r: TrialRecord) -> dict[str, Any]:
        return {
            "number": r.number,
            "state": r.result.state,
            "reason": r.result.reason,
            "anchor": trials[r.number].user_attrs.get("anchor") if r.number in trials else None,
            "guided": trials[r.number].user_attrs.get("guided") if r.number in trials else None,
            "params": space.flat_params(r.policy),
            "policy": r.policy.to_dict(),
            "metrics": {
                **r.result.metrics(),
                **({"accuracy_drop": r.accuracy_drop} if r.accuracy_drop is not None else {}),
                **(
                    {"confirmed_step_time_ms": confirmed[str(r.number)]}
                    if str(r.number) in confirmed
                    else {}
                ),
            },
            "feasible": r.feasible,
            "pareto": r.number in front_keys,
            "mlflow_run_id": r.mlflow_run_id,
            "peak_memory_is_estimate": r.result.peak_memory_is_estimate,
            "switches": r.result.switches,
            "telemetry": _telemetry_brief(r.result),
        }

    best_entry = entry(best)
    best_entry["trial"] = best.number
    best_entry["speedup_vs_fp32"] = step_time_ms(baseline) / step_time_ms(best)
    best_entry["memory_saving_vs_fp32"] = (
        1.0 - best.result.peak_memory_mb / baseline.result.peak_memory_mb
    )
    duplicates = sum(1 for t in study.trials if "duplicate_of" in t.user_attrs)
    return {
        "study": study.study_name,
        "metric_names": [*TrialResult.METRICS, "accuracy_drop"],
        "peak_memory_is_estimate": baseline.result.peak_memory_is_estimate,
        "step_times_confirmed": sorted(confirmed),
        "accuracy_tolerance": tolerance,
        "prefer": prefer,
        "baseline": entry(baseline),
        "trials": [entry(r) for r in records],
        "pareto_front": [
            k for k in [baseline.number, *(r.number for r in records)] if k in front_keys
        ],
        "best": best_entry,
        "duplicates_skipped": duplicates,
        # What fp16 would do to the fp32 baseline's own gradients and activations.
        "advice": (baseline.result.telemetry or {}).get("warnings", []),
        "trial_time_s": baseline.result.run_time_s + sum(r.result.run_time_s for r in records),
    }


def _telemetry_brief(result: TrialResult) -> dict[str, Any]:
    """The worst layers and the warnings, for summary.json (the full table is in MLflow)."""
    telemetry = result.telemetry or {}
    return {
        "grad_underflow_ratio": telemetry.get("grad_underflow_ratio"),
        "observed_steps": telemetry.get("observed_steps", 0),
        "worst_layers": telemetry.get("layers", [])[:3],
        "warnings": telemetry.get("warnings", []),
        "loss_scale_final": result.loss_scales[-1] if result.loss_scales else None,
        "loss_scale_min": min(result.loss_scales) if result.loss_scales else None,
    }


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)
    }


def _finite(value: Any) -> Any:
    """Strict JSON: non-finite floats (a diverged loss) become the strings 'nan', 'inf'."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
