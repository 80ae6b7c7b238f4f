"""Trials per hour with 1, 2 and 4 workers on the CPU, one study each.

Run by hand: ``python benchmarks/bench_workers.py [--trials 16] [--steps 100]``.
Each search runs on fresh sqlite stores in a temporary folder, on the tiny built-in
digits MLP task, with ``--confirm-top 0``. Two rates are printed, measured in the same
run side by side:

- *trial phase*: trials measured per hour between the first trial's start and the last
  one's end, as Optuna recorded them (what a long search converges to);
- *end to end*: trials per hour of the whole ``autoprec.search`` call, set-up,
  baseline and worker start-up (each worker imports torch and MLflow and warms up)
  included.

On a machine with C cores, workers share them (each gets C/N threads): expect the
trial-phase rate to grow little past C workers.
"""

from __future__ import annotations

import argparse
import os
import time

import optuna
from _fresh import fresh_folder

import autoprec
from autoprec.study._studies import RECORD_ATTR


def run(workers: int, trials: int, steps: int) -> dict:
    with fresh_folder() as folder:
        started = time.perf_counter()
        autoprec.search(
            "digits-mlp",
            trials=trials,
            steps=steps,
            device="cpu",
            workers=workers,
            study="bench",
            confirm_top=0,
        )
        wall_s = time.perf_counter() - started
        study = optuna.load_study(study_name="bench", storage=f"sqlite:///{folder}/runs/optuna.db")
        measured = [t for t in study.trials if RECORD_ATTR in t.user_attrs]
    first = min(t.datetime_start for t in measured)
    last = max(t.datetime_complete for t in measured)
    phase_s = (last - first).total_seconds()
    return {
        "workers": workers,
        "trials": len(measured),
        "phase_s": phase_s,
        "wall_s": wall_s,
        "per_hour_phase": 3600 * len(measured) / phase_s,
        "per_hour_wall": 3600 * len(measured) / wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPU cores; digits-mlp, {args.trials} trials x {args.steps} steps")
    rows = [run(n, args.trials, args.steps) for n in args.workers]
    base = rows[0]
    print(
        f"{'workers':>7} {'trials':>6} {'phase s':>8} {'trials/h':>9} {'x':>5} "
        f"{'wall s':>7} {'trials/h':>9} {'x':>5}"
    )
    print(f"{'':>7} {'':>6} {'(trial phase)':>24} {'(end to end)':>23}")
    for r in rows:
        print(
            f"{r['workers']:>7} {r['trials']:>6} {r['phase_s']:>8.1f} {r['per_hour_phase']:>9.0f} "
            f"{r['per_hour_phase'] / base['per_hour_phase']:>5.2f} {r['wall_s']:>7.1f} "
            f"{r['per_hour_wall']:>9.0f} {r['per_hour_wall'] / base['per_hour_wall']:>5.2f}"
        )


if __name__ == "__main__":
    main()
