"""The guard measured as a classifier on the zoo (issue items 7 and 8).

A guarded run (`guarded_run`) trains a zoo task under a uniform policy for the truth's
length, exactly as `autoprec.tasks.zoo.truth.long_run` trains it (the same
`train_step`, seed, batches and scheduler), but with ``policy.apply(model, guard=...)``
and its batches drawn through ``prec.guarded`` (so that a rollback replays the lost
steps). What it changed is judged against the zoo's truth (`judge`): on a healthy or
boundary task any change is a false alarm; on a fragile task the run is caught when it
ends within `ACCURACY_TOLERANCE` of the truth's fp32 metric, no non-finite step reached
the weights, and every change names a layer of the failing group (or the truth's first
non-finite or flushed layer) on the task's side of the range. `rates` counts both.

`side_by_side_overhead` times a guarded and an unguarded copy of one model in
alternating blocks of steps, and splits the guard's cost into its parts.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec.devices import get_backend
from autoprec.errors import first_line
from autoprec.guard import Guard
from autoprec.guard.changes import PROMOTE, Change
from autoprec.guard.precision import GuardedPrecision
from autoprec.numerics.observe import watch_task
from autoprec.policy import Policy
from autoprec.precision.hooks import Precision
from autoprec.tasks.base import Task
from autoprec.tasks.zoo._entry import Kind, ZooEntry
from autoprec.tasks.zoo.truth import ACCURACY_TOLERANCE, TRUTH_STEPS
from autoprec.trials.training import draw_batch, evaluate, train_step

OVERFLOW, UNDERFLOW, UNKNOWN = "overflow", "underflow", "unknown"


@dataclass(frozen=True)
class GuardedRun:
    """One long run (guarded, or the unguarded baseline): what it trained, how it ended,
    and what the guard changed. ``steps_trained`` counts the steps replayed after a
    rollback too."""

    task: str
    kind: str
    dtype: str
    steps: int
    seed: int
    steps_trained: int = 0
    nonfinite_losses: int = 0
    weights_finite: bool = True
    final_metric: float | None = None
    changes: tuple[Change, ...] = ()
    snapshot_bytes: int = 0
    crashed: str | None = None
    run_time_s: float = 0.0


def guarded_run(
    entry: ZooEntry,
    policy: Policy | str,
    steps: int = TRUTH_STEPS,
    seed: int = 0,
    guard: Guard | bool = True,
    emulate: str | tuple[str, ...] = (),
) -> GuardedRun:
    """Train ``entry``'s task under ``policy`` (a dtype: uniform) with the guard, as the
    truth trains it, checking after every step that the weights are finite.
    ``guard=False``: the same run unguarded, the baseline a guarded run is timed against."""
    chosen = Policy.uniform(policy) if isinstance(policy, str) else policy
    label = policy if isinstance(policy, str) else chosen.name or "policy"
    backend = get_backend("cpu")
    task = entry.task()
    started = time.perf_counter()
    torch.manual_seed(seed)
    trained = nonfinite = 0
    finite_weights = True
    metric: float | None = None
    crashed: str | None = None
    prec: Precision | None = None
    try:
        model = task.model().to(backend.device)
        model.train()
        watch_task(task, model, backend)
        prec = chosen.apply(model, backend, emulate=emulate, guard=guard)
        optimizer = task.make_optimizer(model.parameters())
        scheduler = task.make_scheduler(optimizer)
        source = iter(task.train_data(seed))
        drawn: Iterator[Any] = (
            draw_batch(task, source, step, steps, backend) for step in range(steps)
        )
        if isinstance(prec, GuardedPrecision):
            if scheduler is not None:
                prec.track(scheduler)
            drawn = prec.guarded(drawn)
        for batches in drawn:
            loss, _ = train_step(task, model, optimizer, prec, batches, scheduler)
            trained += 1
            nonfinite += 0 if math.isfinite(loss) else 1
            finite_weights = finite_weights and _finite(model)
        value = evaluate(task, model, prec, backend)
        metric = value if math.isfinite(value) else None
    except Exception as error:  # a crash is a finding of the run
        crashed = f"{type(error).__name__}: {first_line(error, 300)}"
    finally:
        guarded = prec if isinstance(prec, GuardedPrecision) else None
        changes = tuple(guarded.changes) if guarded is not None else ()
        held = guarded.snapshot_bytes if guarded is not None else 0
        if prec is not None:
            prec.remove()
    return GuardedRun(
        entry.name,
        entry.kind.value,
        label,
        steps,
        seed,
        trained,
        nonfinite,
        finite_weights,
        metric,
        changes,
        held,
        crashed,
        round(time.perf_counter() - started, 2),
    )


def _finite(model: nn.Module) -> bool:
    with torch.no_grad():
        checks = [torch.isfinite(p).all() for p in model.parameters() if p.is_floating_point()]
        return bool(torch.stack(checks).all()) if checks else True


# -- judging a run against the truth -----------------------------------------------------


def change_side(change: Change) -> str:
    """The side of the range a change was made for: a promotion's projected crossing or
    margin (the largest value: overflow), an fp8 cast's flush (underflow) or saturation
    (overflow), a rollback's diagnosis (a non-finite forward is
    overflow, a failure at the loss scale's floor underflow)."""
    reason = change.reason
    if change.action == PROMOTE:
        if reason.startswith(("underflow", "a collapsing scale", "its fp8 cast flushes")):
            return UNDERFLOW
        return OVERFLOW
    if "forward overflowed" in reason:
        return OVERFLOW
    if "loss scale's floor" in reason:
        return UNDERFLOW
    return UNKNOWN


