"""Ground truth for the zoo: long real runs of a task under a policy, and what they saw.

A run trains the task exactly as a trial does (`autoprec.trials.training`'s own step:
``policy.apply(model)``, ``prec.autocast()``, ``prec.backward``, ``prec.step``, the task's
scheduler and clipping), for ``TRUTH_STEPS`` (10x a 200-step trial), and records:

- the first step whose loss is not finite;
- the first step a leaf module's output holds a non-finite value, and which module (every
  ``OBSERVE_EVERY`` steps, by forward hooks);
- the first step a leaf module's output, or its parameters' gradients, flushed to zero: a
  share of exact zeros at least ``FLUSH_EXCESS`` above the fp32 run's at the same step;
- the first step the dynamic loss scale fell below 1 while skipping (a collapsing scale);
- the first evaluation (every ``EVAL_EVERY`` steps) whose metric trails fp32's at the
  same step by more than ``COLLAPSE_DROP``;
- the metric at the end, against fp32's.

The earliest of those events but the flush is the run's ``failure_step``, with one
exception. The fp32 run is trained again ``len(NUDGES)`` times from initial weights moved
by one ulp (`nudge_weights`). If one of those runs collapses by the same rule against the
unmoved run, the task's training is chaotic: a difference of one rounding is enough to
change its metric by that much. On such a task the metric cannot tell precision from
chance, so a run's metric collapse is still recorded but is not its failure (the range
events still are).

Nothing here is simulated: every figure comes from the training that it describes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.structures import tensors
from autoprec.devices import get_backend
from autoprec.errors import first_line
from autoprec.numerics.observe import watch_task
from autoprec.policy import Policy
from autoprec.tasks.base import Task
from autoprec.trials.training import draw_batch, evaluate, train_step

TRIAL_STEPS = 200  # the default trial the zoo's windows are measured in
TRUTH_STEPS = 10 * TRIAL_STEPS  # the horizon: 10x the trial
OBSERVE_EVERY = 10  # steps between forward hooks' looks at every leaf module
EVAL_EVERY = 100  # steps between evaluations of the metric
FLUSH_EXCESS = 0.5  # zero share above fp32's that counts as flushed to zero
COLLAPSE_DROP = 0.1  # metric below fp32's at the same step that counts as collapsed
ACCURACY_TOLERANCE = 0.05  # the final metric within this of fp32's trains "as fp32 does"
STOP_AFTER_FAILED_STEPS = 50  # consecutive non-finite or floor-skipped steps end a run
# The fp32 runs trained again from weights moved one ulp, one per generator seed: where
# one collapses against the unmoved run, a metric collapse is chance (the module docstring).
# Measured 2026-12-07 on the whole zoo: only zoo-attention-logit-growth is chaotic (2 of
# its 3 such runs collapse, at 1900 and 2000, ending at 0.871 and 0.793 against 0.998).
NUDGES = (1, 2, 3)


@dataclass
class RunTruth:
    """What one long run saw (steps are 0-based optimizer steps; None: never)."""

    policy: str
    seed: int
    steps: int
    steps_run: int = 0
    first_nonfinite_loss_step: int | None = None
    first_nonfinite_output_step: int | None = None
    first_nonfinite_output_layer: str | None = None
    first_flush_step: int | None = None
    first_flush_layer: str | None = None
    first_flush_kind: str | None = None  # "output" or "gradient"
    scale_collapse_step: int | None = None
    metric_collapse_step: int | None = None
    final_metric: float | None = None
    fp32_final_metric: float | None = None
    skipped_steps: int = 0
    final_loss_scale: float | None = None
    crashed: str | None = None
    run_time_s: float = 0.0
    metric_curve: dict[str, float | None] = field(default_factory=dict)  # step -> metric
    largest_output: dict[str, float] = field(
        default_factory=dict
    )  # layer -> largest finite |output|
    # fp32 itself, moved one ulp, collapses against its own run: a metric collapse here is
    # chance, not this run's failure (set from the row's ``fp32_nudged`` runs)
    fp32_chaotic: bool = False

    @property
    def failure_step(self) -> int | None:
        """The earliest failure: a non-finite loss or output, a collapsing loss scale or
        a collapsed metric (unless fp32 is chaotic on the task); a crash counts from step 0.
        A flush to zero is where the failure shows, not one by itself (a saturated loss's
        gradients flush in any low-precision dtype and training goes on)."""
        if self.crashed is not None:
            return 0
        events = [
            self.first_nonfinite_loss_step,
            self.first_nonfinite_output_step,
            self.scale_collapse_step,
            None if self.fp32_chaotic else self.metric_collapse_step,
        ]
        present = [e for e in events if e is not None]
        return min(present) if present else None

    @property
    def metric_drop(self) -> float | None:
        if self.final_metric is None or self.fp32_final_metric is None:
            return None
        return self.fp32_final_metric - self.final_metric

    @property
    def trains_as_fp32(self) -> bool:
        drop = self.metric_drop
        return self.failure_step is None and drop is not None and drop <= ACCURACY_TOLERANCE

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["failure_step"] = self.failure_step
        data["metric_drop"] = self.metric_drop
        data["trains_as_fp32"] = self.trains_as_fp32
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunTruth:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Reference:
    """The fp32 run's zero shares (per layer, per observed step) and metric curve, that
    other runs' flushes and collapses are judged against."""

    output_zero_share: dict[str, dict[int, float]] = field(default_factory=dict)
    grad_zero_share: dict[str, dict[int, float]] = field(default_factory=dict)
    metric_curve: dict[int, float] = field(default_factory=dict)
    final_metric: float | None = None
    output_amax: dict[str, dict[int, float]] = field(default_factory=dict)
    chaotic: bool = False  # a run of fp32 moved one ulp collapsed against this one


