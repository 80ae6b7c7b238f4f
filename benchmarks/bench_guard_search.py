"""What the guard saves the search, and whether the answers it gives hold (issue 38, "From
the search"), on the zoo.

    python benchmarks/bench_guard_search.py trials [--only NAME,...] [--steps 100,200]
    python benchmarks/bench_guard_search.py answers [--only NAME,...] [--steps 200]

``trials``: every zoo task's trials (the fp32 baseline, uniform fp16, uniform bf16 and, on
a fragile task, fp16 with its failing group in fp32: `forecast_rates.policies`), each run
three ways as a search runs it (`autoprec.trials.training.run_trial`, stopped early
against fp32): as today (a trial whose forecast cannot tell is extended in rounds), under
the guard (``Budget(guarded=True)``: no extension), and with the forecast off. The last is
the guarded trial less the time spent fitting the forecast, which is measured inside the
same run (every call of `autoprec.numerics.forecast.forecast` is timed); nothing else in a
trial depends on the forecast. It prints, per task and in all, the training time of each
and the ratios (the issue's target: guard / off at most 1.15).

``answers``: `autoprec.search` on each zoo task under ``guard=True`` (4 trials, --prefer
memory: on a CPU fp32 is fastest), then its best_policy.yaml applied as a user would
(``load_policy(...).apply(model)`` runs guarded by its ``guard:`` section) and trained to the
real length (10x the trials, as the truth), drawing batches through ``prec.guarded``. It
holds where it ends within the truth's tolerance of fp32's final metric
(`autoprec.tasks.zoo.truth.ACCURACY_TOLERANCE`) with no non-finite step reaching the
weights; it prints what the guard changed on the way.

Real runs only, one thread; each part takes minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import autoprec.trials.training as training
from autoprec.devices import get_backend
from autoprec.policy import Policy, load_policy
from autoprec.tasks.zoo import HF_TASKS, ZOO, Kind
from autoprec.tasks.zoo.forecast_rates import policies
from autoprec.tasks.zoo.truth import ACCURACY_TOLERANCE, cpu_kind, load_table

REAL_MULTIPLE = 10


class _FitClock:
    """Seconds spent inside the forecast's fit, counted around the trial's own calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = training.forecast

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def _timed_trial(
    task: Any, policy: Policy, budget: training.Budget, stopping: Any
) -> tuple[float, float, Any]:
    clock = _FitClock()
    training.forecast = clock  # type: ignore[assignment]
    try:
        started = time.perf_counter()
        result = training.run_trial(task, policy, get_backend("cpu"), budget, stopping)
        return time.perf_counter() - started, clock.seconds, result
    finally:
        training.forecast = clock._inner  # type: ignore[assignment]


def trials_part(names: list[str], steps_list: list[int]) -> None:
    print("| task | steps | today s | extended | guard s | off s | guard/off | today/off |")
    print("|---|---|---|---|---|---|---|---|")
    totals: dict[int, list[float]] = {s: [0.0, 0.0, 0.0, 0.0] for s in steps_list}
    for steps in steps_list:
        for index, name in enumerate(names):
            entry = ZOO[name]
            task = entry.task()
            today_s = guard_s = off_s = 0.0
            extended = 0
            # The two ways in turns, so that a warm cache favours neither.
            for guarded in (False, True) if index % 2 else (True, False):
                budget = training.Budget(steps=steps, guarded=guarded)
                wall, fit, baseline = _timed_trial(task, Policy.uniform("fp32"), budget, None)
                stopping = None
                if baseline.state == "complete":
                    stopping = training.EarlyStopping.from_baseline(baseline)
                run_s, off = wall, wall - fit
                for _, policy in policies(entry.kind.value, entry.failing_groups):
                    wall, fit, result = _timed_trial(task, policy, budget, stopping)
                    run_s += wall
                    off += wall - fit
                    ahead = (result.forecast or {}).get("extended_steps") or 0
                    if not guarded and ahead:
                        extended += 1
                if guarded:
                    guard_s, off_s = run_s, off
                else:
                    today_s = run_s
            row = totals[steps]
            row[0] += today_s
            row[1] += guard_s
            row[2] += off_s
            row[3] += extended
            print(
                f"| {name} | {steps} | {today_s:.1f} | {extended} | {guard_s:.1f} | "
                f"{off_s:.1f} | {guard_s / off_s:.3f} | {today_s / off_s:.2f} |",
                flush=True,
            )
    print()
    print("| steps | tasks | today s | trials extended | guard s | off s | guard/off | today/off |")
    print("|---|---|---|---|---|---|---|---|")
    for steps, (today_s, guard_s, off_s, extended) in totals.items():
        print(
            f"| {steps} | {len(names)} | {today_s:.0f} | {int(extended)} | {guard_s:.0f} | "
            f"{off_s:.0f} | {guard_s / off_s:.3f} | {today_s / off_s:.2f} |"
        )


