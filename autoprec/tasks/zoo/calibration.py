"""autoprec's judgements measured against the zoo's ground truth, through the public path.

For each zoo task, `calibrate` runs ``autoprec.search`` (default settings but the trial
count, the given ``--steps``) on fresh stores, reads every trial's verdict from
summary.json (state, reason, ``telemetry.at_risk``, ``telemetry.forecast.crossing_step``)
and compares it with the truth table (`autoprec.tasks.zoo.truth`):

- false alarms: healthy tasks' trials that are at risk or infeasible by the forecast;
- recall: fragile tasks' trials whose failing group runs in a dtype that fails within the
  horizon (the truth's fp16 failure step is at most the forecast horizon), flagged at
  risk or stopped (pruned or failed);
- crossing-step error: for the flagged trials that report a crossing step, the share
  within 2x of the truth's (the earliest failure over the fp16 seeds);
- each of these for the overflow side and the underflow side (the entry's ``side``);
- crashes: boundary tasks' trials that failed with an error, and random mixed
  fp16/bf16 policies of every task (each leaf module's dtype drawn at random) trained a
  few steps by ``run_trial`` that raised.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

import autoprec.formats as formats
from autoprec.policy import LossScale, Policy, Rule
from autoprec.precision.plan import parameterised_leaves
from autoprec.tasks.zoo import ZOO, Kind, ZooEntry
from autoprec.tasks.zoo.truth import earliest_failure, is_reference, load_table

RANDOM_POLICIES = 5
RANDOM_POLICY_STEPS = 12
SEARCH_TRIALS = 4  # the uniform anchors (fp16, bf16, fp16 without scaling) and one more
CRASH_MARKERS = ("Error", "Exception", "error:")


@dataclass
class TrialVerdict:
    """One search trial of one task, as summary.json records it, beside the truth."""

    task: str
    kind: str
    side: str
    steps: int
    number: int
    name: str
    state: str
    reason: str | None
    at_risk: bool
    stopped: bool
    crashed: bool
    failing_group_dtypes: list[str]
    truly_fails: bool
    truth_failure_step: int | None
    predicted_crossing_step: int | None
    predicted_side: str | None

    @property
    def flagged(self) -> bool:
        return self.at_risk or self.stopped


@dataclass
class Rate:
    hits: int = 0
    total: int = 0

    @property
    def value(self) -> float | None:
        return self.hits / self.total if self.total else None

    def __str__(self) -> str:
        value = self.value
        return "-" if value is None else f"{self.hits}/{self.total} ({value:.0%})"


def _autocast_low(dtype: str) -> bool:
    """Whether a region autocasts to ``dtype`` below fp32 (fp16, bf16)."""
    made = formats.get(dtype)
    return made.autocasts and made.low_precision


@dataclass
class Calibration:
    """The verdicts, and the rates computed from them (by side: "overflow",
    "underflow", and "all")."""

    verdicts: list[TrialVerdict] = field(default_factory=list)
    random_policy_crashes: dict[str, list[str]] = field(default_factory=dict)
    random_policies_run: int = 0
    search_s: dict[str, float] = field(default_factory=dict)

    def false_alarms(self, steps: int | None = None) -> Rate:
        chosen = [
            v
            for v in self._of(Kind.HEALTHY, steps)
            if any(_autocast_low(d) for d in v.failing_group_dtypes) or not is_reference(v.name)
        ]
        return Rate(sum(v.at_risk for v in chosen), len(chosen))

    def recall(self, side: str = "all", steps: int | None = None) -> Rate:
        chosen = [v for v in self._fragile(side, steps) if v.truly_fails]
        return Rate(sum(v.flagged for v in chosen), len(chosen))

    def crossing_within_2x(self, side: str = "all", steps: int | None = None) -> Rate:
        chosen = [
            v
            for v in self._fragile(side, steps)
            if v.truly_fails and v.at_risk and v.predicted_crossing_step and v.truth_failure_step
        ]
        within = [
            v
            for v in chosen
            if 0.5 <= v.predicted_crossing_step / v.truth_failure_step <= 2.0  # type: ignore[operator]
        ]
        return Rate(len(within), len(chosen))

    def boundary_crashes(self, steps: int | None = None) -> Rate:
        chosen = self._of(Kind.BOUNDARY, steps)
        return Rate(sum(v.crashed for v in chosen), len(chosen))

    def random_crashes(self) -> Rate:
        crashed = sum(len(v) for v in self.random_policy_crashes.values())
        return Rate(crashed, self.random_policies_run)

    def _of(self, kind: Kind, steps: int | None) -> list[TrialVerdict]:
        return [
            v for v in self.verdicts if v.kind == kind.value and (steps is None or v.steps == steps)
        ]

    def _fragile(self, side: str, steps: int | None) -> list[TrialVerdict]:
        return [v for v in self._of(Kind.FRAGILE, steps) if side in ("all", v.side)]

    def rescore(self, table: dict[str, Any]) -> None:
        """Read each verdict's truth again from ``table`` (a table measured after the
        searches ran)."""
        for verdict in self.verdicts:
            entry = ZOO[verdict.task]
            verdict.truth_failure_step, verdict.truly_fails = _truth(
                entry, verdict.failing_group_dtypes, verdict.steps, table
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        return cls(
            [TrialVerdict(**v) for v in data["verdicts"]],
            data["random_policy_crashes"],
            data["random_policies_run"],
            data["search_s"],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdicts": [asdict(v) for v in self.verdicts],
            "random_policy_crashes": self.random_policy_crashes,
            "random_policies_run": self.random_policies_run,
            "search_s": self.search_s,
        }


def _group_dtypes(entry: ZooEntry, policy: Policy, model: nn.Module) -> list[str]:
    """The dtypes the entry's failing groups resolve to under the policy."""
    import fnmatch

    resolved = policy.resolve(model)
    groups = entry.failing_groups or ("*",)
    return sorted(
        {
            dtype
            for name, dtype in resolved.items()
            if any(
                fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(name, f"{g}.*") for g in groups
            )
        }
    )