def nudge_weights(model: nn.Module, seed: int) -> None:
    """Move a random half of the elements of every floating parameter by one ulp of its
    dtype, up or down at random (``torch.nextafter``; drawn from a generator of its own
    seeded with ``seed``): the smallest change to the initial weights, one rounding."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.is_floating_point():
                continue
            shape = parameter.shape
            chosen = torch.rand(shape, generator=generator) < 0.5
            up = torch.rand(shape, generator=generator) < 0.5
            infinity = torch.full(shape, math.inf, dtype=parameter.dtype)
            target = torch.where(up, infinity, -infinity).to(parameter.device)
            moved = torch.nextafter(parameter, target)
            parameter.copy_(torch.where(chosen.to(parameter.device), moved, parameter))


class _Watch:
    """Forward hooks on every leaf module for one observed step: non-finite outputs and the
    share of exact zeros in each output."""

    def __init__(self, model: nn.Module) -> None:
        self.leaves = [
            (name, module)
            for name, module in model.named_modules()
            if name and next(module.children(), None) is None
        ]
        self.nonfinite: list[str] = []
        self.zero_share: dict[str, float] = {}
        self.amax: dict[str, float] = {}

    def __enter__(self) -> _Watch:
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.leaves]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            floats = [t for t in tensors(output) if t.is_floating_point() and t.numel()]
            if not floats:
                return
            with torch.no_grad():
                bad = any(not bool(torch.isfinite(t).all()) for t in floats)
                if bad and name not in self.nonfinite:
                    self.nonfinite.append(name)
                finite = [t[torch.isfinite(t)] for t in floats]
                self.amax[name] = max(
                    (float(t.abs().max()) for t in finite if t.numel()), default=0.0
                )
                zeros = sum(int((t == 0).sum()) for t in floats)
                self.zero_share[name] = zeros / sum(t.numel() for t in floats)

        return hook


def _grad_zero_share(model: nn.Module) -> dict[str, float]:
    """Per leaf module, the share of exact zeros in its parameters' gradients."""
    shares = {}
    for name, module in model.named_modules():
        grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
        if name and grads:
            shares[name] = sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads)
    return shares


def _first_flush(
    shares: dict[str, float], reference: dict[str, dict[int, float]], step: int
) -> str | None:
    for name, share in shares.items():
        ref = reference.get(name, {}).get(step)
        if ref is not None and share - ref >= FLUSH_EXCESS:
            return name
    return None


