"""Trials each search strategy needs to reach the oracle's best memory, on spaces small
enough to enumerate.

Run by hand: ``python benchmarks/bench_search_efficiency.py [--seeds 11] [--steps 40]``.

A tabular benchmark. Every policy of each task's space (2**7 = 128: seven groups, fp32
or fp16, dynamic loss scaling) is trained once for real with `run_trial` (fixed seed,
early stopping against the fp32 baseline as a search has it) and cached under
``runs/bench/``; the strategies then look their trials up in that table, so each seed
of each strategy costs milliseconds and all strategies see the same measurements.
The target is a feasible policy (accuracy drop within the space's tolerance) whose peak
memory is within 5% of the best feasible one in the table: on the CPU fp32 is the
fastest dtype, so step time would be a trivial target, and peak memory is a
deterministic estimate there.

Each strategy runs as ``autoprec search --sampler X`` would: the space's anchors first,
then the sampler (the search's samplers, objectives and accuracy constraint, on an
in-memory study); a proposal that would measure the same as a policy already measured
(the fp32 baseline included) is not trained and not counted, and 25 in a row end the
search. ``guided`` is the anchors, then `GuidedStrategy` (risk order from
``profile_task``), then TPE; ``fallback`` is `FallbackStrategy` alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from _efficiency_tasks import TASKS, task_and_space
from optuna.trial import TrialState

from autoprec.devices import get_backend
from autoprec.policy import Policy
from autoprec.profile.guided import FallbackStrategy, GuidedStrategy, Observation
from autoprec.space import SearchSpace
from autoprec.study._loop import MAX_DUPLICATES_IN_A_ROW
from autoprec.study._studies import DIRECTIONS, make_sampler
from autoprec.tasks import Task
from autoprec.trials.training import Budget, EarlyStopping, TrialResult, run_trial

CPU = get_backend("cpu")

TABLE_DIR = Path("runs/bench")
TABLE_VERSION = 1
TARGET = 1.05  # within 5% of the oracle's best peak memory
STRATEGIES = ("guided", "nsga2", "tpe", "random", "fallback", "guided, random order")


# -- the table: every policy of the space, measured once ------------------------------------


def enumerate_params(space: SearchSpace) -> list[dict[str, Any]]:
    """Every policy of a space whose only free parameters are the group dtypes (the loss
    scaling must be fixed: one mode, nothing else searched), as `suggest` names them."""
    scaling = {k: v for k, v in space.uniform_params("fp16").items() if k.startswith("loss_")}
    if len(space.loss_scale.modes) != 1 or set(scaling) - {"loss_scale.mode"}:
        raise SystemExit(f"{space.name}: the loss scaling is searched; cannot enumerate")
    every = []
    for dtypes in itertools.product(*(g.dtypes for g in space.groups)):
        names = (f"dtype.{g.name}" for g in space.groups)
        params: dict[str, Any] = dict(zip(names, dtypes, strict=True))
        every.append(params | (scaling if "fp16" in dtypes else {}))
    return every


def build_table(name: str, steps: int, rebuild: bool) -> dict[str, Any]:
    """The measured table for a task, from the cache when it fits; missing entries are
    measured and saved as they come, so an interrupted enumeration resumes."""
    task, space = task_and_space(name)
    model = task.model()
    space = space.fit(model)
    path = TABLE_DIR / f"search-efficiency-{name}-{steps}steps.json"
    settings = {
        "version": TABLE_VERSION,
        "task": name,
        "steps": steps,
        "seed": 0,
        "space_fingerprint": space.fingerprint(),
        "accuracy_tolerance": space.accuracy_tolerance,
    }
    table: dict[str, Any] = {**settings, "baseline": None, "policies": {}, "enumeration_s": 0.0}
    if path.is_file() and not rebuild:
        cached = json.loads(path.read_text())
        if all(cached.get(k) == v for k, v in settings.items()):
            table = cached
    every = enumerate_params(space)
    fp32 = space.uniform_params("fp32")
    missing = [
        p
        for p in every
        if space.policy(p).identity(model, CPU) not in table["policies"] and p != fp32
    ]
    if not missing and table["baseline"] is not None:
        return table
    backend = get_backend("cpu")
    budget = Budget(steps=steps, seed=0)
    started = time.perf_counter()
    for dtype in sorted({d for g in space.groups for d in g.dtypes}):  # one-time costs
        run_trial(task, Policy.uniform(dtype), backend, Budget(steps=8, seed=0))
    if table["baseline"] is None:
        baseline = run_trial(task, space.policy(space.uniform_params("fp32")), backend, budget)
        table["baseline"] = _entry(space.uniform_params("fp32"), baseline, baseline, space)
        fp32_key = space.policy(space.uniform_params("fp32")).identity(model, CPU)
        table["policies"][fp32_key] = table["baseline"]  # the same training, not run twice
    baseline = TrialResult.from_dict(table["baseline"]["result"])
    stopper = EarlyStopping.from_baseline(baseline)
    print(f"{name}: measuring {len(missing)} of {len(every)} policies ({steps} steps each)")
    for i, params in enumerate(missing, 1):
        result = run_trial(task, space.policy(params), backend, budget, stopper)
        entry = _entry(params, result, baseline, space)
        table["policies"][space.policy(params).identity(model, CPU)] = entry
        if i % 8 == 0 or i == len(missing):
            table["enumeration_s"] += time.perf_counter() - started
            started = time.perf_counter()
            _save(path, table)
            print(f"  {i}/{len(missing)}  {table['enumeration_s']:.0f} s", flush=True)
    return table


def _entry(
    params: dict[str, Any], result: TrialResult, baseline: TrialResult, space: SearchSpace
) -> dict[str, Any]:
    drop = None if result.accuracy is None else baseline.accuracy - result.accuracy
    feasible = result.state == "complete" and drop is not None
    feasible = feasible and drop <= space.accuracy_tolerance + 1e-12
    brief = {k: v for k, v in result.to_dict().items() if k not in ("telemetry", "losses")}
    brief["loss_scales"] = []
    return {"params": params, "accuracy_drop": drop, "feasible": feasible, "result": brief}


def _save(path: Path, table: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(table, indent=1, allow_nan=True))
    temporary.replace(path)


# -- strategies against the table --------------------------------------------------------


class Lookup:
    """A task's table as a trial function, and the count of trials to the target."""

    def __init__(self, table: dict[str, Any], space: SearchSpace, model: Any) -> None:
        self.table, self.space, self.model = table, space, model
        self.tolerance = table["accuracy_tolerance"]
        feasible = [e for e in table["policies"].values() if e["feasible"]]
        self.best_memory_mb = min(e["result"]["peak_memory_mb"] for e in feasible)
        self.baseline_key = space.policy(space.uniform_params("fp32")).identity(model, CPU)

    def key(self, params: dict[str, Any]) -> str:
        return self.space.policy(params).identity(self.model, CPU)

    def on_target(self, entry: dict[str, Any]) -> bool:
        memory = entry["result"]["peak_memory_mb"]
        return entry["feasible"] and memory <= TARGET * self.best_memory_mb