def _predicted_side(at_risk: str | None) -> str | None:
    if not at_risk:
        return None
    text = at_risk.lower()
    if any(w in text for w in ("underflow", "smallest", "flush", "subnormal", "scale")):
        return "underflow"
    return "overflow"


def search_verdicts(
    entry: ZooEntry, steps: int, table: dict[str, Any], workdir: Path, trials: int = SEARCH_TRIALS
) -> list[TrialVerdict]:
    """Run ``autoprec.search`` on one zoo task and read its trials' verdicts."""
    from autoprec.study import search

    study = f"{entry.name}-{steps}"
    search(
        entry.task(),
        trials=trials,
        steps=steps,
        device="cpu",
        study=study,
        storage=f"sqlite:///{workdir}/optuna.db",
        tracking_uri=f"sqlite:///{workdir}/mlflow.db",
        runs_dir=workdir,
    )
    return read_verdicts(entry, steps, workdir / study / "summary.json", table)


def read_verdicts(
    entry: ZooEntry, steps: int, summary_path: Path, table: dict[str, Any]
) -> list[TrialVerdict]:
    """The verdicts of one search's trials, read from its summary.json."""
    summary = json.loads(summary_path.read_text())
    model = entry.task().model()
    verdicts = []
    for trial in summary["trials"]:
        policy = Policy.from_dict(trial["policy"]) if trial.get("policy") else Policy()
        dtypes = _group_dtypes(entry, policy, model)
        telemetry = trial.get("telemetry") or {}
        ahead = telemetry.get("forecast") or {}
        at_risk = telemetry.get("at_risk")
        reason = trial.get("reason") or ""
        crashed = trial["state"] == "failed" and any(m in reason for m in CRASH_MARKERS)
        truth_step, fails = _truth(entry, dtypes, steps, table)
        verdicts.append(
            TrialVerdict(
                task=entry.name,
                kind=entry.kind.value,
                side=entry.side,
                steps=steps,
                number=trial["number"],
                name=trial.get("anchor") or policy.name or f"trial {trial['number']}",
                state=trial["state"],
                reason=trial.get("reason"),
                at_risk=bool(at_risk) or (trial.get("feasible") is False and "forecast" in reason),
                stopped=trial["state"] in ("pruned", "failed"),
                crashed=crashed,
                failing_group_dtypes=dtypes,
                truly_fails=fails,
                truth_failure_step=truth_step,
                predicted_crossing_step=ahead.get("crossing_step"),
                predicted_side=_predicted_side(at_risk),
            )
        )
    return verdicts


def _truth(
    entry: ZooEntry, group_dtypes: list[str], steps: int, table: dict[str, Any]
) -> tuple[int | None, bool]:
    """The truth's earliest fp16 failure step for the entry, and whether a trial whose
    failing groups run in ``group_dtypes`` really fails within the horizon (10x
    ``steps``)."""
    row = table["tasks"].get(entry.name)
    step = earliest_failure(row, "fp16") if row else None
    fails = (
        entry.kind == Kind.FRAGILE
        and any(d in entry.fails_in for d in group_dtypes)
        and step is not None
        and step <= 10 * steps
    )
    return step, fails


