"""The task zoo's table: ground truth from long real runs, and how autoprec's judgements
compare with it.

Run by hand:

- ``python benchmarks/bench_zoo.py --ground-truth [--only NAME,...]``: measure the truth
  (10x a 200-step trial, every task under fp32, uniform fp16 and bf16, the fragile ones
  over seeds and with their failing group in fp32, the boundary ones under mixed fp16/bf16
  policies) into ``benchmarks/zoo_truth.json``; rows of tasks not named are kept.
- ``python benchmarks/bench_zoo.py [--only NAME,...] [--steps 100,200]``: print the table
  of the truth and the calibration of autoprec's at-risk and infeasible verdicts, by real
  ``autoprec.search`` runs on each task (`autoprec.tasks.zoo.calibration`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autoprec.tasks.zoo import ZOO
from autoprec.tasks.zoo.truth import TABLE_VERSION, TRUTH_STEPS, measure_entry, table_path


def _names(only: str | None) -> list[str]:
    if not only:
        return list(ZOO)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise SystemExit(
            f"--only: unknown zoo task(s) {', '.join(unknown)}; the zoo: {', '.join(ZOO)}"
        )
    return names


def _update_table(path: Path, name: str, row: dict[str, Any]) -> None:
    """Write one task's row into the table, under a lock (several measuring processes
    may share the file)."""
    lock = path.with_suffix(".lock")
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        table: dict[str, Any] = {"version": TABLE_VERSION, "steps": TRUTH_STEPS, "tasks": {}}
        if path.is_file():
            cached = json.loads(path.read_text())
            if cached.get("version") == TABLE_VERSION and cached.get("steps") == TRUTH_STEPS:
                table = cached
        table["torch"] = torch.__version__
        table["tasks"][name] = row
        table["tasks"] = {n: table["tasks"][n] for n in ZOO if n in table["tasks"]}
        path.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")


def ground_truth(names: list[str], path: Path) -> None:
    started = time.perf_counter()
    for name in names:
        print(f"{name}: measuring", flush=True)
        row = measure_entry(ZOO[name])
        _update_table(path, name, row)
        print(f"{name}: {row['measured_s']} s", flush=True)
    print(f"ground truth of {len(names)} task(s): {time.perf_counter() - started:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ground-truth", action="store_true", help="measure the truth table")
    parser.add_argument("--only", help="comma-separated zoo task names (default: all)")
    parser.add_argument("--steps", default="100,200", help="trial lengths of the searches")
    parser.add_argument("--table", type=Path, default=table_path())
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = _names(args.only)
    if args.ground_truth:
        ground_truth(names, args.table)
        return 0
    from autoprec.tasks.zoo.calibration import main_table

    return main_table(names, [int(s) for s in args.steps.split(",")], args.table)


if __name__ == "__main__":
    sys.exit(main())
