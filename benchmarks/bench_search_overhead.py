"""The default search as a user runs it: its wall time against its trials' own time.

Run by hand: ``python benchmarks/bench_search_overhead.py [--repeat 3] [-- ARGS ...]``.
Each repeat runs ``autoprec search --no-progress`` (the built-in default: digits-mlp, 12
trials of 200 steps, plus any ARGS) in a subprocess, in a fresh temporary folder (fresh
sqlite stores under runs/). The wall time is the subprocess's, from its start to its
exit; the trials' time is the sum of each trial's own ``run_time_s`` in summary.json,
the fp32 baseline's included. The rest, by phase (summary.json's ``phase_time_s``):

- start-up: the Python process and the imports until the search begins, timed apart
  in a process that imports what the command imports, and no more;
- set-up: the checks, opening the Optuna study and the MLflow experiment;
- profile, warm-up: the sensitivity profile; a short untimed run of each dtype;
- MLflow wait: MLflow's first writes waited for before the baseline is timed;
- baseline: the baseline's own phase less its run time (the parent run, the anchors);
- trials: the trial loop less the trials' own time (Optuna's ask and tell, logging);
- re-time: the fastest candidates timed again side by side with the baseline;
- summary: the choice, the layer table, the wait for MLflow's queued writes;
- exit: what is left (the tables printed, MLflow's last writes, the interpreter's exit).

Target (issue 40): wall time at most 1.10x the trials' time. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _fresh import fresh_folder

# What `autoprec search` imports before the search begins (the CLI, the study, the bar).
START_UP = "import autoprec.cli, autoprec.study, autoprec.progress, autoprec.report"
# The phases summary.json records, in the order a search runs them, and their labels.
PHASES = {
    "setup": "set-up",
    "profile": "profile",
    "warm_up": "warm-up",
    "tracking_wait": "MLflow wait",
    "baseline": "baseline",
    "trials": "trials",
    "confirm": "re-time",
    "tracking_flush": "summary",
}


def _seconds(argv: list[str], folder: str) -> float:
    started_s = time.perf_counter()
    done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started_s


def run_once(extra: list[str]) -> dict[str, float]:
    """One search in a fresh folder; its figures in seconds."""
    with fresh_folder() as folder:
        start_up_s = _seconds([sys.executable, "-c", START_UP], folder)
        argv = [sys.executable, "-m", "autoprec.cli", "search", "--no-progress", *extra]
        wall_s = _seconds(argv, folder)
        summary = json.loads(next(Path(folder, "runs").glob("*/summary.json")).read_text())
    phases = summary["phase_time_s"]
    trials_s = summary["trial_time_s"]
    baseline_run_s = summary["baseline"]["metrics"]["run_time_s"]
    figures = {"wall": wall_s, "trials_own": trials_s, "start-up": start_up_s}
    for key, label in PHASES.items():
        figures[label] = phases.get(key, 0.0)
    figures["baseline"] -= baseline_run_s  # its run is among the trials' own time
    figures["trials"] -= trials_s - baseline_run_s
    figures["exit"] = wall_s - start_up_s - summary["wall_time_s"]
    figures["ratio"] = wall_s / trials_s
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="more `autoprec search` options, after --")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(
        f"autoprec search {' '.join(args.extra)} (default: digits-mlp, 12 trials of 200 steps),"
        f" {os.cpu_count()} CPUs, load average {load:.1f}, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    runs = []
    for i in range(args.repeat):
        runs.append(run_once(args.extra))
        r = runs[-1]
        print(f"run {i + 1}: wall {r['wall']:.1f} s, trials {r['trials_own']:.1f} s, "
              f"ratio {r['ratio']:.2f}")  # fmt: skip
    keys = ["wall", "trials_own", "ratio", "start-up", *PHASES.values(), "exit"]
    print(f"\nmedian of {len(runs)} (load average now {os.getloadavg()[0]:.1f}):")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    medians = [statistics.median(r[k] for r in runs) for k in keys]
    print("| " + " | ".join(f"{m:.2f}" for m in medians) + " |")
    print(
        "wall: the `autoprec search` process; trials_own: the trials' own run time, the "
        "baseline's included; ratio = wall / trials_own (target <= 1.10); the other "
        "columns: the rest of the wall time by phase, in seconds."
    )


if __name__ == "__main__":
    main()
