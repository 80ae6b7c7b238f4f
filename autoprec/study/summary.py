"""What a search hands back: the candidates, the chosen best, the typed `Summary` (the one
place it is built: `summarize`, then `completed`), summary.json and best_policy.yaml.

Pure functions over the study's records, so that the same choice is made from a live
study, from summary.json, or in a test; `write_outputs` is the one that writes files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autoprec._util.files import write_atomic
from autoprec.errors import AutoprecError
from autoprec.numerics.state_health import GroupStateHealth, GroupStateLoss
from autoprec.policy import Policy
from autoprec.selection import Candidate, pareto_front, select_best
from autoprec.space import SearchSpace
from autoprec.study._records import Feasibility, Result, TrialRecord, record_of
from autoprec.study._studies import CLAIM_ATTR, RECORD_ATTR, STEPPED_BACK_ATTR, finished
from autoprec.study.summary_schema import (
    CONFIRMED_TIME,
    Best,
    Entry,
    Layer,
    ProfileRow,
    Settings,
    Summary,
    SummaryPart,
    finite,
)
from autoprec.trials.base import measured

INTERRUPTED = "interrupted (Ctrl-C) before it ended; not counted"
KILLED = "its process stopped before the trial ended (killed?): failed by heartbeat; not counted"
HEADROOM_METRIC = "headroom_now_bits"  # a trial's least activation headroom (the forecast's)


def candidates(
    records: list[TrialRecord], confirmed: dict[str, float] | None = None
) -> list[Candidate]:
    """Completed records as candidates. A confirmed step time replaces the trial's own;
    the others are scaled by the baseline's confirmed-to-own ratio, so that all compare.
    Each names its policy (the tie's last word) and the least headroom its trial saw."""
    confirmed = confirmed or {}
    scale = 1.0
    baseline = next((r for r in records if r.number == "baseline"), None)
    if baseline is not None and "baseline" in confirmed:
        scale = confirmed["baseline"] / measured(baseline.result.time_ms, "time")
    return [
        Candidate(
            r.number,
            measured(r.result.accuracy, "accuracy"),
            measured(r.result.peak_memory_mb, "peak memory"),
            confirmed.get(str(r.number), measured(r.result.time_ms, "time") * scale),
            r.feasible,
            identity=json.dumps(r.policy.to_dict(), sort_keys=True),
            headroom_bits=r.result.extra_metrics().get(HEADROOM_METRIC),
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


@dataclass(frozen=True)
class _Read:
    """What the summary reads of a trial's result beyond its metrics. `_read` reads it
    through the trials' result protocol (`autoprec.trials.base.Result`)."""

    mode: str
    metric_names: tuple[str, ...]
    switches: dict[str, Any]
    latency_by_batch_ms: dict[int, float] | None
    telemetry: dict[str, Any]
    advice: list[str]
    execution: dict[str, Any]  # compiled, compute capability, emulated dtypes
    state_health: list[GroupStateHealth]  # per optimizer-state group (training)
    state_loss: list[GroupStateLoss]


def _read(result: Result) -> _Read:
    fields = result.entry_fields()  # switches; a serving result's latency by batch
    return _Read(
        mode=result.MODE,
        metric_names=tuple(result.METRICS),
        switches=fields.get("switches", {}),
        latency_by_batch_ms=latency_by_batch(result),
        telemetry=result.telemetry_brief(),
        advice=result.advice(),
        execution=fields.get("execution") or {},
        state_health=list(fields.get("state_health") or []),
        state_loss=list(fields.get("state_loss") or []),
    )


def summarize(
    study: optuna.Study,
    space: SearchSpace,
    baseline: TrialRecord,
    feasibility: Feasibility,
    prefer: str,
    confirmed: dict[str, float] | None = None,
    run_ids: dict[str, str] | None = None,
    part: SummaryPart | None = None,
) -> Summary:
    """The summary: the baseline, every trial, the Pareto front, and the chosen best.

    Where step times were confirmed side by side, the front and the choice use them;
    ``run_ids`` are the MLflow child runs by key (trial number or "baseline"). The mode's
    own ``part`` (`autoprec.trials.Mode.summary_part`) takes what the trials measured
    (serving: the best at each batch size). What the search knows only once the choice is
    made (settings, the layer table, what the mode leaves behind) is `completed`'s; the
    search's own wall time is set as the file is written.
    """
    confirmed = confirmed or {}
    run_ids = run_ids or {}
    trials = {t.number: t for t in finished(study)}
    records = [record_of(t, feasibility, type(baseline.result)) for t in trials.values()]
    cut = cut_off(study, space, type(baseline.result))
    trials.update({t.number: t for t in study.get_trials(deepcopy=False) if t.number in cut})
    front_keys = {c.key for c in pareto_front(candidates([baseline, *records], confirmed))}
    best = best_record(records, baseline, prefer, confirmed)

    def step_time_ms(r: TrialRecord) -> float:
        return confirmed.get(str(r.number), measured(r.result.time_ms, "time"))

    def entry(r: TrialRecord) -> Entry:
        attrs = trials[r.number].user_attrs if r.number in trials else {}
        read = _read(r.result)
        metrics = dict(r.result.metrics())
        if r.accuracy_drop is not None:
            metrics["accuracy_drop"] = r.accuracy_drop
        if str(r.number) in confirmed:
            metrics[CONFIRMED_TIME] = confirmed[str(r.number)]
        return Entry(
            number=r.number,
            state=r.result.state,
            reason=r.result.reason,
            counted=r.number not in cut,
            anchor=attrs.get("anchor"),
            guided=attrs.get("guided"),
            params=space.flat_params(r.policy),
            policy=r.policy.to_dict(),
            metrics=metrics,
            feasible=r.feasible,
            pareto=r.number in front_keys,
            mlflow_run_id=run_ids.get(str(r.number)),
            peak_memory_is_estimate=r.result.peak_memory_is_estimate,
            switches=read.switches,
            latency_by_batch_ms=read.latency_by_batch_ms,
            telemetry=read.telemetry,
            execution=read.execution,
            state_health=read.state_health,
            state_loss=read.state_loss,
            retries=list(r.result.retries),
        )

    chosen = Best.of(
        entry(best),
        speedup_vs_fp32=step_time_ms(baseline) / step_time_ms(best),
        memory_saving_vs_fp32=1.0
        - measured(best.result.peak_memory_mb, "peak memory")
        / measured(baseline.result.peak_memory_mb, "peak memory"),
    )
    read = _read(baseline.result)
    return Summary(
        study=study.study_name,
        mode=read.mode,
        metric_names=list(dict.fromkeys((*read.metric_names, "accuracy_drop"))),
        peak_memory_is_estimate=baseline.result.peak_memory_is_estimate,
        step_times_confirmed=sorted(confirmed),
        accuracy_tolerance=feasibility.tolerance,
        prefer=prefer,
        baseline=entry(baseline),
        trials=[entry(r) for r in sorted([*records, *cut.values()], key=lambda r: r.number)],
        pareto_front=[
            k for k in [baseline.number, *(r.number for r in records)] if k in front_keys
        ],
        best=chosen,
        duplicates_skipped=sum(1 for t in study.trials if "duplicate_of" in t.user_attrs),
        # What fp16 would do to the fp32 baseline's own gradients and activations.
        advice=read.advice,
        trial_time_s=baseline.result.run_time_s + sum(r.result.run_time_s for r in records),
        part=None if part is None else part.summarized(records, baseline, confirmed),
    )


def completed(
    summary: Summary,
    *,
    settings: dict[str, Any],
    parent_run_id: str | None,
    identity: dict[str, Any],
    interrupted: bool,
    profile: list[ProfileRow] | None,
    layers: list[dict[str, Any]],
    left: dict[str, Any] | None = None,
) -> Summary:
    """The summary with what the search adds once the choice is made: the settings, the
    MLflow parent run, the Optuna study's identity, the profile's riskiest layers, the
    chosen policy's layer table and, in the mode's own part, what the mode's trials left
    behind (``left``: serving's saved model, or why not)."""
    best = replace(summary.best, layers=[Layer.from_json(row) for row in layers])
    part = summary.part
    return replace(
        summary,
        part=None if part is None else part.completed(left),
        best=best,
        settings=Settings(settings),
        mlflow_parent_run_id=parent_run_id,
        optuna_study=identity,
        interrupted=interrupted,
        profile=profile,
    )


def cut_off(
    study: optuna.Study, space: SearchSpace, result_type: type[Result]
) -> dict[int, TrialRecord]:
    """Trials that began to measure a policy (they claimed it) and never recorded a result:
    interrupted by Ctrl-C, or their process killed (failed by heartbeat). Not counted in
    the budget, and listed as failed with the reason, so that summary.json lists every
    trial that ran."""
    cut = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        attrs = t.user_attrs
        if CLAIM_ATTR not in attrs or RECORD_ATTR in attrs or STEPPED_BACK_ATTR in attrs:
            continue
        try:
            policy = space.policy(t.params)
        except (AutoprecError, KeyError, ValueError):  # asked under another space
            continue
        reason = INTERRUPTED if attrs.get("interrupted") else KILLED
        cut[t.number] = TrialRecord(t.number, policy, result_type("failed", reason), None, False)
    return cut


def latency_by_batch(result: Result) -> dict[int, float] | None:
    """A result's median latency at each batch size measured, where it measured several
    (a serving result's); None for training."""
    latencies = result.entry_fields().get("latency_by_batch_ms")
    return None if latencies is None else {int(k): v for k, v in latencies.items()}


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)
    }


def write_outputs(
    summary: Summary | dict[str, Any], policy: Policy, out_dir: Path
) -> tuple[Path, Path]:
    """``best_policy.yaml`` and ``summary.json`` (strict JSON) in ``out_dir`` (the study's
    folder: it is not followed where it is a link, see `autoprec._util.files`)."""
    if isinstance(summary, Summary):
        summary = summary.to_json()
    within = out_dir.parent
    policy_path = write_atomic(out_dir / "best_policy.yaml", policy.to_yaml(), within)
    summary_path = out_dir / "summary.json"
    text = json.dumps(finite(summary), indent=2, allow_nan=False) + "\n"
    write_atomic(summary_path, text, within)
    return policy_path, summary_path
