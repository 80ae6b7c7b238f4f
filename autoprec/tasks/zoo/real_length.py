"""Whether the search's answer holds at the real length on every zoo task (issue 27).

For each zoo task, `search_at_real_length` runs ``autoprec.search`` as a user with a long
run would: short trials (``--steps``), the forecast to the run's length (``--train-steps``)
and the long confirmation at that length (``--confirm-steps``), on fresh stores, with
``--prefer memory`` (on a CPU fp32 is the fastest, so by speed the answer would always be
fp32 and nothing low-precision would be tested). From its
summary.json it reads what the search answered and checks it three ways:

- **held**: the answer is a policy the confirmation trained to the real length within the
  tolerance of fp32 trained as long (or fp32 itself, when no candidate held);
- **truth**: where the answer is one of the policies the zoo's truth table measured
  (uniform fp16, uniform bf16, fp16 with the failing group in fp32), whether that long run
  holds too (an independent run of the same policy, seed 0);
- **reasons**: every candidate the confirmation rejected names a layer and a mechanism;
  on a fragile task, whether the layer is in the task's failing group (or is where the
  truth's long run first showed its failure) and the mechanism is on the task's side
  (overflow: a non-finite output; underflow: a flush to zero or a collapsing scale).

Real runs only: nothing here is simulated; a task takes from under a minute to a few
minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import autoprec.formats as formats
from autoprec.policy import Policy
from autoprec.precision.plan import parameterised_leaves
from autoprec.tasks.zoo import ZOO, Kind, ZooEntry
from autoprec.tasks.zoo.forecast_rates import OVERFLOW, UNDERFLOW
from autoprec.tasks.zoo.truth import is_reference

ACCURACY_DROP = 0.01  # the search's default tolerance for a training task
REAL_STEPS_MULTIPLE = 10  # the real run: 10x the trial, as the truth table's runs
SEARCH_TRIALS = 4  # the uniform anchors (fp16, bf16, fp16 without scaling) and one more
UNDERFLOW_MECHANISMS = ("flush", "scale", "underflow")


@dataclass(frozen=True)
class Rejected:
    """A candidate the confirmation rejected, with what it named."""

    label: str
    mechanism: str | None
    layer: str | None
    first_step: int | None
    right_layer: bool | None  # None: no truth to compare (a healthy task)
    right_mechanism: bool | None


@dataclass
class RealLengthVerdict:
    """One task's search at the real length."""

    task: str
    kind: str
    steps: int
    real_steps: int
    answer: str  # the policy the search answered with
    confirmed: bool  # the answer held at the real length (fp32: trivially)
    fell_back_to_fp32: bool
    truth_holds: bool | None  # the truth table's long run of the answer (None: not measured)
    rejected: list[Rejected] = field(default_factory=list)
    search_s: float = 0.0
    note: str | None = None

    @property
    def holds(self) -> bool:
        return self.confirmed and self.truth_holds is not False


ANCHORS = {"uniform-fp16": "fp16", "uniform-bf16": "bf16"}


def _truth_label(
    policy_data: dict[str, Any], entry: ZooEntry, anchor: str | None = None
) -> str | None:
    """The truth table's label of a policy, where it measured one that computes alike:
    the uniform anchors, every leaf with parameters in bf16 (``bf16``) or in fp16 under
    dynamic scaling (``fp16``), or the latter with exactly the failing groups in fp32."""
    import fnmatch

    if anchor in ANCHORS:
        return ANCHORS[anchor]
    policy = Policy.from_dict(policy_data)
    model = entry.task().model()
    resolved = policy.resolve(model)
    leaves = {n: resolved.get(n) for n, _ in parameterised_leaves(model)}
    scaled = policy.loss_scale.mode == "dynamic"
    dtypes = set(leaves.values())
    if not all(formats.known(d) for d in dtypes):
        return None
    only = formats.get(str(dtypes.pop())) if len(dtypes) == 1 else None
    if only is not None and only.autocasts and (scaled or not only.scales_loss):
        return only.name  # fp32, bf16, or fp16 under dynamic scaling
    groups = entry.failing_groups
    in_group = {
        n
        for n in leaves
        if any(fnmatch.fnmatchcase(n, g) or fnmatch.fnmatchcase(n, f"{g}.*") for g in groups)
    }
    made = {name: formats.get(str(dtype)) for name, dtype in leaves.items()}
    split = all(  # fp32 in the group, fp16 elsewhere
        f.reference == (name in in_group) and (f.reference or f.scales_loss)
        for name, f in made.items()
    )
    return "fp16+group-fp32" if groups and scaled and in_group and split else None


