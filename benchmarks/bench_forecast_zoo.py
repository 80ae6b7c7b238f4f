"""The range forecast as a classifier on the zoo (issue 27): false alarms, recall and the
crossing step's error, for the overflow and the underflow side.

Run by hand (the zoo's ground truth must be in ``benchmarks/zoo_truth.json``; see
``bench_zoo.py --ground-truth``):

    python benchmarks/bench_forecast_zoo.py [--only NAME,...] [--steps 100,200] [--out FILE]

Every trial is a real one (`autoprec.trials.training.run_trial`, stopped early against
fp32 as a search's are), judged by `autoprec.tasks.zoo.forecast_rates`; the per-trial
verdicts and the rates are printed as Markdown (and written to ``--out`` as JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from autoprec.tasks.zoo import ZOO, Kind
from autoprec.tasks.zoo.forecast_rates import judge_task, rates, rates_table, verdicts_table
from autoprec.tasks.zoo.truth import cpu_kind, load_table, table_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated zoo task names (default: all)")
    parser.add_argument("--steps", default="100,200", help="trial lengths")
    parser.add_argument("--out", type=Path, help="write the verdicts and rates as JSON")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--table", type=Path, default=table_path(), help="the truth table judged against"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    table = load_table(args.table)
    here = cpu_kind()
    elsewhere = sorted(n for n, row in table["tasks"].items() if row.get("cpu") != here)
    if elsewhere:
        print(
            f"warning: {len(elsewhere)} row(s) of {args.table} were measured on another kind "
            f"of CPU than this one ({here}), whose fp16 kernels differ: "
            f"{', '.join(elsewhere)}",
            file=sys.stderr,
        )
    names = [n for n in (args.only.split(",") if args.only else ZOO) if n]
    names = [n for n in names if ZOO[n].kind != Kind.BOUNDARY or n in table["tasks"]]
    verdicts = []
    started = time.perf_counter()
    for steps in [int(s) for s in args.steps.split(",")]:
        for name in names:
            found = judge_task(name, steps, table)
            for v in found:
                print(f"{v.task} {v.policy} {v.steps}: {v.outcome} ({v.reason})", flush=True)
            verdicts.extend(found)
    print(f"\n{len(verdicts)} trials in {time.perf_counter() - started:.0f} s\n")
    print(verdicts_table(verdicts))
    print()
    print(rates_table(verdicts))
    if args.out:
        data = {
            "verdicts": [asdict(v) for v in verdicts],
            "rates": {
                side or "all": rates(verdicts, side).to_dict()
                for side in (None, "overflow", "underflow")
            },
        }
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