def _at_or_below(name: str, group: str) -> bool:
    return name == group or name.startswith(f"{group}.")


def names_failing_layer(change: Change, entry: ZooEntry, truth_run: dict[str, Any]) -> bool:
    """Whether the change's layer, or one of its leaves, is at or below one of the task's
    failing groups, or is the truth's first non-finite or flushed layer."""
    seen = {truth_run.get("first_nonfinite_output_layer"), truth_run.get("first_flush_layer")}
    names = [change.layer, *change.leaves]
    return any(
        name in seen or any(_at_or_below(name, g) for g in entry.failing_groups) for name in names
    )


@dataclass(frozen=True)
class ChangeCheck:
    change: Change
    side: str
    right_layer: bool
    right_side: bool


@dataclass(frozen=True)
class Verdict:
    """A guarded run judged: ``false_alarm`` (healthy or boundary: any change), ``caught``
    (fragile: the run trained as fp32 did, with the right layer named on the right side).
    ``has_truth``: the truth ran the task in this dtype (it has no fp8 runs); a run
    without is shown, not counted in the rates (whether it should fail is not known)."""

    run: GuardedRun
    fp32_metric: float | None
    within_tolerance: bool
    checks: tuple[ChangeCheck, ...]
    has_truth: bool = True
    false_alarm: bool = False
    caught: bool = False
    why_missed: str = ""