class Run:
    """One strategy's search: counts the trained (non-duplicate) trials until the target."""

    def __init__(self, lookup: Lookup) -> None:
        self.lookup = lookup
        self.seen = {lookup.baseline_key}
        self.trials = 0
        self.seconds = 0.0
        self.reached: int | None = None
        self.history: list[Observation] = []

    def measure(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """The table's entry, or None for a duplicate (not trained, not counted)."""
        key = self.lookup.key(params)
        if key in self.seen:
            return None
        self.seen.add(key)
        entry = self.lookup.table["policies"][key]
        self.trials += 1
        self.seconds += entry["result"]["run_time_s"]
        result = entry["result"]
        metrics = {
            m: result[m]
            for m in ("accuracy", "peak_memory_mb", "step_time_ms")
            if result.get(m) is not None
        }
        self.history.append(Observation(params, result["state"], entry["feasible"], metrics))
        if self.reached is None and self.lookup.on_target(entry):
            self.reached = self.trials
        return entry

    @property
    def exhausted(self) -> bool:
        return self.reached is not None or len(self.seen) >= len(self.lookup.table["policies"])


def run_sampler(
    lookup: Lookup, sampler: str, seed: int, trials: int, guided: GuidedStrategy | None = None
) -> Run:
    """Anchors, then (for guided) the strategy's proposals, then the sampler, as search.py
    runs them; until the target is reached or 25 duplicates in a row."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        directions=list(DIRECTIONS), sampler=make_sampler(sampler, seed, trials)
    )
    for name, params in lookup.space.anchors().items():
        study.enqueue_trial(params, user_attrs={"anchor": name})
    run = Run(lookup)
    duplicates_in_a_row = 0
    while not run.exhausted and duplicates_in_a_row < MAX_DUPLICATES_IN_A_ROW:
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if guided is not None and not waiting:
            proposal = guided.propose(run.history)
            if proposal is not None:
                study.enqueue_trial(proposal[0], user_attrs={"guided": proposal[1]})
        trial = study.ask()
        lookup.space.suggest(trial)
        params = dict(trial.params)
        entry = run.measure(params)
        if entry is None:
            duplicates_in_a_row += 1
            study.tell(trial, state=TrialState.PRUNED)
            continue
        duplicates_in_a_row = 0
        result = entry["result"]
        if result["state"] == "complete":
            trial.set_constraint("accuracy_drop", entry["accuracy_drop"] - lookup.tolerance)
            study.tell(
                trial, [result["accuracy"], result["peak_memory_mb"], result["step_time_ms"]]
            )
        else:
            study.tell(
                trial, state=TrialState.PRUNED if result["state"] == "pruned" else TrialState.FAIL
            )
    return run


def run_fallback(lookup: Lookup) -> Run:
    strategy = FallbackStrategy(lookup.space)
    run = Run(lookup)
    while not run.exhausted and (proposal := strategy.propose(run.history)) is not None:
        run.measure(proposal[0])
    return run


# -- the profile -------------------------------------------------------------------------


def wait_for_profile(timeout_s: float) -> Callable[..., Any]:
    """autoprec.profile.profile_task, once it can be imported (it may be written
    alongside this benchmark)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            from autoprec.profile.sensitivity import profile_task

            return profile_task
        except ImportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(30)


def risk_order(
    profile_task: Callable[..., Any], task: Task, space: SearchSpace, seed: int
) -> tuple[list[str], float]:
    """The space's groups riskiest first by a profile of the low dtypes it searches, and
    the profile's time."""
    low = sorted({d for g in space.groups for d in g.dtypes} - {"fp32"})
    started = time.perf_counter()
    profile = profile_task(task, "cpu", seed=seed, dtypes=low)
    ranked = space.group_risk(profile, task.model())
    return [name for name, _ in ranked], time.perf_counter() - started


def shuffled(space: SearchSpace, seed: int) -> list[str]:
    names = [g.name for g in space.groups]
    random.Random(seed).shuffle(names)
    return names


# -- report ------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile; unreached targets are inf and sort last."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def show(value: float) -> str:
    return "-" if value == float("inf") else f"{value:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--trials", type=int, default=30, help="the --trials a user would pass")
    parser.add_argument("--rebuild", action="store_true", help="measure the tables again")
    parser.add_argument("--tables-only", action="store_true", help="measure and stop")
    parser.add_argument("--profile-wait-s", type=float, default=1800.0)
    args = parser.parse_args()

    tables = {name: build_table(name, args.steps, args.rebuild) for name in args.tasks}
    if args.tables_only:
        return
    profile_task = wait_for_profile(args.profile_wait_s)
    started = time.perf_counter()
    rows = []
    notes = []
    for name in args.tasks:
        task, space = task_and_space(name)
        model = task.model()
        space = space.fit(model)
        lookup = Lookup(tables[name], space, model)
        entries = list(tables[name]["policies"].values())
        trial_s = statistics.median(  # a trial that trains to the end
            e["result"]["run_time_s"] for e in entries if e["result"]["state"] == "complete"
        )
        on_target = [e for e in entries if lookup.on_target(e)]
        notes.append(
            f"{name}: {len(entries)} policies, {sum(e['feasible'] for e in entries)} feasible, "
            f"{len(on_target)} on target (<= {TARGET * lookup.best_memory_mb:.3f} MB; best "
            f"{lookup.best_memory_mb:.3f} MB, fp32 "
            f"{tables[name]['baseline']['result']['peak_memory_mb']:.3f} MB); enumeration "
            f"{tables[name]['enumeration_s']:.0f} s, median complete trial {trial_s:.2f} s"
        )
        counts: dict[str, list[float]] = {s: [] for s in STRATEGIES}
        seconds: dict[str, list[float]] = {s: [] for s in STRATEGIES}
        profile_s = []
        orders = []
        risk_order(profile_task, task, space, 0)  # pays the process's one-time costs
        for seed in range(args.seeds):
            order, elapsed = risk_order(profile_task, task, space, seed)
            profile_s.append(elapsed)
            orders.append(" > ".join(order))
            for strategy in STRATEGIES:
                if strategy == "fallback":
                    run = run_fallback(lookup)
                elif strategy.startswith("guided"):
                    # The ablation: the groups in a random order instead of the profile's.
                    ranked = order if strategy == "guided" else shuffled(space, seed)
                    guide = GuidedStrategy(space, ranked, prefer="memory")
                    run = run_sampler(lookup, "tpe", seed, args.trials, guide)
                else:
                    run = run_sampler(lookup, strategy, seed, args.trials)
                reached = float("inf") if run.reached is None else float(run.reached)
                counts[strategy].append(reached)
                seconds[strategy].append(run.seconds if run.reached is not None else float("inf"))
        profile_trials = statistics.median(profile_s) / trial_s
        notes.append(
            f"{name}: profile {statistics.median(profile_s):.2f} s = {profile_trials:.2f} "
            f"trial-equivalents (median over seeds); risk orders seen: "
            + "; ".join(f"{o} (x{orders.count(o)})" for o in dict.fromkeys(orders))
        )
        for strategy in STRATEGIES:
            values = counts[strategy]
            rows.append(
                (
                    name,
                    strategy,
                    show(statistics.median(values)),
                    f"{show(quantile(values, 0.25))}-{show(quantile(values, 0.75))}",
                    f"{sum(v <= args.trials for v in values)}/{len(values)}",
                    show(round(statistics.median(seconds[strategy]), 1)),
                )
            )

    print(
        f"\nSearch efficiency, CPU, {time.strftime('%Y-%m-%d')}: trials to a feasible policy "
        f"within 5% of the oracle's best peak memory (the CPU's deterministic estimate), "
        f"{args.seeds} seeds, {args.steps} steps per trial."
    )
    print(
        "Tabular: each trial is looked up in a table of every policy of the space, each "
        "trained once for real (run_trial, seed 0, early stopping as in a search)."
    )
    for note in notes:
        print("  " + note)
    header = ("task", "strategy", "median", "quartiles", f"<= {args.trials}", "median s")
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(
        "\n'-' = not reached (the strategy ended, or 25 duplicates in a row). 'median s' is the "
        "trials' own run time to the target, from the table. Guided is counted without its "
        "profile (see trial-equivalents above). "
        f"Strategies ran in {time.perf_counter() - started:.0f} s."
    )


if __name__ == "__main__":
    sys.exit(main())
