"""What a search hands back: the candidates, the chosen best, summary.json and
best_policy.yaml.

Pure functions over the study's records, so that the same choice is made from a live
study, from summary.json, or in a test; `write_outputs` is the one that writes files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autoprec.errors import AutoprecError
from autoprec.files import write_atomic
from autoprec.policy import Policy
from autoprec.search.records import Feasibility, Result, TrialRecord, record_of
from autoprec.search.studies import CLAIM_ATTR, RECORD_ATTR, STEPPED_BACK_ATTR, finished
from autoprec.selection import Candidate, pareto_front, select_best
from autoprec.space import SearchSpace

INTERRUPTED = "interrupted (Ctrl-C) before it ended; not counted"
KILLED = "its process stopped before the trial ended (killed?): failed by heartbeat; not counted"


def candidates(
    records: list[TrialRecord], confirmed: dict[str, float] | None = None
) -> list[Candidate]:
    """Completed records as candidates. A confirmed step time replaces the trial's own;
    the others are scaled by the baseline's confirmed-to-own ratio, so that all compare."""
    confirmed = confirmed or {}
    scale = 1.0
    baseline = next((r for r in records if r.number == "baseline"), None)
    if baseline is not None and "baseline" in confirmed:
        scale = confirmed["baseline"] / baseline.result.time_ms
    return [
        Candidate(
            r.number,
            r.result.accuracy,
            r.result.peak_memory_mb,
            confirmed.get(str(r.number), r.result.time_ms * scale),
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


def summarize(
    study: optuna.Study,
    space: SearchSpace,
    baseline: TrialRecord,
    feasibility: Feasibility,
    prefer: str,
    confirmed: dict[str, float] | None = None,
    run_ids: dict[str, str] | None = None,
) -> dict[str, Any]:
    """summary.json: the baseline, every trial, the Pareto front, and the chosen best.

    Where step times were confirmed side by side, the front and the choice use them;
    ``run_ids`` are the MLflow child runs by key (trial number or "baseline").
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
        return confirmed.get(str(r.number), r.result.time_ms)

    def entry(r: TrialRecord) -> dict[str, Any]:
        return {
            "number": r.number,
            "state": r.result.state,
            "reason": r.result.reason,
            "counted": r.number not in cut,  # in the budget: measured to an end
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
            "mlflow_run_id": run_ids.get(str(r.number)),
            "peak_memory_is_estimate": r.result.peak_memory_is_estimate,
            **r.result.entry_fields(),  # switches; a serving trial's latency by batch
            "telemetry": r.result.telemetry_brief(),
        }

    best_entry = entry(best)
    best_entry["trial"] = best.number
    best_entry["speedup_vs_fp32"] = step_time_ms(baseline) / step_time_ms(best)
    best_entry["memory_saving_vs_fp32"] = (
        1.0 - best.result.peak_memory_mb / baseline.result.peak_memory_mb
    )
    duplicates = sum(1 for t in study.trials if "duplicate_of" in t.user_attrs)
    metric_names = dict.fromkeys((*type(baseline.result).METRICS, "accuracy_drop"))
    return {
        "study": study.study_name,
        "mode": baseline.result.MODE,
        "metric_names": list(metric_names),
        "peak_memory_is_estimate": baseline.result.peak_memory_is_estimate,
        "step_times_confirmed": sorted(confirmed),
        "accuracy_tolerance": feasibility.tolerance,
        "prefer": prefer,
        "baseline": entry(baseline),
        "trials": [entry(r) for r in sorted([*records, *cut.values()], key=lambda r: r.number)],
        "pareto_front": [
            k for k in [baseline.number, *(r.number for r in records)] if k in front_keys
        ],
        "best": best_entry,
        "duplicates_skipped": duplicates,
        # What fp16 would do to the fp32 baseline's own gradients and activations.
        "advice": baseline.result.advice(),
        "trial_time_s": baseline.result.run_time_s + sum(r.result.run_time_s for r in records),
    }


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


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)
    }


def finite(value: Any) -> Any:
    """Strict JSON: non-finite floats (a diverged loss) become the strings 'nan', 'inf'."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def write_outputs(summary: dict[str, Any], policy: Policy, out_dir: Path) -> tuple[Path, Path]:
    """``best_policy.yaml`` and ``summary.json`` (strict JSON) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    policy_path = policy.save(out_dir / "best_policy.yaml")
    summary_path = out_dir / "summary.json"
    write_atomic(summary_path, json.dumps(finite(summary), indent=2, allow_nan=False) + "\n")
    return policy_path, summary_path
