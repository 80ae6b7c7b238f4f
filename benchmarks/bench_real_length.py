"""Whether the search's answer holds at the real length on the task zoo (issue 27):
``autoprec.search`` with ``--train-steps`` and ``--confirm-steps`` at 10x the trial, on
every zoo task, its answer checked against the confirmation and the zoo's truth table, and
the confirmation's reasons against the truth's layer and mechanism
(`autoprec.tasks.zoo.real_length`).

Run by hand (the truth table must be in ``benchmarks/zoo_truth.json``):

    python benchmarks/bench_real_length.py [--only NAME,...] [--steps 200] [--out FILE]
    python benchmarks/bench_real_length.py --reasons [--only NAME,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from autoprec.tasks.zoo import ZOO, Kind
from autoprec.tasks.zoo.real_length import (
    confirmation_reason,
    names_or_all,
    search_at_real_length,
    summary_line,
    verdict_rows,
)
from autoprec.tasks.zoo.truth import load_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated zoo task names (default: all)")
    parser.add_argument("--steps", type=int, default=200, help="trial steps (real: 10x)")
    parser.add_argument("--out", type=Path, help="write the verdicts as JSON")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--reasons",
        action="store_true",
        help="instead: each fragile task's uniform fp16 trained to the real length as the "
        "confirmation trains it, and what it names (layer, mechanism) against the truth",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    table = load_table()
    names = [n for n in names_or_all(args.only) if n in table["tasks"]]
    if args.reasons:
        return _reasons(names, 10 * args.steps, table)
    verdicts = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zoo-real-length-") as scratch:
        for name in names:
            folder = Path(scratch) / name
            folder.mkdir()
            verdict = search_at_real_length(ZOO[name], args.steps, table, folder)
            print(verdict_rows([verdict])[-1], flush=True)
            verdicts.append(verdict)
    print(f"\n{len(verdicts)} searches in {time.perf_counter() - started:.0f} s\n")
    print("\n".join(verdict_rows(verdicts)))
    print()
    print(summary_line(verdicts))
    if args.out:
        args.out.write_text(json.dumps([asdict(v) for v in verdicts], indent=1) + "\n")
    return 0


def _reasons(names: list[str], real_steps: int, table: dict[str, Any]) -> int:
    rows = ["| task | failed | layer named | mechanism named | right layer | right mechanism |"]
    rows.append("|---|---|---|---|---|---|")
    right_layer = right_mechanism = failed = 0
    for name in names:
        entry = ZOO[name]
        if entry.kind != Kind.FRAGILE:
            continue
        named = confirmation_reason(entry, real_steps, table)
        if named is None:
            rows.append(f"| {name} | no | - | - | - | - |")
        else:
            failed += 1
            right_layer += bool(named.right_layer)
            right_mechanism += bool(named.right_mechanism)
            rows.append(
                f"| {name} | yes | {named.layer} | {named.mechanism} | {named.right_layer} | "
                f"{named.right_mechanism} |"
            )
        print(rows[-1], flush=True)
    print("\n".join(rows))
    print(f"\nright layer {right_layer}/{failed}, right mechanism {right_mechanism}/{failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