def random_mixed_policies(entry: ZooEntry, count: int = RANDOM_POLICIES) -> list[Policy]:
    """``count`` policies giving every leaf module fp16 or bf16 at random (seeded by the
    task's name), with the default dynamic loss scaling."""
    model = entry.task().model()
    leaves = [name for name, _ in parameterised_leaves(model)]
    chooser = random.Random(entry.name)
    policies = []
    for index in range(count):
        rules = tuple(Rule(chooser.choice(("fp16", "bf16")), (name,)) for name in leaves)
        policies.append(Policy(rules, "fp16", LossScale("dynamic"), name=f"random-mixed-{index}"))
    return policies


def crashes_of_random_policies(entry: ZooEntry, count: int = RANDOM_POLICIES) -> list[str]:
    """The reasons of the random mixed policies whose short trial failed with an error.
    A policy refused before training (a layer in a dtype the device was seen not to run
    it in: `autoprec.policy`'s refusal, with the kernel's reason) is not a crash."""
    from autoprec.devices import get_backend
    from autoprec.errors import PolicyError
    from autoprec.trials.base import TrialState
    from autoprec.trials.training import Budget, run_trial

    backend = get_backend("cpu")
    task = entry.task()
    crashed = []
    for policy in random_mixed_policies(entry, count):
        try:
            result = run_trial(task, policy, backend, Budget(steps=RANDOM_POLICY_STEPS, seed=0))
        except PolicyError:
            continue  # refused before anything ran
        if result.state == TrialState.FAILED:
            crashed.append(f"{policy.name}: {result.reason}")
    return crashed


def calibrate(
    names: list[str] | None = None,
    steps: tuple[int, ...] = (100, 200),
    table: dict[str, Any] | None = None,
    trials: int = SEARCH_TRIALS,
    random_policies: int = RANDOM_POLICIES,
    workdir: Path | None = None,
) -> Calibration:
    """Search each named zoo task (all by default) at each trial length and compare the
    verdicts with the truth table; train ``random_policies`` random mixed policies of
    each for a few steps and count the crashes."""
    table = table if table is not None else load_table()
    result = Calibration()
    with tempfile.TemporaryDirectory(prefix="zoo-calibration-") as scratch:
        root = Path(workdir or scratch)
        for name in names or list(ZOO):
            entry = ZOO[name]
            for length in steps:
                started = time.perf_counter()
                folder = root / f"{name}-{length}"
                folder.mkdir(parents=True, exist_ok=True)
                result.verdicts += search_verdicts(entry, length, table, folder, trials)
                result.search_s[f"{name}@{length}"] = round(time.perf_counter() - started, 1)
            if random_policies:
                result.random_policy_crashes[name] = crashes_of_random_policies(
                    entry, random_policies
                )
                result.random_policies_run += random_policies
    return result


# -- the printed table ----------------------------------------------------------------------


def _step(value: int | None) -> str:
    return "-" if value is None else str(value)