def _guarded_long_run(name: str, policy: Policy, steps: int) -> tuple[float, int, Any]:
    """The task trained ``steps`` under ``policy`` applied as a user would (its guard:
    section), batches drawn through ``prec.guarded``: final metric, non-finite losses,
    and the guarded precision."""
    task = ZOO[name].task()
    backend = get_backend("cpu")
    torch.manual_seed(0)
    model = task.model().to(backend.device)
    model.train()
    prec = policy.apply(model, backend)
    optimizer = training._make_optimizer(task, policy, model)
    scheduler = task.make_scheduler(optimizer)
    if scheduler is not None and hasattr(prec, "track"):
        prec.track(scheduler)
    source = iter(task.train_data(0))

    def batches() -> Any:
        for step in range(steps):
            yield training.draw_batch(task, source, step, steps, backend)

    drawn_through = prec.guarded(batches()) if hasattr(prec, "guarded") else batches()
    nonfinite = 0
    for drawn in drawn_through:
        loss, _ = training.train_step(task, model, optimizer, prec, drawn, scheduler)
        nonfinite += 0 if math.isfinite(loss) else 1
    metric = training.evaluate(task, model, prec, backend)
    return metric, nonfinite, prec


def _answer(policy: Policy, name: str) -> str:
    """The answer in a few words: its name, else the dtypes its leaves resolve to."""
    if policy.name:
        return policy.name
    resolved = policy.resolve(ZOO[name].task().model())
    counts: dict[str, int] = {}
    for dtype in resolved.values():
        counts[dtype] = counts.get(dtype, 0) + 1
    return ", ".join(f"{dtype} x{count}" for dtype, count in sorted(counts.items()))


def answers_part(names: list[str], steps_list: list[int]) -> None:
    from autoprec.study import search

    table = load_table()
    print("| task | kind | steps | answer | guard changes | metric | fp32 (truth) | holds |")
    print("|---|---|---|---|---|---|---|---|")
    held = total = 0
    for steps in steps_list:
        for name in names:
            entry = ZOO[name]
            with tempfile.TemporaryDirectory() as folder:
                work = Path(folder)
                search(
                    entry.task(),
                    trials=4,
                    steps=steps,
                    guard=True,
                    prefer="memory",
                    device="cpu",
                    study=name,
                    storage=f"sqlite:///{work}/optuna.db",
                    tracking_uri=f"sqlite:///{work}/mlflow.db",
                    runs_dir=work,
                )
                policy = load_policy(work / name / "best_policy.yaml")
            real = REAL_MULTIPLE * steps
            metric, nonfinite, prec = _guarded_long_run(name, policy, real)
            row = table["tasks"].get(name, {})
            fp32 = (row.get("runs", {}).get("fp32") or [{}])[0].get("final_metric")
            # On a task whose fp32 training is chaotic (fp32 moved one ulp collapses alike,
            # the truth's fp32_chaotic) the metric cannot tell precision from chance: there
            # a run holds where nothing went out of range, as the truth judges its runs.
            chaotic = bool(row.get("fp32_chaotic"))
            holds = (
                nonfinite == 0
                and fp32 is not None
                and math.isfinite(metric)
                and (chaotic or fp32 - metric <= ACCURACY_TOLERANCE)
            )
            changes = getattr(prec, "changes", [])
            described = "; ".join(f"{c.step} {c.layer} {c.to_dtype}" for c in changes) or "none"
            total += 1
            held += holds
            fp32_text = "-" if fp32 is None else f"{fp32:.4f}"
            if chaotic:
                fp32_text += " (chaotic)"
            print(
                f"| {name} | {entry.kind.value} | {steps} | {_answer(policy, name)} | "
                f"{described} | {metric:.4f} | {fp32_text} | {'yes' if holds else 'NO'} |",
                flush=True,
            )
    print(f"\nanswers that hold at 10x under the guard: {held}/{total}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("trials", "answers"))
    parser.add_argument("--only", help="comma-separated zoo task names")
    parser.add_argument("--steps", help="trial lengths (trials: 100,200; answers: 200)")
    parser.add_argument("--all", action="store_true", help="the transformers tasks too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.only:
        names = args.only.split(",")
    else:
        names = [e.name for e in ZOO.values() if args.all or e.name not in HF_TASKS]
    names = [n for n in names if ZOO[n].kind != Kind.BOUNDARY or args.part == "trials"]
    default = "100,200" if args.part == "trials" else "200"
    steps_list = [int(s) for s in (args.steps or default).split(",")]
    print(f"# {args.part}, {time.strftime('%Y-%m-%d')}, CPU: {cpu_kind()}", file=sys.stderr)
    if args.part == "trials":
        trials_part(names, steps_list)
    else:
        answers_part(names, steps_list)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