def _truth_holds(label: str | None, row: dict[str, Any] | None, real_steps: int) -> bool | None:
    if label is None or row is None:
        return None
    if is_reference(label):
        return True
    runs = (row.get("runs") or {}).get(label) or []
    if not runs:
        return None
    step = runs[0].get("failure_step")
    return step is None or step > real_steps


def _rejected(check: dict[str, Any], entry: ZooEntry, row: dict[str, Any] | None) -> Rejected:
    mechanism, layer = check.get("mechanism"), check.get("layer")
    right_layer = right_mechanism = None
    # A candidate rejected with no range event (an accuracy drop past the tolerance: bf16's
    # precision) names no layer: there is none to judge.
    if entry.kind == Kind.FRAGILE and row is not None and mechanism is not None:
        groups = set(entry.failing_groups)
        runs = (row.get("runs") or {}).get("fp16") or []
        truth = runs[0] if runs else {}
        seen = {truth.get("first_flush_layer"), truth.get("first_nonfinite_output_layer")}
        right_layer = layer is not None and (
            any(layer == g or layer.startswith(f"{g}.") for g in groups) or layer in seen
        )
        side = entry.side  # the task's mechanism (its truth's earliest event may be a
        # consequence: an overflowing head's scale backs off and its gradients flush first)
        named = (
            UNDERFLOW
            if mechanism and any(m in mechanism for m in UNDERFLOW_MECHANISMS)
            else OVERFLOW
        )
        right_mechanism = side is None or (mechanism is not None and named == side)
    return Rejected(
        check.get("label") or str(check.get("key")),
        mechanism,
        layer,
        check.get("first_step"),
        right_layer,
        right_mechanism,
    )


def read_verdict(
    entry: ZooEntry, steps: int, real_steps: int, summary_path: Path, table: dict[str, Any]
) -> RealLengthVerdict:
    """One search's answer at the real length, read from its summary.json."""
    summary = json.loads(summary_path.read_text())
    row = table["tasks"].get(entry.name)
    best = summary.get("best") or {}
    policy = best.get("policy") or {}
    answer = best.get("anchor") or policy.get("name") or f"trial {best.get('number')}"
    confirmation = summary.get("confirmation") or {}
    held = confirmation.get("held")
    checks = confirmation.get("checks") or []
    chosen_fp32 = str(confirmation.get("chosen_before", best.get("trial"))) == "baseline"
    fell_back = held is None or (held == "baseline" and not chosen_fp32)
    verdict = RealLengthVerdict(
        task=entry.name,
        kind=entry.kind.value,
        steps=steps,
        real_steps=real_steps,
        answer="fp32" if fell_back or chosen_fp32 else answer,
        confirmed=held is not None,
        fell_back_to_fp32=fell_back,
        truth_holds=_truth_holds(
            "fp32" if fell_back or chosen_fp32 else _truth_label(policy, entry, best.get("anchor")),
            row,
            real_steps,
        ),
        rejected=[_rejected(c, entry, row) for c in checks if not c.get("held")],
        note=confirmation.get("reason"),
    )
    return verdict


def search_at_real_length(
    entry: ZooEntry,
    steps: int,
    table: dict[str, Any],
    workdir: Path,
    trials: int = SEARCH_TRIALS,
) -> RealLengthVerdict:
    """``autoprec.search`` on one zoo task with --train-steps and --confirm-steps at the
    real length (``REAL_STEPS_MULTIPLE`` times ``steps``), and its answer read back."""
    from autoprec.study import search

    real = REAL_STEPS_MULTIPLE * steps
    study = f"{entry.name}-{steps}-real"
    started = time.perf_counter()
    search(
        entry.task(),
        trials=trials,
        steps=steps,
        train_steps=real,
        confirm_steps=real,
        prefer="memory",  # on a CPU fp32 is fastest: by speed the answer is always fp32
        device="cpu",
        study=study,
        storage=f"sqlite:///{workdir}/optuna.db",
        tracking_uri=f"sqlite:///{workdir}/mlflow.db",
        runs_dir=workdir,
    )
    verdict = read_verdict(entry, steps, real, workdir / study / "summary.json", table)
    verdict.search_s = round(time.perf_counter() - started, 1)
    return verdict