def long_run(
    task: Task,
    policy: Policy,
    seed: int = 0,
    steps: int = TRUTH_STEPS,
    reference: Reference | None = None,
    nudge: int | None = None,
) -> tuple[RunTruth, Reference]:
    """Train ``task`` under ``policy`` for ``steps`` on the CPU as a trial does, watching
    every leaf; with ``reference`` (the fp32 run's), flushes and collapses are judged
    against it; with ``nudge``, from initial weights moved one ulp (`nudge_weights`).
    Returns the run's truth and its own record (a reference when fp32)."""
    backend = get_backend("cpu")
    truth = RunTruth(policy.name or "policy", seed, steps)
    truth.fp32_chaotic = reference is not None and reference.chaotic
    record = Reference()
    started = time.perf_counter()
    torch.manual_seed(seed)
    model: nn.Module | None = None
    prec = None
    try:
        model = task.model().to(backend.device)
        if nudge is not None:
            nudge_weights(model, nudge)
        model.train()
        watch_task(task, model, backend)  # as a trial does: autocast's treatment, watched
        prec = policy.apply(model, backend)
        optimizer = task.make_optimizer(model.parameters())
        scheduler = task.make_scheduler(optimizer)
        batches: Iterator[Any] = iter(task.train_data(seed))
        failed_in_a_row = 0
        for step in range(steps):
            observed = step % OBSERVE_EVERY == 0
            watch = _Watch(model)
            if observed:
                with watch:
                    loss, stepped = train_step(
                        task,
                        model,
                        optimizer,
                        prec,
                        draw_batch(task, batches, step, steps, backend),
                        scheduler,
                    )
            else:
                loss, stepped = train_step(
                    task,
                    model,
                    optimizer,
                    prec,
                    draw_batch(task, batches, step, steps, backend),
                    scheduler,
                )
            truth.steps_run = step + 1
            finite = math.isfinite(loss)
            if not finite and truth.first_nonfinite_loss_step is None:
                truth.first_nonfinite_loss_step = step
            truth.skipped_steps += 0 if stepped else 1
            if not stepped and prec.loss_scale < 1 and truth.scale_collapse_step is None:
                truth.scale_collapse_step = step
            if observed:
                _note_watch(truth, record, reference, watch, model, step, stepped)
            if (step + 1) % EVAL_EVERY == 0:
                _note_metric(truth, record, reference, task, model, prec, backend, step + 1)
            failed_in_a_row = 0 if finite and stepped else failed_in_a_row + 1
            if stepped is None or failed_in_a_row >= STOP_AFTER_FAILED_STEPS:
                break
        truth.final_loss_scale = float(prec.loss_scale)
        truth.final_metric = _metric(task, model, prec, backend)
        record.final_metric = truth.final_metric
    except Exception as error:  # a crash is a finding of the run
        truth.crashed = f"{type(error).__name__}: {first_line(error, 300)}"
    finally:
        if prec is not None:
            prec.remove()
    if reference is not None:
        truth.fp32_final_metric = reference.final_metric
    truth.run_time_s = round(time.perf_counter() - started, 2)
    return truth, record


def _note_watch(
    truth: RunTruth,
    record: Reference,
    reference: Reference | None,
    watch: _Watch,
    model: nn.Module,
    step: int,
    stepped: bool | None,
) -> None:
    if watch.nonfinite and truth.first_nonfinite_output_step is None:
        truth.first_nonfinite_output_step = step
        truth.first_nonfinite_output_layer = watch.nonfinite[0]
    grads = _grad_zero_share(model) if stepped else {}
    for name, share in watch.zero_share.items():
        record.output_zero_share.setdefault(name, {})[step] = share
    for name, amax in watch.amax.items():
        record.output_amax.setdefault(name, {})[step] = amax
        if amax > truth.largest_output.get(name, 0.0):
            truth.largest_output[name] = amax
    for name, share in grads.items():
        record.grad_zero_share.setdefault(name, {})[step] = share
    if reference is None or truth.first_flush_step is not None:
        return
    for kind, shares, ref in (
        ("output", watch.zero_share, reference.output_zero_share),
        ("gradient", grads, reference.grad_zero_share),
    ):
        layer = _first_flush(shares, ref, step)
        if layer is not None:
            truth.first_flush_step, truth.first_flush_layer = step, layer
            truth.first_flush_kind = kind
            return


def _metric(task: Task, model: nn.Module, prec: Any, backend: Any) -> float | None:
    value = evaluate(task, model, prec, backend)
    model.train()
    return value if math.isfinite(value) else None


def _note_metric(
    truth: RunTruth,
    record: Reference,
    reference: Reference | None,
    task: Task,
    model: nn.Module,
    prec: Any,
    backend: Any,
    step: int,
) -> None:
    value = _metric(task, model, prec, backend)
    truth.metric_curve[str(step)] = None if value is None else round(value, 4)
    if value is not None:
        record.metric_curve[step] = value
    if reference is None or truth.metric_collapse_step is not None:
        return
    ref = reference.metric_curve.get(step)
    if ref is not None and (value is None or value < ref - COLLAPSE_DROP):
        truth.metric_collapse_step = step


# -- the table: every zoo task's runs, cached as JSON ------------------------------------

TABLE_VERSION = 1
FRAGILE_SEEDS = (0, 1)


def policies_for(entry: Any) -> list[tuple[str, Policy, tuple[int, ...]]]:
    """The policies a zoo entry's truth is measured under, with their seeds: fp32, uniform
    fp16 (the default dynamic loss scaling) and bf16; for fragile tasks fp16 over several
    seeds and the failing group kept in fp32 with the rest in fp16; for boundary tasks the
    boundary modules in fp16 with the rest in bf16, and the other way round."""
    from autoprec.policy import LossScale, Rule
    from autoprec.tasks.zoo import Kind

    fragile = entry.kind == Kind.FRAGILE
    chosen: list[tuple[str, Policy, tuple[int, ...]]] = [
        ("fp32", Policy.uniform("fp32"), (0,)),
        ("fp16", Policy.uniform("fp16"), FRAGILE_SEEDS if fragile else (0,)),
        ("bf16", Policy.uniform("bf16"), (0,)),
    ]
    groups = tuple(entry.failing_groups)
    if fragile and groups:
        keep = Policy(
            (Rule("fp32", groups),), "fp16", LossScale("dynamic"), name="fp16, group in fp32"
        )
        chosen.append(("fp16+group-fp32", keep, (0,)))
    if entry.kind == Kind.BOUNDARY and groups:
        for inside, outside in (("fp16", "bf16"), ("bf16", "fp16")):
            mixed = Policy(
                (Rule(inside, groups),),
                outside,
                LossScale("dynamic"),
                name=f"{outside}, boundary in {inside}",
            )
            chosen.append((f"{outside}+boundary-{inside}", mixed, (0,)))
    return chosen


