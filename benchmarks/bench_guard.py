"""The guard on the zoo, measured as a classifier, and its cost (issue items 7 and 8).

Its false alarms on healthy and boundary tasks, its recall on fragile ones, and its
overhead side by side.

Run by hand (the zoo's ground truth must be in ``benchmarks/zoo_truth.json``):

    python benchmarks/bench_guard.py [--only NAME,...] [--all] [--fp8 NAME,... [--fp8-only]]
    python benchmarks/bench_guard.py --trusted-cost NAME,...
    python benchmarks/bench_guard.py --overhead [--ablate] [--overhead-tasks NAME:DTYPE:STEPS,...]

Every run is a real guarded run of the truth's length (`autoprec.tasks.zoo.guard_rates`):
fragile tasks in uniform fp16, healthy and boundary tasks in uniform fp16 and bf16. The
transformers tasks (tiny-gpt2, tiny-bert, tiny-llama, tiny-t5) take minutes a run on a
CPU: only with ``--all``. ``--fp8`` adds uniform fp8 runs (torchao emulated on the CPU)
of the tasks named. ``--overhead`` times a guarded and an unguarded copy of the same
model in alternating blocks of steps instead; ``--trusted-cost`` times a search and its
answer's guarded run against the search and an fp32 run, both at the real length.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from autoprec.guard import Guard
from autoprec.tasks.zoo import HF_TASKS, ZOO, Kind
from autoprec.tasks.zoo.guard_rates import (
    guarded_run,
    judge,
    rates,
    run_rows,
    side_by_side_overhead,
    trusted_answer_cost,
)
from autoprec.tasks.zoo.truth import TRUTH_STEPS, cpu_kind, load_table


def _runs_of(names: list[str], fp8: list[str]) -> list[tuple[str, str]]:
    """(task, dtype) for every run: fragile fp16; healthy and boundary fp16 and bf16."""
    planned = []
    for name in names:
        dtypes = ("fp16",) if ZOO[name].kind == Kind.FRAGILE else ("fp16", "bf16")
        planned += [(name, dtype) for dtype in dtypes]
    return planned + [(name, "fp8") for name in fp8]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated zoo task names (default: all)")
    parser.add_argument("--all", action="store_true", help="the transformers tasks too")
    parser.add_argument("--fp8", default="", help="tasks to run in uniform fp8 (emulated)")
    parser.add_argument("--fp8-only", action="store_true", help="only the --fp8 runs")
    parser.add_argument("--steps", type=int, default=TRUTH_STEPS, help="steps a run")
    parser.add_argument("--overhead", action="store_true", help="the overhead instead")
    parser.add_argument(
        "--overhead-tasks",
        default="zoo-prenorm-transformer:fp16:2000,tiny-gpt2:fp16:500",
        help="task:dtype:steps each copy trains, comma-separated",
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="with --overhead: each task again with watching and snapshots off (check_every "
        "and snapshot_every 100000): the per-step bookkeeping alone",
    )
    parser.add_argument(
        "--trusted-cost",
        default="",
        help="instead: for these tasks, search + a guarded real-length run against search + "
        "an fp32 real-length run",
    )
    parser.add_argument("--out", type=Path, help="write the runs as JSON")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_kind()}; torch {torch.__version__}; {args.threads} thread(s)", flush=True)
    if args.overhead:
        for spec in args.overhead_tasks.split(","):
            name, dtype, steps = spec.split(":")
            print(side_by_side_overhead(ZOO[name], dtype, int(steps)).line(), flush=True)
            if args.ablate:
                off = Guard(check_every=100_000, snapshot_every=100_000)
                print(side_by_side_overhead(ZOO[name], dtype, int(steps), guard=off).line())
        return 0
    if args.trusted_cost:
        for name in args.trusted_cost.split(","):
            with tempfile.TemporaryDirectory(prefix="bench-guard-") as scratch:
                print(trusted_answer_cost(ZOO[name], scratch).line(), flush=True)
        return 0
    table = load_table()
    names = [n for n in (args.only.split(",") if args.only else ZOO) if n]
    names = [n for n in names if n in table["tasks"] and (args.all or n not in HF_TASKS)]
    names = [] if args.fp8_only else names
    fp8 = [n for n in args.fp8.split(",") if n]
    verdicts = []
    started = time.perf_counter()
    for name, dtype in _runs_of(names, fp8):
        run = guarded_run(ZOO[name], dtype, args.steps, emulate="fp8" if dtype == "fp8" else ())
        verdict = judge(run, ZOO[name], table["tasks"][name])
        verdicts.append(verdict)
        for change in run.changes:
            print(f"  {name} {dtype}: {change.describe()}", flush=True)
        print(
            f"{name} {dtype}: {len(run.changes)} change(s), metric {run.final_metric}, "
            f"{run.crashed or ''} ({run.run_time_s:.1f} s)",
            flush=True,
        )
    skipped = [n for n in HF_TASKS if n not in names]
    print(f"\n{len(verdicts)} runs in {time.perf_counter() - started:.0f} s", end="")
    print(f"; not run (without --all): {', '.join(skipped)}\n" if skipped else "\n")
    print("\n".join(run_rows(verdicts)))
    print()
    print("\n".join(rates(verdicts)))
    if args.out:
        args.out.write_text(json.dumps([asdict(v.run) for v in verdicts], indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