def confirmation_reason(entry: ZooEntry, real_steps: int, table: dict[str, Any]) -> Rejected | None:
    """What the confirmation would name for a fragile task's uniform fp16 at the real
    length: fp32 and fp16 trained ``real_steps`` as `autoprec.study.confirm` trains them
    (the same `run_trial`, the same early stopping judged by accuracy), and the first
    event its telemetry saw (`autoprec.study.confirm.first_seen`), judged against the
    truth; None where fp16 held."""
    from dataclasses import replace

    from autoprec.devices import get_backend
    from autoprec.study.confirm import first_seen
    from autoprec.trials.base import TrialState
    from autoprec.trials.training import Budget, EarlyStopping, run_trial

    task, backend = entry.task(), get_backend("cpu")
    budget = Budget(steps=real_steps)
    fp32 = run_trial(task, Policy.uniform("fp32"), backend, budget)
    stopping = replace(EarlyStopping.from_baseline(fp32), reference_losses=())
    result = run_trial(task, Policy.uniform("fp16"), backend, budget, stopping)
    # The confirmation's own verdict: it ended, has no more non-finite losses than fp32,
    # and its accuracy is within the tolerance of fp32's.
    failed = (
        result.state != TrialState.COMPLETE
        or result.accuracy is None
        or result.nonfinite_steps > fp32.nonfinite_steps
        or (fp32.accuracy is not None and fp32.accuracy - result.accuracy > ACCURACY_DROP)
    )
    if not failed:
        return None
    first = first_seen(result, fp32)
    check = {
        "label": "uniform-fp16",
        "mechanism": None if first is None else first.mechanism,
        "layer": None if first is None else first.layer,
        "first_step": None if first is None else first.step,
    }
    return _rejected(check, entry, table["tasks"].get(entry.name))


def verdict_rows(verdicts: list[RealLengthVerdict]) -> list[str]:
    """The Markdown table of the answers, one task a row."""
    rows = [
        "| task | kind | answer | held at the real length | truth's long run | "
        "rejected (layer, mechanism, right?) | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        truth = {None: "-", True: "holds", False: "FAILS"}[v.truth_holds]
        rejected = "; ".join(
            f"{r.label.split(' [')[0]}: "
            + (
                f"{r.layer or 'the loss scale'}, {r.mechanism} "
                f"({_yes(r.right_layer)} layer, {_yes(r.right_mechanism)} mechanism)"
                if r.mechanism
                else "accuracy, no range event"
            )
            for r in v.rejected
        )
        held = "yes" if v.confirmed else f"no ({v.note or 'nothing confirmed'})"
        answer = f"{v.answer} (fp32 fallback)" if v.fell_back_to_fp32 else v.answer
        rows.append(
            f"| {v.task} | {v.kind} | {answer} | {held} | {truth} | {rejected or '-'} | "
            f"{v.search_s:.0f} |"
        )
    return rows


def _yes(value: bool | None) -> str:
    return {None: "?", True: "right", False: "WRONG"}[value]


def summary_line(verdicts: list[RealLengthVerdict]) -> str:
    """The acceptance figures: answers that hold, and rejected candidates whose reasons
    name the right layer and mechanism (where the truth can tell)."""
    holding = sum(v.holds for v in verdicts)
    judged = [r for v in verdicts for r in v.rejected if r.right_layer is not None]
    layers = sum(bool(r.right_layer) for r in judged)
    mechanisms = sum(bool(r.right_mechanism) for r in judged)
    return (
        f"answers that hold at the real length: {holding}/{len(verdicts)}; rejected "
        f"candidates of fragile tasks naming the right layer: {layers}/{len(judged)}, the "
        f"right mechanism: {mechanisms}/{len(judged)}"
    )


def names_or_all(only: str | None) -> list[str]:
    names = [n.strip() for n in (only or "").split(",") if n.strip()] or list(ZOO)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise SystemExit(f"--only: unknown zoo task(s) {', '.join(unknown)}")
    return names