def is_reference(label: str | None) -> bool:
    """Whether a truth table's run ``label`` (a format, ``fp16+group-fp32``...) is the
    reference's (fp32): the run every other is compared to."""
    return formats.known(label) and formats.get(str(label)).reference


def measure_entry(entry: Any, steps: int = TRUTH_STEPS) -> dict[str, Any]:
    """Every run of one entry's truth, fp32 first (the reference of the others)."""
    started = time.perf_counter()
    task = entry.task()
    runs: dict[str, list[dict[str, Any]]] = {}
    nudged: list[dict[str, Any]] = []
    reference: Reference | None = None
    for label, policy, seeds in policies_for(entry):
        for seed in seeds:
            if is_reference(label):
                truth, reference = long_run(task, policy, seed, steps)
            else:
                truth, _ = long_run(task, policy, seed, steps, reference)
            runs.setdefault(label, []).append(truth.to_dict())
            _print_run(entry.name, label, truth)
            if is_reference(label) and seed == 0:
                assert reference is not None
                for nudge in NUDGES:
                    moved, _ = long_run(task, policy, seed, steps, reference, nudge)
                    nudged.append({**moved.to_dict(), "nudge": nudge})
                    _print_run(entry.name, f"fp32 moved one ulp ({nudge})", moved)
                reference.chaotic = any(r["metric_collapse_step"] is not None for r in nudged)
    return {
        "kind": entry.kind.value,
        "mechanism": entry.mechanism,
        "failing_groups": list(entry.failing_groups),
        "fails_in": list(entry.fails_in),
        "steps": steps,
        "runs": runs,
        "fp32_nudged": nudged,
        "fp32_chaotic": reference.chaotic if reference is not None else False,
        "measured_s": round(time.perf_counter() - started, 1),
        "cpu": cpu_kind(),
    }


def _print_run(name: str, label: str, truth: RunTruth) -> None:
    print(
        f"  {name} {label} seed {truth.seed}: failure {truth.failure_step} "
        f"metric {truth.final_metric} ({truth.run_time_s:.1f} s)",
        flush=True,
    )


def earliest_failure(row: dict[str, Any], label: str) -> int | None:
    """The earliest failure step over a policy's seeds in a table row (None: none)."""
    steps = [r["failure_step"] for r in row["runs"].get(label, []) if r["failure_step"] is not None]
    return min(steps) if steps else None


def latest_failure(row: dict[str, Any], label: str) -> int | None:
    """The latest failure step over a policy's seeds; None when any seed held."""
    steps = [r["failure_step"] for r in row["runs"].get(label, [])]
    return None if not steps or None in steps else max(steps)


def cpu_kind() -> str:
    """The kind of CPU by its fp16 arithmetic (the kernels differ with and without
    avx512_fp16 and AMX), recorded with each row of a truth table: a row is measured on
    one kind. (Measured 2026-12-07: every failure step of the zoo came out the same on
    both kinds, while short trials' verdicts moved.)"""
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    flags = set(info.read_text().split()) if info.is_file() else set()
    native = {"avx512_fp16", "amx_tile"} & flags
    if native:
        return f"x86-64 with {' and '.join(sorted(native))}"
    return "without avx512_fp16 or AMX"


def table_path() -> Any:
    """Where the cached table lives in a checkout: ``benchmarks/zoo_truth.json``."""
    from pathlib import Path

    return Path(__file__).resolve().parents[3] / "benchmarks" / "zoo_truth.json"


def load_table(path: Any = None) -> dict[str, Any]:
    """The cached truth table (``{"version", "steps", "tasks": {name: row}}``)."""
    import json

    table = json.loads((path or table_path()).read_text())
    for row in table["tasks"].values():  # derived fields follow this code's definitions
        chaotic = bool(row.get("fp32_chaotic", False))
        for label, runs in row["runs"].items():
            derived = {"fp32_chaotic": chaotic and not is_reference(label)}
            row["runs"][label] = [RunTruth.from_dict({**run, **derived}).to_dict() for run in runs]
    return table
