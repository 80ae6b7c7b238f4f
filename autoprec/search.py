"""The search: an Optuna study over a space of policies, each trial a real short training.

Order of work, so that bad input never touches a store:
1. load and check the task, the space, the device and every option;
2. open the Optuna study (created once; continued when it exists and fits) and the
   MLflow experiment, and open or reopen the study's parent run;
3. run the fp32 baseline once per study (kept in the study, logged as a child run),
   and enqueue the uniform fp16 and bf16 anchors once;
4. ask, train, tell and log until the study holds ``trials`` finished trials;
5. choose the best feasible policy (accuracy drop within tolerance) by the preference,
   and write ``runs/<study>/best_policy.yaml`` and ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autoprec.devices import DTYPES, Backend, get_backend
from autoprec.errors import AutoprecError, StoreError
from autoprec.policy import Policy
from autoprec.report import policy_label
from autoprec.selection import PREFERENCES, Candidate, pareto_front, select_best
from autoprec.space import DEFAULT_SPACE, SearchSpace, builtin_spaces, load_space
from autoprec.tasks import DEFAULT_TASK, Task, check_task, check_task_data, load_task
from autoprec.tracking import (
    DEFAULT_TRACKING_URI,
    Tracker,
    absolute_sqlite_uri,
    check_tracking_uri,
)
from autoprec.trial import Budget, EarlyStopping, TrialResult, run_trial, time_side_by_side

DEFAULT_STORAGE = "sqlite:///runs/optuna.db"
DEFAULT_RUNS_DIR = Path("runs")
SAMPLERS = ("tpe", "nsga2", "random")
OBJECTIVES = ("accuracy", "peak_memory_mb", "step_time_ms")
DIRECTIONS = ("maximize", "minimize", "minimize")
# Sampled policies identical to one already measured are not trained again; after this
# many in a row the space is taken as exhausted.
MAX_DUPLICATES_IN_A_ROW = 25
RECORD_ATTR = "autoprec"  # the Optuna user attribute holding a trial's policy and result
CONFIRMED_ATTR = "confirmed_step_time_ms"  # study attribute: side-by-side re-timings
_STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_STATES = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED, "failed": TrialState.FAIL}


@dataclass
class SearchResult:
    study: str
    best_policy: Policy
    summary: dict[str, Any]
    best_policy_path: Path
    summary_path: Path


@dataclass(frozen=True)
class TrialRecord:
    """One measured policy, as the progress display and the summary see it."""

    number: int | str
    policy: Policy
    result: TrialResult
    accuracy_drop: float | None
    feasible: bool
    mlflow_run_id: str | None


ProgressCallback = Callable[[str, dict[str, Any]], None]


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
    sampler: str = "tpe",
    runs_dir: str | Path = DEFAULT_RUNS_DIR,
    confirm_top: int = 3,
    early_stopping: bool = True,
    progress: ProgressCallback | None = None,
) -> SearchResult:
    """Search precision policies for a task and return the best one.

    ``trials`` is the study's total: continuing a study runs only what is missing.
    Unless ``prefer="memory"``, the ``confirm_top`` fastest feasible policies are timed
    again side by side with the baseline before the choice (0 skips that). With
    ``early_stopping``, hopeless trials stop early (see `EarlyStopping`).
    """
    started_s = time.perf_counter()
    notify = progress or (lambda event, data: None)

    # 1. Everything the user gave is checked before any store is opened.
    task = load_task(task) if isinstance(task, str) else task
    model = check_task(task)
    if not isinstance(space, SearchSpace):
        space = load_space(space or default_space_for(task.name))
    backend = get_backend(device)
    space = space.fit(model).restrict({d for d in DTYPES if backend.supports(d)})
    if not isinstance(confirm_top, int) or confirm_top < 0:
        raise AutoprecError(f"--confirm-top: expected an integer >= 0, got {confirm_top!r}")
    if not isinstance(trials, int) or trials < 1:
        raise AutoprecError(f"--trials: expected a positive integer, got {trials!r}")
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
    if not _STUDY_NAME.match(study_name):
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
    optuna_study = _open_study(
        study_name, absolute_sqlite_uri(storage), sampler, seed, settings, trials
    )
    parent_id = tracker.start_parent(
        optuna_study.user_attrs.get("mlflow_parent_run_id"),
        {
            **settings,
            "trials": trials,
            "accuracy_tolerance": tolerance,
            "prefer": prefer,
            "sampler": sampler,
            "storage": storage,
        },
    )
    optuna_study.set_user_attr("mlflow_parent_run_id", parent_id)
    phases_s = {"setup": time.perf_counter() - started_s}

    status = "KILLED"
    try:
        # 3. Baseline and anchors, after a warm-up so that no trial pays this process's
        # one-time costs (lazy imports, thread pools, allocator growth) in its timings.
        mark_s = time.perf_counter()
        if optuna_study.user_attrs.get("baseline") is None or len(_finished(optuna_study)) < trials:
            _warm_up(task, space, backend, budget)
        phases_s["warm_up"] = time.perf_counter() - mark_s
        baseline = _baseline(optuna_study, task, space, backend, budget, tracker, parent_id, notify)
        if not optuna_study.user_attrs.get("anchors_enqueued"):
            for name, params in space.anchors().items():
                optuna_study.enqueue_trial(params, user_attrs={"anchor": name})
            optuna_study.set_user_attr("anchors_enqueued", True)

        # 4. Trials.
        stopper = EarlyStopping.from_baseline(baseline.result) if early_stopping else None
        context = _Context(
            task, space, backend, budget, tracker, parent_id, baseline, tolerance, stopper, model
        )
        interrupted = False
        try:
            _run_trials(optuna_study, context, trials, prefer, notify)
        except KeyboardInterrupt:  # Ctrl-C: keep what was measured, write it out, then stop
            interrupted = True
        mark_s = time.perf_counter()
        confirmed = (
            {}
            if interrupted
            else _confirm_step_times(optuna_study, context, prefer, confirm_top, notify)
        )
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
    }
    summary["mlflow_parent_run_id"] = parent_id
    summary["interrupted"] = interrupted
    best_policy = Policy.from_dict(summary["best"]["policy"])
    summary["best"]["layers"] = best_policy.layer_table(model)
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
class _Context:
    task: Task
    space: SearchSpace
    backend: Backend
    budget: Budget
    tracker: Tracker
    parent_id: str
    baseline: TrialRecord
    tolerance: float
    early_stopping: EarlyStopping | None
    model: Any  # the task's model, for resolving policies (never trained)


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


def _make_sampler(name: str, seed: int, trials: int) -> optuna.samplers.BaseSampler:
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(
            seed=seed, population_size=max(4, min(20, trials // 2))
        )
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=max(4, trials // 3), multivariate=True
    )


def _open_study(
    name: str, storage: str, sampler: str, seed: int, settings: dict[str, Any], trials: int
) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    logging.getLogger("sqlalchemy").setLevel(logging.WARNING)
    try:
        existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage)}.get(name)
        if existing is not None:
            old = {k: existing.user_attrs.get(k) for k in settings}
            changed = [k for k in settings if old[k] is not None and old[k] != settings[k]]
            if changed:
                key = changed[0]
                raise StoreError(
                    f"study {name!r} in {storage} was run with {key}={old[key]!r}, not "
                    f"{settings[key]!r}; use another --study or the same settings"
                )
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            sampler=_make_sampler(sampler, seed, trials),
            directions=list(DIRECTIONS),
            load_if_exists=True,
        )
    except StoreError:
        raise
    except Exception as error:
        raise StoreError(
            f"Optuna storage {storage}: {(str(error).splitlines() or [''])[0]}"
        ) from None
    if existing is None:
        for key, value in settings.items():
            study.set_user_attr(key, value)
    return study


def _warm_up(task: Task, space: SearchSpace, backend: Backend, budget: Budget) -> None:
    """A short untimed run of every dtype the space uses; its results are discarded."""
    steps = min(budget.steps, 2 * budget.untimed_steps + 2)
    for dtype in sorted({d for g in space.groups for d in g.dtypes}):
        run_trial(task, Policy.uniform(dtype), backend, Budget(steps=steps, seed=budget.seed))


def _baseline(
    study: optuna.Study,
    task: Task,
    space: SearchSpace,
    backend: Backend,
    budget: Budget,
    tracker: Tracker,
    parent_id: str,
    notify: ProgressCallback,
) -> TrialRecord:
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
    notify("baseline", {})
    result = run_trial(task, policy, backend, budget)
    if result.state != "complete":
        raise AutoprecError(
            f"task {task.name!r}: the fp32 baseline did not train ({result.reason}); "
            "fix the task before searching"
        )
    run_id = tracker.log_trial(
        parent_id,
        "baseline-fp32",
        space.flat_params(policy),
        result,
        {"accuracy_drop": 0.0},
        {"autoprec.role": "baseline", "state": "complete", "feasible": "true"},
        policy,
    )
    study.set_user_attr("baseline", {"result": result.to_dict(), "mlflow_run_id": run_id})
    return TrialRecord("baseline", policy, result, 0.0, True, run_id)


def _finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that were measured to an end and recorded. Duplicates of measured policies
    and trials cut off by an interrupt are not counted."""
    return [
        t
        for t in study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        )
        if RECORD_ATTR in t.user_attrs
    ]


