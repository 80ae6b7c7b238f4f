"""Framework overhead of a whole search: wall time against the trials' own run time.

Run by hand: ``python benchmarks/bench_search_overhead.py [--trials 12] [--steps 60 200]
[--sampler guided]``.
Each search starts on fresh sqlite stores in a temporary folder, in this process. The
wall time is that of ``autoprec.search`` (store creation and MLflow's import included);
the trials' time is the sum of each trial's own ``run_time_s`` (baseline included).
Also shown, per phase: opening the stores, the rest of the set-up before the trials
(the sensitivity profile, where the sampler or the space uses one, and the warm-up,
once per process; the baseline's own run time is counted with the trials),
re-timing the fastest candidates, waiting at the end for MLflow writes still queued
(they run on a background thread), and what is left per trial (Optuna's ask, suggest,
claim and tell).
Target: overhead at most 15% of the trials' time at 200 steps per trial.
"""

from __future__ import annotations

import argparse
import time

from _fresh import fresh_folder

import autoprec
from autoprec.study.config import SAMPLERS


def run(task: str, trials: int, steps: int, confirm_top: int, sampler: str) -> dict:
    with fresh_folder():
        started = time.perf_counter()
        result = autoprec.search(
            task,
            trials=trials,
            steps=steps,
            device="cpu",
            confirm_top=confirm_top,
            sampler=sampler,
        )
        wall_s = time.perf_counter() - started
    summary = result.summary
    phases = summary["phase_time_s"]
    trial_s = summary["trial_time_s"]
    evaluated = len(summary["trials"]) + 1
    # The set-up's second phase ran the baseline, whose own time is among the trials'.
    before_trials_s = phases["baseline"] - summary["baseline"]["metrics"]["run_time_s"]
    flush_s = phases.get("tracking_flush", 0.0)
    bookkeeping_s = (
        wall_s - trial_s - phases["setup"] - before_trials_s - phases["confirm"] - flush_s
    )
    return {
        "steps": steps,
        "trials": evaluated,
        "wall_s": wall_s,
        "trial_s": trial_s,
        "overhead": (wall_s - trial_s) / trial_s,
        "setup_s": phases["setup"],
        "before_trials_s": before_trials_s,
        "confirm_s": phases["confirm"],
        "flush_s": flush_s,
        "per_trial_ms": 1000 * bookkeeping_s / evaluated,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits-mlp")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--steps", type=int, nargs="+", default=[60, 200])
    parser.add_argument("--confirm-top", type=int, default=3)
    parser.add_argument("--sampler", default="guided", choices=SAMPLERS)
    args = parser.parse_args()
    print(
        f"task {args.task}, {args.trials} trials + baseline, sampler {args.sampler}, CPU, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    header = (
        "steps",
        "wall s",
        "trials s",
        "overhead",
        "setup s",
        "profile+warm-up s",
        "re-time s",
        "flush s",
        "other ms/trial",
    )
    print("  ".join(f"{h:>10}" for h in header))
    for steps in args.steps:
        r = run(args.task, args.trials, steps, args.confirm_top, args.sampler)
        print(
            "  ".join(
                f"{v:>10}"
                for v in (
                    r["steps"],
                    f"{r['wall_s']:.1f}",
                    f"{r['trial_s']:.1f}",
                    f"{r['overhead']:.1%}",
                    f"{r['setup_s']:.1f}",
                    f"{r['before_trials_s']:.1f}",
                    f"{r['confirm_s']:.1f}",
                    f"{r['flush_s']:.1f}",
                    f"{r['per_trial_ms']:.0f}",
                )
            )
        )
    print(
        "overhead = (wall - trials) / trials; target <= 15% at 200 steps. The first search in"
        " a process also pays the imports and the one-time costs the warm-up absorbs."
    )


if __name__ == "__main__":
    main()
