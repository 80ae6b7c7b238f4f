"""Guided against random search on fp8: trials to a feasible policy with at least half of
the Linear weights in fp8, on a {bf16, fp8} space of seven groups.

Run by hand: ``python benchmarks/bench_fp8_guided.py [--seeds 3] [--steps 20]``.

The task (`benchmarks/_fp8_tasks.py`): seven Linear layers, each its own group over
{bf16, fp8} (tensorwise), the LayerNorms in bf16; marker rows carry a massive activation
into ``wide``, whose tensorwise fp8 cast flushes the digit rows to zero. fp8 is emulated
on the CPU (torchao's float8 numerics, ``--emulate fp8``): the trials' accuracy is real,
their speed is not, which is why the target is the issue's (half the Linear weights in
fp8, feasible), not a step time.

Each trial is a real `run_trial` (seed 0, early stopping against the fp32 baseline as in
a search), measured the first time any strategy proposes its policy and kept in
``runs/bench/fp8-guided-<steps>steps.json``, so that every strategy sees the same
measurements and a rerun costs only the policies not measured yet. Each strategy runs as
``autoprec search --sampler X`` would: the space's anchors first (uniform bf16, uniform
fp8), then, for ``guided``, `GuidedStrategy` with the profile's orders (the groups'
fp16/bf16 risk, and the fp8 risk it bisects fp8 in: `autoprec.numerics.fp8_risk`, a profile per
seed), then TPE; ``random`` is Optuna's random sampler; ``guided, random order`` is the
guided strategy with a shuffled fp8 order (an ablation: what the profile's ranking
buys). A proposal that measures the same as a policy already measured (the fp32
baseline included) is not counted; a strategy stops at the target, after ``--trials``
counted trials, or after 25 duplicates in a row.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import optuna
from _fp8_tasks import GROUPS, deep_sink_mlp, fp8_space
from optuna.trial import TrialState
from torch import nn

from autoprec.devices import get_backend
from autoprec.policy import Policy
from autoprec.profile.guided import GuidedStrategy, Observation
from autoprec.profile.sensitivity import profile_task
from autoprec.space import SearchSpace
from autoprec.space.fitting import fp8_group_order
from autoprec.study._loop import MAX_DUPLICATES_IN_A_ROW
from autoprec.study._studies import DIRECTIONS, make_sampler
from autoprec.trials.training import Budget, EarlyStopping, TrialResult, run_trial

EMULATED = get_backend("cpu", emulate="fp8")
TABLE_DIR = Path("runs/bench")
TABLE_VERSION = 1
FP8_SHARE = 0.5  # the target: at least half of the Linear weights in fp8
STRATEGIES = ("guided", "random", "guided, random order")


class Table:
    """Trials measured once, by policy identity, kept on disk as they come."""

    def __init__(self, steps: int, space: SearchSpace, model: nn.Module) -> None:
        self.task = deep_sink_mlp()
        self.space, self.model, self.steps = space, model, steps
        self.path = TABLE_DIR / f"fp8-guided-{steps}steps.json"
        self.settings = {
            "version": TABLE_VERSION,
            "steps": steps,
            "seed": 0,
            "space_fingerprint": space.fingerprint(),
            "accuracy_tolerance": space.accuracy_tolerance,
        }
        self.data: dict[str, Any] = {**self.settings, "baseline": None, "policies": {}}
        if self.path.is_file():
            cached = json.loads(self.path.read_text())
            if all(cached.get(k) == v for k, v in self.settings.items()):
                self.data = cached
        self.linear_weights = {
            n: m.weight.numel() for n, m in model.named_modules() if type(m) is nn.Linear
        }
        self.measured_s = 0.0
        self.new = 0
        if self.data["baseline"] is None:
            result = self._run(Policy.uniform("fp32"), None)
            self.data["baseline"] = {"result": _brief(result)}
            self._save()
        self.baseline = TrialResult.from_dict(self.data["baseline"]["result"])
        self.stopper = EarlyStopping.from_baseline(self.baseline)
        self.baseline_key = self.key(space.uniform_params("fp32"))

    def key(self, params: dict[str, Any]) -> str:
        return self.space.policy(params).identity(self.model, EMULATED)

    def entry(self, params: dict[str, Any]) -> dict[str, Any]:
        """The policy's measurement, trained now if no strategy proposed it before."""
        key = self.key(params)
        if key not in self.data["policies"]:
            policy = self.space.policy(params)
            result = self._run(policy, self.stopper)
            drop = None if result.accuracy is None else self.baseline.accuracy - result.accuracy
            feasible = result.state == "complete" and drop is not None
            feasible = feasible and drop <= self.space.accuracy_tolerance + 1e-12
            resolved = policy.resolve(self.model, EMULATED)
            in_fp8 = sum(n for name, n in self.linear_weights.items() if resolved[name] == "fp8")
            self.data["policies"][key] = {
                "params": params,
                "feasible": feasible,
                "accuracy_drop": drop,
                "fp8_share": in_fp8 / sum(self.linear_weights.values()),
                "result": _brief(result),
            }
            self._save()
        return self.data["policies"][key]

    def _run(self, policy: Policy, stopper: EarlyStopping | None) -> TrialResult:
        started = time.perf_counter()
        result = run_trial(self.task, policy, EMULATED, Budget(steps=self.steps), stopper)
        self.measured_s += time.perf_counter() - started
        self.new += 1
        return result

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, allow_nan=True))
        temporary.replace(self.path)