def _run_trials(
    study: optuna.Study, ctx: _Context, trials: int, prefer: str, notify: ProgressCallback
) -> None:
    finished = _finished(study)
    done = len(finished)
    seen = {_measured_as(ctx.baseline.policy, ctx.model): "baseline"}
    records = [_record(t, ctx.tolerance) for t in finished]
    for record in records:
        seen[_measured_as(record.policy, ctx.model)] = record.number
    notify("start", {"total": trials, "done": done, "records": records, "baseline": ctx.baseline})
    duplicates_in_a_row = 0
    while done < trials:
        trial = study.ask()
        try:
            policy = ctx.space.suggest(trial)
        except Exception:
            study.tell(trial, state=TrialState.FAIL)
            raise
        key = _measured_as(policy, ctx.model)
        if key in seen:
            trial.set_user_attr("duplicate_of", seen[key])
            study.tell(trial, state=TrialState.PRUNED)
            duplicates_in_a_row += 1
            if duplicates_in_a_row >= MAX_DUPLICATES_IN_A_ROW:
                notify("exhausted", {"done": done})
                return
            continue
        duplicates_in_a_row = 0
        notify("trial_start", {"number": trial.number, "policy": policy})
        try:
            result = run_trial(ctx.task, policy, ctx.backend, ctx.budget, ctx.early_stopping)
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt):
                trial.set_user_attr("interrupted", True)
            study.tell(trial, state=TrialState.FAIL)
            anchor = trial.user_attrs.get("anchor")
            if anchor:  # measure the anchor when the study is continued
                study.enqueue_trial(trial.params, user_attrs={"anchor": anchor})
            raise
        record = _tell_and_log(study, trial, policy, result, ctx)
        seen[key] = trial.number
        done += 1
        records.append(record)
        notify(
            "trial_end",
            {
                "record": record,
                "done": done,
                "total": trials,
                "records": records,
                "baseline": ctx.baseline,
                "prefer": prefer,
            },
        )