def judge(run: GuardedRun, entry: ZooEntry, row: dict[str, Any]) -> Verdict:
    """``run`` against its task's truth row (``load_table()["tasks"][name]``)."""
    fp32 = row["runs"]["fp32"][0].get("final_metric")
    within = (
        run.crashed is None
        and run.final_metric is not None
        and fp32 is not None
        and fp32 - run.final_metric <= ACCURACY_TOLERANCE
    )
    truth_run = (row["runs"].get(run.dtype) or [{}])[0]
    checks = tuple(
        ChangeCheck(
            c,
            change_side(c),
            names_failing_layer(c, entry, truth_run),
            change_side(c) == (entry.side or OVERFLOW),
        )
        for c in run.changes
    )
    has_truth = run.dtype in row["runs"]
    if entry.kind != Kind.FRAGILE:
        return Verdict(run, fp32, within, checks, has_truth, false_alarm=bool(run.changes))
    missed = []
    if run.crashed is not None:
        missed.append(f"crashed: {run.crashed}")
    elif not within:
        missed.append(f"metric {_fmt(run.final_metric)} against fp32's {_fmt(fp32)}")
    if not run.weights_finite:
        missed.append("non-finite weights")
    if not checks:
        missed.append("no change")
    missed += [f"wrong layer {k.change.layer}" for k in checks if not k.right_layer]
    missed += [f"wrong side ({k.side})" for k in checks if not k.right_side]
    return Verdict(
        run, fp32, within, checks, has_truth, caught=not missed, why_missed="; ".join(missed)
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


# -- tables ------------------------------------------------------------------------------


def run_rows(verdicts: list[Verdict]) -> list[str]:
    """The Markdown table of the runs, one a row."""
    rows = [
        "| task | kind | dtype | changes (step action layer -> dtype, side, layer right?) | "
        "non-finite losses | weights finite | metric | fp32 (truth) | verdict | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        r = v.run
        changes = "; ".join(
            f"{k.change.step} {k.change.action} {k.change.layer or '(model)'} -> "
            f"{k.change.to_dtype}, {k.side}, {'right' if k.right_layer else 'WRONG'}"
            for k in v.checks
        )
        if r.kind == Kind.FRAGILE.value:
            verdict = "caught" if v.caught else f"MISS ({v.why_missed})"
        else:
            verdict = "FALSE ALARM" if v.false_alarm else "clear"
            if not v.within_tolerance:
                verdict += f" (metric off: {r.crashed or _fmt(r.final_metric)})"
        if not v.has_truth:
            within = "within" if v.within_tolerance else "NOT within"
            verdict = f"not judged (no {r.dtype} truth); {within} 0.05 of fp32"
        rows.append(
            f"| {r.task} | {r.kind} | {r.dtype} | {changes or '-'} | {r.nonfinite_losses} | "
            f"{'yes' if r.weights_finite else 'NO'} | {_fmt(r.final_metric)} | "
            f"{_fmt(v.fp32_metric)} | {verdict} | {r.run_time_s:.0f} |"
        )
    return rows


def _share(hits: int, total: int) -> str:
    return f"{hits}/{total} ({100 * hits / total:.0f}%)" if total else "-"


def rates(verdicts: list[Verdict]) -> list[str]:
    """False alarms over healthy and boundary runs, recall over fragile runs, by set (the
    runs the truth can judge)."""
    rows = ["| set | runs | false alarms | recall (caught) | misses |", "|---|---|---|---|---|"]
    verdicts = [v for v in verdicts if v.has_truth]
    sets: dict[str, list[Verdict]] = {}
    for v in verdicts:
        r = v.run
        side = f", {_side_of(v)}" if r.kind == Kind.FRAGILE.value else ""
        sets.setdefault(f"{r.kind} {r.dtype}{side}", []).append(v)
    quiet = [v for v in verdicts if v.run.kind != Kind.FRAGILE.value]
    fragile = [v for v in verdicts if v.run.kind == Kind.FRAGILE.value]
    for label, group in [
        *sets.items(),
        ("healthy + boundary, all", quiet),
        ("fragile, all", fragile),
    ]:
        if not group:
            continue
        if group[0].run.kind == Kind.FRAGILE.value:
            missed = [v.run.task for v in group if not v.caught]
            rows.append(
                f"| {label} | {len(group)} | - | {_share(len(group) - len(missed), len(group))} "
                f"| {', '.join(missed) or '-'} |"
            )
        else:
            alarms = [v.run.task for v in group if v.false_alarm]
            rows.append(
                f"| {label} | {len(group)} | {_share(len(alarms), len(group))} | - | "
                f"{', '.join(alarms) or '-'} |"
            )
    return rows


def _side_of(verdict: Verdict) -> str:
    from autoprec.tasks.zoo import ZOO

    return ZOO[verdict.run.task].side or OVERFLOW


# -- overhead, side by side --------------------------------------------------------------


@dataclass
class Overhead:
    """A guarded and an unguarded copy timed in alternating blocks; the guard's extra time
    split into its parts (seconds): the watched steps' hooks, the forecast fit, the
    snapshot copies, and the rest (the per-step bookkeeping every step pays, and noise)."""

    task: str
    dtype: str
    steps: int
    block: int
    settings: Guard
    guarded_s: float = 0.0
    unguarded_s: float = 0.0
    block_ratios: list[float] = field(default_factory=list)
    changes: int = 0
    snapshot_bytes: int = 0
    bookkeeping_s: float = 0.0
    hooks_s: float = 0.0
    forecast_s: float = 0.0
    snapshot_s: float = 0.0

    @property
    def ratio(self) -> float:
        return self.guarded_s / self.unguarded_s

    @property
    def median_block_ratio(self) -> float:
        return statistics.median(self.block_ratios)

    def line(self) -> str:
        parts = (
            ("the rest (per-step bookkeeping, noise)", self.bookkeeping_s),
            ("watched steps' hooks", self.hooks_s),
            ("forecast fit", self.forecast_s),
            ("snapshot copy", self.snapshot_s),
        )
        split = ", ".join(f"{name} {100 * s / self.unguarded_s:+.2f}%" for name, s in parts)
        return (
            f"{self.task} {self.dtype}, check_every {self.settings.check_every}, "
            f"snapshot_every {self.settings.snapshot_every}: {self.steps} steps each, "
            f"blocks of {self.block}: "
            f"guarded {self.guarded_s:.2f} s, unguarded {self.unguarded_s:.2f} s, ratio "
            f"{self.ratio:.3f} (median of block pairs {self.median_block_ratio:.3f}); "
            f"{self.changes} change(s); snapshot {self.snapshot_bytes / 1024:.0f} KiB; "
            f"split: {split}"
        )


class _Copy:
    """One copy of the task's model trained step by step (guarded or not)."""

    def __init__(self, task: Task, dtype: str, guard: Guard | None) -> None:
        backend = get_backend("cpu")
        torch.manual_seed(0)
        self.task, self.backend = task, backend
        self.model = task.model().to(backend.device)
        self.model.train()
        watch_task(task, self.model, backend)
        self.prec = Policy.uniform(dtype).apply(self.model, backend, guard=guard or False)
        self.optimizer = task.make_optimizer(self.model.parameters())
        self.scheduler = task.make_scheduler(self.optimizer)
        if isinstance(self.prec, GuardedPrecision) and self.scheduler is not None:
            self.prec.track(self.scheduler)
        self.source = iter(task.train_data(0))
        self.step_index = 0
        self.step_times: list[float] = []

    def run(self, steps: int, total: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            begun = time.perf_counter()
            batches = draw_batch(self.task, self.source, self.step_index, total, self.backend)
            train_step(self.task, self.model, self.optimizer, self.prec, batches, self.scheduler)
            self.step_times.append(time.perf_counter() - begun)
            self.step_index += 1
        return time.perf_counter() - started


def _timed(spent: dict[int, float], clock: Callable[[], int], call: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begun = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[clock()] = spent.get(clock(), 0.0) + time.perf_counter() - begun

    return wrapper


def side_by_side_overhead(
    entry: ZooEntry, dtype: str, steps: int, block: int = 50, guard: Guard | None = None
) -> Overhead:
    """Time ``steps`` of a guarded and an unguarded copy of ``entry``'s model, in
    alternating blocks of ``block`` steps (the order swapped every pair), and split the
    guarded copy's extra time: the forecast fit (``_check``) and the snapshot (taken,
    each optimizer's part, kept) are timed where they run; the watched steps' hooks are
    those steps' time beyond their two neighbours'; the rest is per-step bookkeeping."""
    from autoprec.guard import snapshot as snapshot_module

    settings = guard or Guard()
    task = entry.task()
    guarded = _Copy(task, dtype, settings)
    plain = _Copy(task, dtype, None)
    prec: Any = guarded.prec
    forecast_at: dict[int, float] = {}
    snapshot_at: dict[int, float] = {}

    def clock() -> int:
        return guarded.step_index

    prec._check = _timed(forecast_at, clock, prec._check)
    prec._begin_snapshot = _timed(snapshot_at, clock, prec._begin_snapshot)
    prec._store.keep = _timed(snapshot_at, clock, prec._store.keep)
    original_add = snapshot_module.Snapshot.add_optimizer
    snapshot_module.Snapshot.add_optimizer = _timed(  # type: ignore[method-assign]
        snapshot_at, clock, original_add
    )
    result = Overhead(entry.name, dtype, steps, block, settings)
    try:
        for pair in range(math.ceil(steps / block)):
            size = min(block, steps - pair * block)
            order = (guarded, plain) if pair % 2 == 0 else (plain, guarded)
            spent = {id(copy): copy.run(size, steps) for copy in order}
            result.guarded_s += spent[id(guarded)]
            result.unguarded_s += spent[id(plain)]
            result.block_ratios.append(spent[id(guarded)] / spent[id(plain)])
    finally:
        snapshot_module.Snapshot.add_optimizer = original_add  # type: ignore[method-assign]
    result.changes = len(prec.changes)
    result.snapshot_bytes = prec.snapshot_bytes
    result.forecast_s = sum(forecast_at.values())
    result.snapshot_s = sum(snapshot_at.values())
    # A watched step's hooks: its time beyond its ordinary neighbours' (forecast and
    # snapshot, timed where they ran, taken out first); the rest of the extra time is the
    # per-step bookkeeping every step pays (and the noise of the two copies' blocks).
    residual = [
        t - forecast_at.get(i, 0.0) - snapshot_at.get(i, 0.0)
        for i, t in enumerate(guarded.step_times)
    ]
    every = settings.check_every
    for i in range(every, len(residual) - 1, every):
        result.hooks_s += residual[i] - (residual[i - 1] + residual[i + 1]) / 2
    extra = result.guarded_s - result.unguarded_s
    result.bookkeeping_s = extra - result.hooks_s - result.forecast_s - result.snapshot_s
    guarded.prec.remove()
    plain.prec.remove()
    return result


# -- the trusted answer's cost -----------------------------------------------------------


@dataclass(frozen=True)
class TrustedCost:
    """A search's answer made trustworthy at the real length two ways: trained once under
    the guard, or checked against one fp32 run of the same length; ``ratio`` is the first's
    total time over the second's."""

    task: str
    search_s: float
    answer: str
    guarded: GuardedRun
    fp32: GuardedRun
    unguarded: GuardedRun  # the answer trained as long without the guard

    @property
    def ratio(self) -> float:
        return (self.search_s + self.guarded.run_time_s) / (self.search_s + self.fp32.run_time_s)

    @property
    def confirmed_ratio(self) -> float:
        """Today's trusted answer (the confirmation trains the answer and fp32 at the real
        length, then the user's run) over the search and one fp32 run."""
        confirmation_s = self.unguarded.run_time_s + self.fp32.run_time_s
        total = self.search_s + confirmation_s + self.unguarded.run_time_s
        return total / (self.search_s + self.fp32.run_time_s)

    def line(self) -> str:
        g, u = self.guarded, self.unguarded
        return (
            f"{self.task}: search {self.search_s:.0f} s, answer {self.answer}; guarded "
            f"real-length run {g.run_time_s:.1f} s ({len(g.changes)} change(s), metric "
            f"{_fmt(g.final_metric)}), unguarded {u.run_time_s:.1f} s, fp32 real-length run "
            f"{self.fp32.run_time_s:.1f} s (metric {_fmt(self.fp32.final_metric)}); "
            f"search + guarded / search + fp32 = {self.ratio:.2f} (confirmed today: "
            f"{self.confirmed_ratio:.2f})"
        )


def trusted_answer_cost(
    entry: ZooEntry, workdir: Any, steps: int = 200, trials: int = 4
) -> TrustedCost:
    """``autoprec.search --guard`` on ``entry`` (``trials`` of ``steps``), then its answer
    trained to the truth's length under the guard, and fp32 trained as long unguarded."""
    from pathlib import Path

    from autoprec.study import search

    folder = Path(workdir)
    started = time.perf_counter()
    result = search(
        entry.task(),
        trials=trials,
        steps=steps,
        guard=True,  # the user's guarded run is the confirmation
        prefer="memory",  # on a CPU fp32 is fastest: by speed the answer is always fp32
        device="cpu",
        study=f"{entry.name}-guard-cost",
        storage=f"sqlite:///{folder}/optuna.db",
        tracking_uri=f"sqlite:///{folder}/mlflow.db",
        runs_dir=folder,
    )
    search_s = time.perf_counter() - started
    answer = result.best_policy
    resolved = answer.resolve(entry.task().model())
    counts = {d: list(resolved.values()).count(d) for d in sorted(set(resolved.values()))}
    described = ", ".join(f"{dtype} x{count}" for dtype, count in counts.items())
    return TrustedCost(
        entry.name,
        round(search_s, 1),
        described,
        guarded_run(entry, answer),
        guarded_run(entry, "fp32", guard=False),
        guarded_run(entry, answer, guard=False),
    )