def _brief(result: TrialResult) -> dict[str, Any]:
    brief = {k: v for k, v in result.to_dict().items() if k not in ("telemetry", "losses")}
    brief["loss_scales"] = []
    brief["losses"] = result.losses  # the baseline's curve, for early stopping
    return brief


def on_target(entry: dict[str, Any]) -> bool:
    return bool(entry["feasible"]) and entry["fp8_share"] >= FP8_SHARE


def run_strategy(
    table: Table, sampler: str, seed: int, trials: int, guide: GuidedStrategy | None
) -> int | None:
    """Anchors, then the guide's proposals, then the sampler, as a search runs them; the
    counted trials to the target (None: not reached)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        directions=list(DIRECTIONS), sampler=make_sampler(sampler, seed, trials)
    )
    for name, params in table.space.anchors().items():
        study.enqueue_trial(params, user_attrs={"anchor": name})
    seen = {table.baseline_key}
    history: list[Observation] = []
    counted = duplicates = 0
    while counted < trials and duplicates < MAX_DUPLICATES_IN_A_ROW:
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if guide is not None and not waiting:
            proposal = guide.propose(history)
            if proposal is not None:
                study.enqueue_trial(proposal[0], user_attrs={"guided": proposal[1]})
        trial = study.ask()
        table.space.suggest(trial)
        params = dict(trial.params)
        key = table.key(params)
        if key in seen:
            duplicates += 1
            study.tell(trial, state=TrialState.PRUNED)
            continue
        duplicates = 0
        seen.add(key)
        counted += 1
        entry = table.entry(params)
        result = entry["result"]
        metrics = {m: result[m] for m in ("accuracy", "step_time_ms") if result.get(m) is not None}
        history.append(Observation(params, result["state"], entry["feasible"], metrics))
        if on_target(entry):
            study.tell(trial, state=TrialState.PRUNED)  # done: no need to tell the sampler
            return counted
        if result["state"] == "complete" and result["step_time_ms"] is not None:
            tolerance = table.space.accuracy_tolerance
            trial.set_constraint("accuracy_drop", entry["accuracy_drop"] - tolerance)
            study.tell(
                trial, [result["accuracy"], result["peak_memory_mb"], result["step_time_ms"]]
            )
        else:
            failed = result["state"] != "pruned"
            study.tell(trial, state=TrialState.FAIL if failed else TrialState.PRUNED)
    return None


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile; unreached targets are inf and sort last."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def show(value: float) -> str:
    return "-" if value == float("inf") else f"{value:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trials", type=int, default=24, help="the --trials a user would pass")
    args = parser.parse_args()

    started = time.perf_counter()
    task = deep_sink_mlp()
    model = task.model()
    space = fp8_space().fit(model, device=EMULATED)
    table = Table(args.steps, space, model)
    counts: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    orders, profile_s = [], []
    for seed in range(args.seeds):
        profiled = time.perf_counter()
        profile = profile_task(task, EMULATED, seed=seed)
        profile_s.append(time.perf_counter() - profiled)
        risk = [name for name, _ in space.group_risk(profile, model)]
        fp8_order = fp8_group_order(space, profile, model)
        orders.append(" > ".join(fp8_order))
        shuffled = list(GROUPS)
        random.Random(seed).shuffle(shuffled)
        for strategy in STRATEGIES:
            guide = None
            if strategy != "random":
                order = fp8_order if strategy == "guided" else shuffled
                guide = GuidedStrategy(space, risk, "speed", model, EMULATED, fp8_risk_order=order)
            sampler = "random" if strategy == "random" else "tpe"
            reached = run_strategy(table, sampler, seed, args.trials, guide)
            counts[strategy].append(float("inf") if reached is None else float(reached))
            print(f"  seed {seed} {strategy}: {reached}", flush=True)

    entries = list(table.data["policies"].values())
    baseline = table.baseline
    print(
        f"\nfp8 guided against random, CPU (fp8 emulated), {time.strftime('%Y-%m-%d')}: "
        f"trials to a feasible policy (accuracy drop <= {space.accuracy_tolerance:g} against "
        f"fp32) with >= {FP8_SHARE:.0%} of the Linear weights in fp8; {args.seeds} seeds, "
        f"{args.steps} steps per trial, {len(space.groups) - 1} groups over {{bf16, fp8}}."
    )
    print(
        f"  fp32 baseline accuracy {baseline.accuracy:.4f}; {len(entries)} policies measured "
        f"({table.new} trained in this run, {table.measured_s:.0f} s), "
        f"{sum(e['feasible'] for e in entries)} feasible, {sum(on_target(e) for e in entries)} "
        f"on target; profile {statistics.median(profile_s):.1f} s (median)"
    )
    print(
        "  fp8 risk orders seen: "
        + "; ".join(f"{o} (x{orders.count(o)})" for o in dict.fromkeys(orders))
    )
    header = ("strategy", "median", "quartiles", f"<= {args.trials}", "per seed")
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for strategy in STRATEGIES:
        values = counts[strategy]
        print(
            f"| {strategy} | {show(statistics.median(values))} | "
            f"{show(quantile(values, 0.25))}-{show(quantile(values, 0.75))} | "
            f"{sum(v <= args.trials for v in values)}/{len(values)} | "
            f"{' '.join(show(v) for v in values)} |"
        )
    guided, blind = statistics.median(counts["guided"]), statistics.median(counts["random"])
    print(
        f"\nguided / random (medians): {show(guided)} / {show(blind)} = "
        f"{guided / blind:.2f} (target <= 0.33). '-' = not reached within --trials. "
        f"Ran in {time.perf_counter() - started:.0f} s."
    )


if __name__ == "__main__":
    sys.exit(main())