def _metric(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def truth_rows(table: dict[str, Any], names: list[str]) -> list[str]:
    """The truth table as markdown rows: failure steps (per seed) and the metric at 10x
    the trial against fp32's, per policy, and how many of fp32's runs from weights moved
    one ulp collapsed against its own (any: the task is chaotic, its metric collapses are
    not failures)."""
    lines = [
        "| task | kind | mechanism | fp16 failure (seeds) | first event | bf16 failure | "
        "group-fp32 failure | fp32 | fp16 | bf16 | group-fp32 | fp32 moved one ulp: "
        "collapsed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        row = table["tasks"].get(name)
        if row is None:
            lines.append(
                f"| {name} | {ZOO[name].kind.value} | {ZOO[name].mechanism} | "
                "not measured | | | | | | | | |"
            )
            continue
        nudged = row.get("fp32_nudged")
        chaos = (
            "not measured"
            if nudged is None
            else f"{sum(r['metric_collapse_step'] is not None for r in nudged)}/{len(nudged)}"
        )
        runs = row["runs"]

        def first(label: str | None, runs: dict[str, Any] = runs) -> dict[str, Any]:
            return (runs.get(label) or [{}])[0] if label else {}

        fp16 = runs.get("fp16", [])
        steps = ", ".join(_step(r["failure_step"]) for r in fp16)
        event = _event(fp16[0]) if fp16 else "-"
        keep = next((k for k in runs if k.startswith("fp16+group")), None)
        lines.append(
            f"| {name} | {row['kind']} | {row['mechanism']} | {steps} | {event} | "
            f"{_step(first('bf16').get('failure_step'))} | "
            f"{_step(first(keep).get('failure_step')) if keep else 'n/a'} | "
            f"{_metric(first('fp32').get('final_metric'))} | "
            f"{_metric(first('fp16').get('final_metric'))} | "
            f"{_metric(first('bf16').get('final_metric'))} | "
            f"{_metric(first(keep).get('final_metric')) if keep else 'n/a'} | {chaos} |"
        )
    return lines


def _event(run: dict[str, Any]) -> str:
    """What the run saw first: the event at its failure step, and where."""
    if run.get("crashed"):
        return f"crash ({run['crashed'][:60]})"
    step = run.get("failure_step")
    if step is None:
        return "none"
    if run.get("first_nonfinite_output_step") == step:
        return f"non-finite output: {run['first_nonfinite_output_layer']}"
    if run.get("first_nonfinite_loss_step") == step:
        return "non-finite loss"
    if run.get("first_flush_step") == step:
        return f"{run['first_flush_kind']} flushed to zero: {run['first_flush_layer']}"
    if run.get("scale_collapse_step") == step:
        return "loss scale below 1"
    return "metric collapsed"


def boundary_rows(table: dict[str, Any], names: list[str]) -> list[str]:
    lines = ["| task | mixed policy | crashed |", "|---|---|---|"]
    for name in names:
        row = table["tasks"].get(name)
        if row is None or row["kind"] != Kind.BOUNDARY.value:
            continue
        for label, runs in row["runs"].items():
            if "boundary" in label:
                lines.append(f"| {name} | {label} | {runs[0].get('crashed') or 'no'} |")
    return lines


def calibration_rows(result: Calibration, steps: tuple[int, ...]) -> list[str]:
    lines = [
        "| --steps | false alarms (healthy) | recall (all) | recall (overflow) | "
        "recall (underflow) | crossing within 2x (all) | overflow | underflow | "
        "boundary crashes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for length in steps:
        lines.append(
            f"| {length} | {result.false_alarms(length)} | {result.recall('all', length)} | "
            f"{result.recall('overflow', length)} | {result.recall('underflow', length)} | "
            f"{result.crossing_within_2x('all', length)} | "
            f"{result.crossing_within_2x('overflow', length)} | "
            f"{result.crossing_within_2x('underflow', length)} | "
            f"{result.boundary_crashes(length)} |"
        )
    return lines


def report_lines(result: Calibration, steps: tuple[int, ...]) -> list[str]:
    """The calibration table, the random policies' crashes, and every flagged, missed or
    falsely alarmed trial."""
    lines = calibration_rows(result, steps)
    lines.append(f"\nrandom mixed fp16/bf16 policies crashed: {result.random_crashes()}")
    for name, reasons in result.random_policy_crashes.items():
        lines += [f"  {name}: {reason[:160]}" for reason in reasons]
    lines.append("\nfragile trials that fail within the horizon, and healthy trials at risk:")
    for v in result.verdicts:
        if (v.kind == "healthy" and v.at_risk) or (v.kind == "fragile" and v.truly_fails):
            mark = "flagged" if v.flagged else "MISSED"
            if v.kind == "healthy":
                mark = "FALSE ALARM"
            lines.append(
                f"  {v.task} --steps {v.steps} {v.name}: {mark}; "
                f"truth {_step(v.truth_failure_step)}, "
                f"predicted {_step(v.predicted_crossing_step)}; {(v.reason or '')[:140]}"
            )
    return lines


def rescore_files(paths: list[Path], steps: list[int], table_file: Path) -> int:
    """Print the calibration of verdicts saved by earlier runs against the table now."""
    result = Calibration()
    for path in paths:
        part = Calibration.from_dict(json.loads(path.read_text()))
        result.verdicts += part.verdicts
        result.random_policy_crashes.update(part.random_policy_crashes)
        result.random_policies_run += part.random_policies_run
        result.search_s.update(part.search_s)
    result.rescore(load_table(table_file))
    print("\n".join(report_lines(result, tuple(steps))))
    tasks = sorted({v.task for v in result.verdicts})
    print(
        f"\n{len(tasks)} tasks: {', '.join(tasks)}; searches {sum(result.search_s.values()):.0f} s"
    )
    return 0


def main_table(
    names: list[str], steps: list[int], path: Path, search: bool = True, out: Path | None = None
) -> int:
    """Print the truth table and, with ``search``, the calibration of every named task."""
    table = load_table(path)
    print("\n".join(truth_rows(table, names)))
    print()
    print("\n".join(boundary_rows(table, names)))
    if not search:
        return 0
    started = time.perf_counter()
    result = calibrate(names, tuple(steps), table)
    print()
    print("\n".join(report_lines(result, tuple(steps))))
    print(f"\ncalibration: {time.perf_counter() - started:.0f} s")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        print(f"verdicts written to {out}")
    return 0
