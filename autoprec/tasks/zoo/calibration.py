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

from autoprec.policy import LossScale, Policy, Rule
from autoprec.tasks.zoo import ZOO, Kind, ZooEntry
from autoprec.tasks.zoo.truth import earliest_failure, load_table

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
            if any(d in ("fp16", "bf16") for d in v.failing_group_dtypes) or v.name != "fp32"
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdicts": [asdict(v) for v in self.verdicts],
            "random_policy_crashes": self.random_policy_crashes,
            "random_policies_run": self.random_policies_run,
            "search_s": self.search_s,
        }


def _leaves(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and next(m.children(), None) is None]


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
    import autoprec

    study = f"{entry.name}-{steps}"
    autoprec.search(
        entry.task(),
        trials=trials,
        steps=steps,
        device="cpu",
        study=study,
        storage=f"sqlite:///{workdir}/optuna.db",
        tracking_uri=f"sqlite:///{workdir}/mlflow.db",
        runs_dir=workdir,
    )
    summary = json.loads((workdir / study / "summary.json").read_text())
    row = table["tasks"].get(entry.name)
    truth_step = earliest_failure(row, "fp16") if row else None
    horizon = 10 * steps
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
        fails = (
            entry.kind == Kind.FRAGILE
            and any(d in entry.fails_in for d in dtypes)
            and truth_step is not None
            and truth_step <= horizon
        )
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


def random_mixed_policies(entry: ZooEntry, count: int = RANDOM_POLICIES) -> list[Policy]:
    """``count`` policies giving every leaf module fp16 or bf16 at random (seeded by the
    task's name), with the default dynamic loss scaling."""
    model = entry.task().model()
    leaves = _leaves(model)
    chooser = random.Random(entry.name)
    policies = []
    for index in range(count):
        rules = tuple(Rule(chooser.choice(("fp16", "bf16")), (name,)) for name in leaves)
        policies.append(Policy(rules, "fp16", LossScale("dynamic"), name=f"random-mixed-{index}"))
    return policies


def crashes_of_random_policies(entry: ZooEntry, count: int = RANDOM_POLICIES) -> list[str]:
    """The reasons of the random mixed policies whose short trial failed with an error."""
    from autoprec.devices import get_backend
    from autoprec.trials.base import TrialState
    from autoprec.trials.training import Budget, run_trial

    backend = get_backend("cpu")
    task = entry.task()
    crashed = []
    for policy in random_mixed_policies(entry, count):
        result = run_trial(task, policy, backend, Budget(steps=RANDOM_POLICY_STEPS, seed=0))
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