def _measured_as(policy: Policy, model: Any) -> str:
    """What a trial of this policy would measure: the dtype each layer runs in, and the
    loss scaling if any layer runs in fp16. Policies alike in this are trained once."""
    dtypes = policy.resolve(model)
    scaling = policy.loss_scale.to_dict() if "fp16" in dtypes.values() else {"mode": "none"}
    return json.dumps([dtypes, scaling, policy.tf32, policy.hf32], sort_keys=True)


def _tell_and_log(
    study: optuna.Study, trial: optuna.Trial, policy: Policy, result: TrialResult, ctx: _Context
) -> TrialRecord:
    drop = None
    feasible = False
    if result.state == "complete" and result.accuracy is not None:
        drop = ctx.baseline.result.accuracy - result.accuracy
        feasible = drop <= ctx.tolerance + 1e-12
        trial.set_constraint("accuracy_drop", drop - ctx.tolerance)
    anchor = trial.user_attrs.get("anchor")
    tags = {
        "autoprec.role": "trial",
        "state": result.state,
        "trial_number": str(trial.number),
        "feasible": str(feasible).lower(),
    }
    if result.reason:
        tags["reason"] = result.reason[:4000]
    if anchor:
        tags["anchor"] = anchor
    run_id = ctx.tracker.log_trial(
        ctx.parent_id,
        f"t{trial.number:03d} " + (anchor or policy_label(ctx.space.flat_params(policy))),
        ctx.space.flat_params(policy),
        result,
        {} if drop is None else {"accuracy_drop": drop},
        tags,
        policy,
    )
    # One storage write for everything autoprec keeps about the trial.
    trial.set_user_attr(
        RECORD_ATTR,
        {
            "policy": policy.to_dict(),
            "result": result.to_dict(),
            "accuracy_drop": drop,
            "feasible": feasible,
            "mlflow_run_id": run_id,
        },
    )
    if result.state == "complete":
        study.tell(trial, [result.accuracy, result.peak_memory_mb, result.step_time_ms])
    else:
        study.tell(trial, state=_STATES[result.state])
    return TrialRecord(trial.number, policy, result, drop, feasible, run_id)


def _record(trial: optuna.trial.FrozenTrial, tolerance: float) -> TrialRecord:
    """A stored trial; feasibility follows the tolerance in force now."""
    attrs = trial.user_attrs[RECORD_ATTR]
    drop = attrs.get("accuracy_drop")
    return TrialRecord(
        trial.number,
        Policy.from_dict(attrs["policy"]),
        TrialResult.from_dict(attrs["result"]),
        drop,
        drop is not None and drop <= tolerance + 1e-12,
        attrs.get("mlflow_run_id"),
    )


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
    study: optuna.Study, ctx: _Context, prefer: str, top: int, notify: ProgressCallback
) -> dict[str, float]:
    """Re-time the ``top`` best feasible policies (by step time, or by the balanced score)
    and the baseline side by side.

    Kept in the study, and measured again only when the set of candidates changes.
    """
    if prefer == "memory" or top <= 0:
        return {}
    records = [_record(t, ctx.tolerance) for t in _finished(study)]
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
    finished = {t.number: t for t in _finished(study)}
    records = [_record(t, tolerance) for t in finished.values()]
    front_keys = {c.key for c in pareto_front(candidates([baseline, *records], confirmed))}
    best = best_record(records, baseline, prefer, confirmed)

    def step_time_ms(r: TrialRecord) -> float:
        return confirmed.get(str(r.number), r.result.step_time_ms)

    def entry(r: TrialRecord) -> dict[str, Any]:
        return {
            "number": r.number,
            "state": r.result.state,
            "reason": r.result.reason,
            "anchor": finished[r.number].user_attrs.get("anchor") if r.number in finished else None,
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
