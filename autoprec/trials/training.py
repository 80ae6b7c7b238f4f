"""Training trials (the default mode): train a task under a policy for a fixed budget and
measure it; `TrainingTrials` is the mode as the search sees it.

A trial is pure: no Optuna, no MLflow, no global state left behind. Every trial of a search
starts from the task's same initial weights (torch seed), sees the same batches in the
same order, and is evaluated on the same validation data, so results differ only by
policy. A trial never raises for a numerical or runtime problem: a non-finite loss
ends it as ``pruned`` and an exception as ``failed``, with the reason kept.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

import autoprec.formats as formats
from autoprec._util.structures import cast_floats
from autoprec.devices import Backend
from autoprec.errors import AutoprecError, TaskError, first_line
from autoprec.numerics.first_events import OVERFLOW, FirstEvents, diagnose_forward
from autoprec.numerics.forecast import (
    Forecast,
    Outcome,
    default_train_steps,
    forecast,
    forecast_brief,
    with_headroom,
)
from autoprec.numerics.observe import observed_dtypes, watch_task
from autoprec.numerics.state_health import GroupStateHealth, GroupStateLoss, metric_safe
from autoprec.numerics.telemetry import GradientMonitor
from autoprec.policy import Policy
from autoprec.precision.emulation import emulated_dtypes
from autoprec.precision.hooks import Precision
from autoprec.precision.plan import low_precision_share as share_of_parameters
from autoprec.tasks import Task
from autoprec.tasks.base import Batch
from autoprec.trials.base import (
    SIDE_BY_SIDE_BLOCK,
    Choice,
    Feasibility,
    Measured,
    Publisher,
    Result,
    TrialState,
    run_with_time_limit,
    time_side_by_side,
)
from autoprec.trials.compiled import Compilation, fresh_compiler
from autoprec.trials.schedule import learn_lr_shape, trial_schedule_settings

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from torch import nn

    from autoprec.profile.sensitivity import Profile
    from autoprec.space import SearchSpace

# With loss scaling, a few non-finite losses in a row are survivable: the scaler skips
# those steps. More than this many in a row means the policy does not train.
NONFINITE_PATIENCE = 5
FINAL_LOSS_WINDOW = 5
TELEMETRY_EVERY = 10  # telemetry's cadence on long trials: every 10th step observed
TELEMETRY_POINTS = 30  # shorter trials are observed more often, to this many points
# A forecast that cannot tell extends its trial (without --train-steps or --guard; with
# --train-steps the finalists are confirmed at the run's length instead, with --guard the
# user's run watches the layers it could not tell): each round trains this many times
# the steps trained so far and forecasts again, until it can tell, the run breaks, or the
# trial has trained to the forecast's horizon (then what it saw is the answer).
EXTEND_MULTIPLE = 1
# An extension breaks at its first non-finite loss: loss scaling guards the gradients, not
# the forward, so a non-finite loss is the forward overflowing, what the forecast is about
# (no long run of a healthy zoo task had one; a fragile task's first is its failure). The
# trial itself allows NONFINITE_PATIENCE in a row (its first steps may still settle).
EXTENSION_NONFINITE_PATIENCE = 1
# A layer whose share of zero gradients exceeds the fp32 run's by this much is losing
# its gradients to fp16's range.
UNDERFLOW_EVIDENCE = 0.50
LAYERS_ARTIFACT = "telemetry_layers.csv"  # a trial's per-layer telemetry, in MLflow


@dataclass(frozen=True)
class Budget:
    """How long a trial trains. The first ``warmup_steps`` steps are not timed.
    ``train_steps`` is how long the user's real run trains, the step every layer's range
    is forecast to (None: `autoprec.numerics.forecast.FORECAST_MULTIPLE` times ``steps``);
    ``guarded``: the real run runs under the guard (``--guard``), which watches the layers
    whose trend a trial cannot tell, so such a trial is not trained longer."""

    steps: int = 200
    warmup_steps: int = 5
    seed: int = 0
    train_steps: int | None = None
    guarded: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 3:
            raise AutoprecError(f"steps: must be an integer of at least 3, got {self.steps!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise AutoprecError(
                f"warmup_steps: must be a non-negative integer, got {self.warmup_steps!r}"
            )

    @property
    def untimed_steps(self) -> int:
        return min(self.warmup_steps, self.steps // 2)

    @property
    def forecast_steps(self) -> int:
        return self.train_steps or default_train_steps(self.steps)

    @property
    def telemetry_every(self) -> int:
        """Every how many steps telemetry is taken: ``TELEMETRY_EVERY``, more often on
        short trials (at least every 2nd step), so that the forecast has enough points to
        check each fit against the trial's last part."""
        return max(2, min(TELEMETRY_EVERY, self.steps // TELEMETRY_POINTS))


@dataclass
class TrialResult(Measured):
    """What a trial measured. Metric names are the ones used everywhere (DESIGN.md)."""

    state: TrialState
    reason: str | None = None
    accuracy: float | None = None
    final_loss: float | None = None
    step_time_ms: float | None = None
    peak_memory_mb: float | None = None
    peak_memory_is_estimate: bool = False
    overflow_steps: int = 0
    nonfinite_steps: int = 0
    grad_underflow_ratio: float | None = None
    low_precision_share: float = 0.0
    steps_run: int = 0
    run_time_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    switches: dict[str, bool] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    # How the figures were made (`autoprec.trials.compiled`, `autoprec.precision.emulation`): under
    # torch.compile, on a device of this compute capability, with dtypes emulated.
    compiled: bool = False
    graph_breaks: int | None = None
    compile_s: float | None = None
    compute_capability: str | None = None
    emulated: list[str] = field(default_factory=list)
    forecast: dict[str, Any] = field(default_factory=dict)  # `autoprec.numerics.forecast.Forecast`
    at_risk: str | None = None  # why the forecast says the real run would overflow
    # What the telemetry saw first, per mechanism and layer (`autoprec.numerics.first_events`).
    first_events: list[dict[str, Any]] = field(default_factory=list)
    # Why the forecast cannot tell, and what was done (the trial extended, the finalists
    # confirmed at --train-steps, or the layers left to the guard); never makes the trial
    # infeasible.
    cannot_tell: str | None = None
    # where the policy names optimizer states: their bytes as stored (`autoprec.optim`),
    # per group their health at the end (`autoprec.numerics.state_health.GroupStateHealth`)
    # and, where all are fp32, what each quantised kind would lose on them (`GroupStateLoss`)
    optimizer_state_mb: float | None = None
    state_health: list[dict[str, Any]] = field(default_factory=list)
    state_loss: list[dict[str, Any]] = field(default_factory=list)
    retries: Sequence[str] = ()  # `Measured.retries`

    METRICS: ClassVar[tuple[str, ...]] = (
        "accuracy",
        "final_loss",
        "step_time_ms",
        "peak_memory_mb",
        "overflow_steps",
        "nonfinite_steps",
        "grad_underflow_ratio",
        "low_precision_share",
        "steps_run",
        "run_time_s",
    )

    TIME_METRIC = "step_time_ms"  # the median training step
    TIME_LABEL = "step"
    MODE = "training"

    def curves(self) -> dict[str, list[float]]:
        return {"train_loss": self.losses, "loss_scale": self.loss_scales}

    def metrics(self) -> dict[str, float]:
        """``METRICS``, and where the policy names optimizer states, their bytes as stored
        (``optimizer_state_mb``)."""
        metrics = super().metrics()
        if self.optimizer_state_mb is not None:
            metrics["optimizer_state_mb"] = self.optimizer_state_mb
        return metrics

    def within(self, feasibility: Feasibility) -> bool:
        """A trial whose forecast crosses within the run is infeasible, unless the
        forecast only warns (``--forecast warn``)."""
        return self.at_risk is None or feasibility.forecast_warns

    def artifacts(self) -> dict[str, str]:
        layers = (self.telemetry or {}).get("layers")
        return {LAYERS_ARTIFACT: layers_csv(with_headroom(layers, self.forecast))} if layers else {}

    def entry_fields(self) -> dict[str, Any]:
        return {
            "switches": self.switches,
            "execution": self.execution(),
            "state_health": self.state_groups(),
            "state_loss": self.state_losses(),
        }

    def execution(self) -> dict[str, Any]:
        """How the figures were made, as summary.json's entry holds it."""
        facts: dict[str, Any] = {"compute_capability": self.compute_capability}
        if self.compiled:
            facts.update(compiled=True, graph_breaks=self.graph_breaks, compile_s=self.compile_s)
        if self.emulated:
            facts["emulated"] = list(self.emulated)
        return {k: v for k, v in facts.items() if v is not None}

    def extra_metrics(self) -> dict[str, float]:
        """The forecast's least headroom now and at the run's length, its first crossing;
        a compiled trial's graph breaks and compile time (NaN where it measured none, so
        that every child of a compiled search has the same metrics)."""
        metrics = Forecast.from_dict(self.forecast).metrics() if self.forecast else {}
        if self.compiled:
            values = {"graph_breaks": self.graph_breaks, "compile_s": self.compile_s}
            metrics.update({k: math.nan if v is None else float(v) for k, v in values.items()})
        for group in self.state_groups():
            metrics.update(group.metrics())
        for loss in self.state_losses():
            metrics.update(loss.metrics())
        return metrics

    def state_groups(self) -> list[GroupStateHealth]:
        """Each optimizer-state group's health at the end of the trial (none where the
        policy names no states)."""
        return [GroupStateHealth.from_json(data) for data in self.state_health]

    def state_losses(self) -> list[GroupStateLoss]:
        """What each quantised kind would lose on this trial's fp32 states, per group."""
        return [GroupStateLoss.from_json(data) for data in self.state_loss]

    def run_tags(self) -> dict[str, str]:
        """Per optimizer-state group whose state hurt: ``state_reason.<group>``."""
        return {
            f"state_reason.{metric_safe(group.group)}": group.reason[:4000]
            for group in self.state_groups()
            if group.reason is not None
        }

    def run_params(self) -> dict[str, str]:
        return {
            "compute_capability": self.compute_capability or "unknown",
            "compiled": str(self.compiled).lower(),
            "emulated": ",".join(self.emulated) or "none",
        }

    def telemetry_brief(self) -> dict[str, Any]:
        """The worst layers and the warnings (the full table is in MLflow)."""
        telemetry = self.telemetry or {}
        scales = self.loss_scales
        return {
            "grad_underflow_ratio": telemetry.get("grad_underflow_ratio"),
            "observed_steps": telemetry.get("observed_steps", 0),
            "worst_layers": telemetry.get("layers", [])[:3],
            "warnings": telemetry.get("warnings", []),
            "loss_scale_final": scales[-1] if scales else None,
            "loss_scale_min": min(scales) if scales else None,
            "forecast": forecast_brief(self.forecast),
            "at_risk": self.at_risk,
            "cannot_tell": self.cannot_tell,
            **(
                {"memory_split_mb": telemetry["memory_split_mb"]}
                if "memory_split_mb" in telemetry
                else {}
            ),
        }

    def advice(self) -> list[str]:
        """What fp16 would do to this (fp32) run's own gradients and activations."""
        return list((self.telemetry or {}).get("warnings", []))


def layers_csv(layers: list[dict[str, Any]]) -> str:
    """The per-layer telemetry as CSV, one row per layer."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(layers[0]))
    writer.writeheader()
    writer.writerows(layers)
    return buffer.getvalue()


@dataclass(frozen=True)
class EarlyStopping:
    """When a trial is hopeless and stops early, recorded as pruned with the reason.

    - the loss trails the fp32 baseline's curve (same weights, same batches): once
      ``start_fraction`` of the budget has run, the trial is stopped when its recent mean
      loss exceeds the baseline's by more than ``trail_fraction`` of the progress the
      baseline made in as many optimizer steps (skipped steps are not held against it);
    - the loss scaler skipped at least ``max_skipped`` of the last ``skip_window`` steps
      while its scale could not go lower (static scaling, or dynamic at its floor or
      below 1): the start-up backoff of a high initial scale is not counted.
    A non-finite loss without loss scaling always ends a trial (its weights would be
    corrupted), and so do ``NONFINITE_PATIENCE`` non-finite losses in a row with it.
    """

    reference_losses: tuple[float, ...] = ()
    reference_zero_share: dict[str, float] = field(default_factory=dict)
    # The layers whose values went mostly zero in the fp32 run too, and from which step:
    # no flush of theirs from then on is blamed on low precision.
    reference_flushed: dict[str, int] = field(default_factory=dict)
    window: int = 5
    start_fraction: float = 0.2
    trail_fraction: float = 0.5
    skip_window: int = 25
    max_skipped: int = 20

    @classmethod
    def from_baseline(cls, baseline: TrialResult) -> EarlyStopping:
        layers = (baseline.telemetry or {}).get("layers", [])
        return cls(
            reference_losses=tuple(baseline.losses),
            reference_zero_share={layer["name"]: layer["grad_zero_share"] for layer in layers},
            reference_flushed=FirstEvents.from_list(baseline.first_events).flushed_layers(),
        )

    def trailing(
        self, losses: list[float], steps: int, skipped: int = 0
    ) -> tuple[float, float] | None:
        """(trial, baseline) recent mean losses when the trial trails by a clear margin.
        The baseline is read where it stood after as many optimizer steps as the trial
        took (``len(losses) - skipped``)."""
        step = len(losses)
        taken = step - skipped
        ref = self.reference_losses
        if taken < max(2 * self.window, int(self.start_fraction * steps)) or taken > len(ref):
            return None
        recent = [v for v in losses[step - self.window : step] if math.isfinite(v)]
        if not recent:
            return None
        trial_loss = statistics.fmean(recent)
        base_loss = statistics.fmean(ref[taken - self.window : taken])
        progress = statistics.fmean(ref[: self.window]) - base_loss
        if progress <= 0.05 * abs(statistics.fmean(ref[: self.window])):
            return None  # the baseline itself has not learned yet: nothing to compare
        if trial_loss - base_loss > self.trail_fraction * progress:
            return trial_loss, base_loss
        return None


def run_trial(
    task: Task,
    policy: Policy,
    backend: Backend,
    budget: Budget,
    early_stopping: EarlyStopping | None = None,
    compiled: bool = False,
) -> TrialResult:
    """Train ``task`` under ``policy`` on ``backend`` for ``budget`` (``compiled``: under
    torch.compile, `autoprec.trials.compiled`); never raises for a problem of the trial itself
    (bad input to autoprec still raises AutoprecError)."""
    started = time.perf_counter()
    try:
        result = train_and_evaluate(task, policy, backend, budget, early_stopping, compiled)
    except AutoprecError:
        raise
    except torch.OutOfMemoryError as error:
        result = TrialResult(TrialState.FAILED, f"out of memory: {first_line(error)}")
    except Exception as error:  # any failure of a trial is its result
        result = TrialResult(
            TrialState.FAILED, f"{type(error).__name__}: {first_line(error, 500)}"[:500]
        )
    finally:
        backend.empty_cache()
    result.run_time_s = time.perf_counter() - started
    result.compiled, result.compute_capability = compiled, backend.compute_capability()
    result.emulated = emulated_dtypes(policy, backend)
    return result


def train_fp32(task: Task, backend: Backend, budget: Budget) -> tuple[torch.nn.Module, TrialResult]:
    """The task's model trained in fp32 for ``budget`` as a trial trains it (the same seed,
    batches and loop), with what the run measured; the model is returned on the CPU. The
    serving search starts from it when no checkpoint is given."""
    started = time.perf_counter()
    torch.manual_seed(budget.seed)
    with backend.selected():
        run = _Run(task, Policy.uniform("fp32"), backend, budget, None)
        try:
            batches = iter(task.train_data(budget.seed))
            for step in range(budget.steps):
                run.step(step, draw_batch(task, batches, step, budget.steps, backend))
            result = run.finish()
        finally:
            run.prec.remove()
    result.run_time_s = time.perf_counter() - started
    if result.state != TrialState.COMPLETE:
        raise TaskError(
            f"task {task.name!r}: the fp32 model did not train ({result.reason}); "
            "fix the task, or give a checkpoint"
        )
    return run.model.cpu(), result


def train_and_evaluate(
    task: Task,
    policy: Policy,
    backend: Backend,
    budget: Budget,
    early_stopping: EarlyStopping | None,
    compiled: bool = False,
    ranks: Ranks | None = None,
) -> TrialResult:
    with backend.selected():
        return _train_and_evaluate_here(
            task, policy, backend, budget, early_stopping, compiled, ranks
        )


def _train_and_evaluate_here(
    task: Task,
    policy: Policy,
    backend: Backend,
    budget: Budget,
    early_stopping: EarlyStopping | None,
    compiled: bool = False,
    ranks: Ranks | None = None,
) -> TrialResult:
    torch.manual_seed(budget.seed)
    run = _Run(task, policy, backend, budget, early_stopping, compiled, ranks)
    try:
        data = (
            task.train_data(budget.seed) if ranks is None else ranks.train_data(task, budget.seed)
        )
        batches = iter(data)
        for step in range(budget.steps):
            reason = run.step(step, draw_batch(task, batches, step, budget.steps, backend))
            if reason is not None:
                run.result.state, run.result.reason = TrialState.PRUNED, reason
                break
        return run.finish(None if ranks is not None else batches)
    finally:
        run.prec.remove()


class Ranks(Protocol):
    """How one rank of a trial across several devices trains (`autoprec.distributed`):
    the model wrapped for its parallel mode, and a float made the mean over all ranks."""

    def wrap(self, model: nn.Module, prec: Precision) -> nn.Module: ...

    def mean(self, value: float) -> float: ...

    def train_data(self, task: Task, seed: int) -> Iterable[Any]: ...


class _Run:
    """One trial's model, optimizer, precision, meters and what it measured so far; on
    one rank of several (``ranks``), the wrapped model trains and losses are means."""

    def __init__(
        self,
        task: Task,
        policy: Policy,
        backend: Backend,
        budget: Budget,
        early_stopping: EarlyStopping | None,
        compiled: bool = False,
        ranks: Ranks | None = None,
    ) -> None:
        self.task, self.backend, self.budget = task, backend, budget
        self.policy = policy
        self.early_stopping = early_stopping
        self.ranks = ranks
        self.model = task.model().to(backend.device)
        self.model.train()
        # How autocast treats these layers here, and which dtypes they cannot run in,
        # watched on a real batch first (once per layer class): a policy that puts a layer
        # in a dtype it cannot run in is refused before training, with the kernel's
        # reason (an LSTM in fp16 where oneDNN has no such kernel), not crashed in it.
        watch_task(task, self.model, backend)
        share = _observed_share(task, policy, self.model, backend)
        self.prec = policy.apply(self.model, backend)
        # What trains: the model itself, or a rank's wrapper of it (DDP, FSDP2), made
        # before the optimizer, which takes the parameters the wrapper trains.
        self.trained = self.model if ranks is None else ranks.wrap(self.model, self.prec)
        self.optimizer = _make_optimizer(task, policy, self.model)
        self.scheduler = task.make_scheduler(self.optimizer)
        self.compilation = Compilation(self.trained, compiled, backend.now_s)
        self.meter = backend.memory_meter()
        self.result = TrialResult(
            TrialState.COMPLETE,
            peak_memory_is_estimate=self.meter.is_estimate,
            low_precision_share=share,
            switches=dict(self.prec.switches),
        )
        self.meter.start(self.model)
        self.monitor = GradientMonitor(self.model)
        self.step_times_s: list[float] = []
        self.skipped: list[bool] = []
        self.stuck: list[bool] = []
        self.nonfinite_in_a_row = 0
        self.learning_rates: list[float] = []  # each step's, for the forecast's warm-up check
        self.extension_scales: list[float] = []  # the loss scale past the trial's steps
        self.extension_losses: list[float] = []  # and the losses

    def step(self, step: int, batches: list[Batch]) -> str | None:
        """Train one step and record it; the reason to stop, if the trial is hopeless."""
        # Telemetry is taken on every TELEMETRY_EVERY-th step, which is not timed. Memory
        # is measured on the untimed steps after step 0, which is observed, so that
        # telemetry's scratch tensors stay out of the peak.
        budget, backend, prec, result = self.budget, self.backend, self.prec, self.result
        observed = step % budget.telemetry_every == 0
        measured = 1 <= step <= max(1, budget.untimed_steps)
        timed = step > budget.untimed_steps and not observed and not measured
        scale_used = prec.loss_scale
        self.learning_rates.append(_learning_rate(self.optimizer))
        with (
            self.meter.step() if measured else contextlib.nullcontext(),
            self.monitor.activations(step) if observed else contextlib.nullcontext(),
        ):
            started_s = backend.now_s() if timed else 0.0
            # Observed steps run eager: telemetry's hooks would break a compiled graph.
            with self.compilation.step() as compiling:
                loss_value, stepped = train_step(
                    self.task,
                    self.compilation.forward_model(eager=observed),
                    self.optimizer,
                    prec,
                    batches,
                    self.scheduler,
                    None if self.ranks is None else self.ranks.mean,
                )
            if timed and not compiling.compiled:  # a step that compiled is compile time
                self.step_times_s.append(backend.now_s() - started_s)
        if observed and stepped:  # skipped steps hold overflowed, not lost, gradients
            self.monitor.observe_gradients(scale_used)
        result.steps_run = step + 1
        result.losses.append(loss_value)
        result.loss_scales.append(scale_used)
        self.skipped.append(not stepped)
        # A skip counts against the policy only once the scale cannot go lower.
        self.stuck.append(not stepped and prec.scaler.at_floor)
        result.overflow_steps += 0 if stepped else 1
        settings = prec.scaler.settings
        self.monitor.first_events.loss_scale(
            step, scale_used, settings.mode == "dynamic", max(settings.min_scale, 1.0)
        )
        if not math.isfinite(loss_value):
            return self._nonfinite(step, loss_value, stepped, batches[-1])
        self.nonfinite_in_a_row = 0
        return None if self.early_stopping is None else self._hopeless(step)

    def _nonfinite(
        self, step: int, loss_value: float, stepped: bool | None, batch: Batch
    ) -> str | None:
        """Stop on a non-finite loss without scaling, or NONFINITE_PATIENCE in a row."""
        self.result.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        in_a_row = self.nonfinite_in_a_row
        stop = stepped is None or (
            self.early_stopping is not None and in_a_row >= NONFINITE_PATIENCE
        )
        if not stop:
            return None
        events = self.monitor.first_events
        forward = partial(_forward, self.model, self.prec, batch)
        layer = diagnose_forward(self.model, forward, events, step)
        how = ", no loss scaling" if stepped is None else f", {in_a_row} steps in a row"
        loss_line = f"non-finite loss ({loss_value}) at step {step}{how}"
        first = events.earliest(self._fp32_flushed)
        if first is not None and first.mechanism == OVERFLOW and first.layer is not None:
            layer, at = first.layer, "" if first.step == step else f", first at step ~{first.step}"
        else:
            at = ""
        dtype = _dtype_of(layer, self.prec.plan.leaf_dtypes)
        where = f"; first non-finite output: {layer} ({dtype}){at}" if layer else ""
        if first is None or first.mechanism == OVERFLOW:
            return f"overflow: {loss_line}{where}"
        return f"{first.words}: {first.describe()}; then {loss_line}{where}"

    @property
    def _fp32_flushed(self) -> dict[str, int]:
        stopping = self.early_stopping
        return {} if stopping is None else stopping.reference_flushed

    def _hopeless(self, step: int) -> str | None:
        """Stop when the scaler keeps skipping at its floor, or the loss trails fp32's."""
        stopping = self.early_stopping
        assert stopping is not None
        recent = self.stuck[-stopping.skip_window :]
        if sum(recent) >= stopping.max_skipped:
            return (
                f"overflow: the loss scaler skipped {sum(recent)} of the last {len(recent)} "
                f"steps (to step {step}, scale now {self.prec.loss_scale:g})"
            )
        trailing = stopping.trailing(self.result.losses, self.budget.steps, sum(self.skipped))
        if trailing is None:
            return None
        evidence = _underflow_evidence(self.prec, self.monitor, stopping)
        return _trailing_reason(trailing, step, evidence)

    def finish(self, batches: Iterator[Any] | None = None) -> TrialResult:
        """The measurements, and the accuracy of a trial that completed; its forecast,
        after training on from ``batches`` (the trial's own) where it cannot tell."""
        result, prec = self.result, self.prec
        if result.state == TrialState.COMPLETE and result.overflow_steps == result.steps_run:
            result.state = TrialState.PRUNED
            result.reason = (
                f"overflow: the loss scaler skipped all {result.steps_run} steps "
                f"(scale now {prec.loss_scale:g})"
            )
        if result.state == TrialState.COMPLETE and self.early_stopping is not None:
            # A trial that ran to the end can still have lost gradients: say so.
            evidence = _underflow_evidence(prec, self.monitor, self.early_stopping)
            if evidence:
                result.reason = f"underflow: {evidence}"
        result.telemetry = self.monitor.report()
        result.first_events = self.monitor.first_events.to_list()
        fp8 = self.monitor.fp8.evidence()  # the fp8 layer whose casts flush its values
        if fp8 is not None:
            result.reason = f"{result.reason}; {fp8}" if result.reason else fp8
        result.grad_underflow_ratio = self.monitor.grad_underflow_ratio
        result.peak_memory_mb = self.meter.peak_mb(self.model, self.optimizer)
        split = self.meter.split_mb(self.model, self.optimizer)
        if split is not None:
            result.telemetry["memory_split_mb"] = split
        if not self.policy.optimizer_states.is_default:
            self._optimizer_states(result)
        if self.step_times_s:
            result.step_time_ms = statistics.median(self.step_times_s) * 1000.0
        compiled = self.compilation.report()
        if compiled is not None:
            result.graph_breaks, result.compile_s = compiled.graph_breaks, compiled.compile_s
        finite = [v for v in result.losses if math.isfinite(v)]
        if finite:
            result.final_loss = statistics.fmean(finite[-FINAL_LOSS_WINDOW:])
        if result.state == TrialState.COMPLETE:
            result.accuracy = evaluate(self.task, self.trained, prec, self.backend)
            if not math.isfinite(result.accuracy):
                result.state = TrialState.FAILED
                result.reason = f"the task's metric returned {result.accuracy}"
                result.accuracy = None
        self._forecast(batches)
        return result

    def _optimizer_states(self, result: TrialResult) -> None:
        """The states' bytes as stored; per group, their health (`state_health`) and the
        reason naming the group and the mechanism where a quantised state hurts; where
        every state is fp32 (the baseline of a space that searches them), what each
        quantised kind would lose on this real state (`state_loss`), for the guided
        search's ranking of the groups."""
        from autoprec.numerics.state_health import (
            group_health,
            state_health,
            state_loss,
            worst_group,
        )
        from autoprec.optim.state import STATE_KINDS, optimizer_state_nbytes

        states = self.policy.optimizer_states
        result.optimizer_state_mb = optimizer_state_nbytes(self.optimizer) / 2**20
        groups = group_health(self.model, states, state_health(self.model, self.optimizer))
        result.state_health = [group.to_json() for group in groups]
        worst = worst_group(groups)
        if worst is not None and worst.reason is not None:
            reason = worst.reason
            result.reason = f"{result.reason}; {reason}" if result.reason else reason
        if states.all_fp32(self.model):
            kinds = STATE_KINDS[1:]  # the first, fp32, is what they train in now
            try:
                losses = state_loss(self.model, self.optimizer, states, kinds)
            except ImportError:  # torchao, whose quantisers say it, is not installed
                losses = []
            result.state_loss = [loss.to_json() for loss in losses]

    def _forecast(self, batches: Iterator[Any] | None) -> None:
        """Every layer's range projected to the run's length; a crossing within it puts
        the trial at risk, said in its reason. Where the forecast cannot tell, the trial
        trains on from ``batches`` (in rounds of ``EXTEND_MULTIPLE`` times the steps
        trained so far, up to the horizon, without --train-steps) and is forecast again
        after each; with --train-steps it is left to the confirmation of the finalists at
        that length; under the guard (``Budget.guarded``) it is feasible under the guard,
        its reason naming the layers the guard watches. "Cannot tell" never makes a trial
        infeasible."""
        if self.monitor.ranges is None:
            return
        budget, result = self.budget, self.result
        ahead = self._ahead(0)
        complete = result.state == TrialState.COMPLETE
        if complete and ahead.cannot_tell() is not None:
            if budget.guarded:
                ahead = ahead.with_path(_under_guard(ahead))
                result.reason = "; ".join(r for r in (result.reason, ahead.path) if r)
            elif budget.train_steps is not None:
                ahead = ahead.with_path(
                    f"confirmed at --train-steps {budget.train_steps} if it is chosen"
                )
            elif batches is not None:
                ahead = self._extended(batches)
        result.forecast = ahead.to_dict()
        result.at_risk = ahead.at_risk() if complete else None
        result.cannot_tell = ahead.cannot_tell() if complete else None
        if result.at_risk is not None:
            result.reason = "; ".join(r for r in (result.reason, result.at_risk) if r)

    def _ahead(self, extended_steps: int) -> Forecast:
        assert self.monitor.ranges is not None
        scaler = self.prec.scaler
        dynamic = scaler.settings.enabled and scaler.settings.mode == "dynamic"
        return forecast(
            self.monitor.ranges,
            self.budget.forecast_steps,
            self.budget.steps,
            loss_scales=self.scales,
            scale_floor=scaler.settings.min_scale if dynamic else None,
            learning_rates=self.learning_rates,
            planned_peak=self.planned_peak,
            losses=[*self.result.losses, *self.extension_losses],
            extended_steps=extended_steps,
        )

    @cached_property
    def planned_peak(self) -> tuple[int, float] | None:
        """The schedule's first step at its largest learning rate within the forecast's
        horizon, and that rate (stepped on a throwaway optimizer, once); None without a
        scheduler."""
        shape = learn_lr_shape(self.task, self.model, self.budget.forecast_steps)
        return None if shape is None else (shape.peak_step, shape.peak_lr)

    def _extended(self, batches: Iterator[Any]) -> Forecast:
        """The forecast after training on past the trial's steps, observed as the trial
        was, in rounds (``EXTEND_MULTIPLE``) until it can tell or the trial has trained to
        the forecast's horizon. The trial's own figures (accuracy, losses, telemetry) stay
        its own; a run that breaks on the way (a non-finite loss, a scaler stuck at its
        floor) is at risk."""
        budget = self.budget
        horizon = max(budget.forecast_steps, budget.steps + 1)
        rounds = []
        end = budget.steps
        while end < horizon:
            end, start = min(horizon, end * (1 + EXTEND_MULTIPLE)), end
            rounds.append((start, end))
        self.trained.train()
        stopped: str | None = None
        broke: str | None = None
        in_a_row = stuck = 0
        step = budget.steps - 1
        ahead = self._ahead(0)
        for start, end in rounds:
            step, stopped, broke, in_a_row, stuck = self._train_on(
                batches, start, end, in_a_row, stuck
            )
            ahead = self._ahead(step - budget.steps + (0 if stopped else 1))
            if stopped or broke is not None or ahead.cannot_tell() is None:
                break
        how = f"extended the trial to {step + (0 if stopped else 1)} steps"
        if stopped:
            how = f"{how}, {stopped}"
        if broke is not None:
            return ahead.with_path(f"{how}: it broke ({broke})").with_broken(
                f"the extended trial broke: {broke}", step
            )
        if ahead.cannot_tell() is not None:
            how = (
                f"{how}: still cannot tell; it stays feasible (confirm with --confirm-steps, "
                "or give --train-steps)"
            )
        return ahead.with_path(how)

    def _train_on(
        self, batches: Iterator[Any], start: int, end: int, in_a_row: int, stuck: int
    ) -> tuple[int, str | None, str | None, int, int]:
        """Train steps ``start`` to ``end`` of an extension, observed as the trial was:
        the last step reached, why the data stopped (if it did), why the run broke (if it
        did), and the counts of non-finite losses and stuck scaler steps in a row."""
        budget, prec = self.budget, self.prec
        stopped: str | None = None
        broke: str | None = None
        step = start
        try:
            for step in range(start, end):
                drawn = draw_batch(self.task, batches, step, end, self.backend)
                observed = step % budget.telemetry_every == 0
                scale_used = prec.loss_scale
                self.learning_rates.append(_learning_rate(self.optimizer))
                with self.monitor.activations(step) if observed else contextlib.nullcontext():
                    loss_value, stepped = train_step(
                        self.task, self.trained, self.optimizer, prec, drawn, self.scheduler
                    )
                if observed and stepped:
                    self.monitor.observe_gradients(scale_used)
                self.extension_scales.append(scale_used)
                self.extension_losses.append(loss_value)
                stuck = stuck + 1 if (not stepped and prec.scaler.at_floor) else 0
                in_a_row = 0 if math.isfinite(loss_value) else in_a_row + 1
                if stepped is None or in_a_row >= EXTENSION_NONFINITE_PATIENCE:
                    broke = f"non-finite loss ({loss_value}) at step {step}"
                    break
                if stuck >= NONFINITE_PATIENCE:
                    broke = f"the loss scaler stuck at its floor at step {step}"
                    break
        except Exception as error:  # the task's data or schedule ends: keep what was seen
            stopped = f"stopped at step {step} ({type(error).__name__}: {first_line(error, 120)})"
        return step, stopped, broke, in_a_row, stuck

    @property
    def scales(self) -> list[float]:
        return [*self.result.loss_scales, *self.extension_scales]


def _learning_rate(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate the optimizer's first parameter group steps with now."""
    value = optimizer.param_groups[0].get("lr", 0.0) if optimizer.param_groups else 0.0
    return float(value) if isinstance(value, int | float) else float(value.item())


def _underflow_evidence(
    prec: Precision, monitor: GradientMonitor, early_stopping: EarlyStopping
) -> str | None:
    """fp16 layers with far more zero gradients than the same layers in the fp32 run."""
    layer_dtypes = prec.plan.leaf_dtypes
    excess = []
    for name, stats in monitor.stats.items():
        reference = early_stopping.reference_zero_share.get(name)
        if (
            formats.get(layer_dtypes.get(name, formats.reference().name)).scales_loss
            and reference is not None
            and stats.grad_elements
            and stats.grad_zero_share - reference > UNDERFLOW_EVIDENCE
        ):
            excess.append(f"{name} {stats.grad_zero_share:.0%} vs {reference:.0%}")
    if not excess:
        return None
    scaling = prec.scaler.settings.mode
    return (
        "zero gradients in fp16 layers against fp32: "
        + ", ".join(excess[:3])
        + (" (no loss scaling)" if scaling == "none" else f" (loss scaling {scaling})")
    )


def _trailing_reason(
    trailing: tuple[float, float],
    step: int,
    evidence: str | None,
) -> str:
    """Why the loss trails, naming gradient underflow where the zeros show it."""
    trial_loss, base_loss = trailing
    text = (
        f"loss trails the fp32 baseline ({trial_loss:.4g} against {base_loss:.4g} by step {step})"
    )
    return f"underflow: {text}; {evidence}" if evidence else text


def _under_guard(ahead: Forecast) -> str:
    """What a trial whose forecast cannot tell is under the guard: feasible, the layers
    whose trend could not be told watched in the user's run (every low-precision layer,
    where what is unclear is the warm-up or the loss scale)."""
    unclear = [f"{h.layer} ({h.dtype})" for h in ahead.layers if h.outcome == Outcome.CANNOT_TELL]
    watched = ", ".join(unclear) if unclear else "every low-precision layer"
    return (
        f"feasible under the guard, which watches {watched} in your run and promotes a "
        "layer before it fails"
    )


def _dtype_of(name: str | None, layer_dtypes: dict[str, str]) -> str:
    """The dtype a module runs in: its own, or that shared by every leaf below it; a
    module without parameters runs in its input's."""
    below = {d for leaf, d in layer_dtypes.items() if leaf == name or leaf.startswith(f"{name}.")}
    if not below:
        return "its input's dtype"
    return below.pop() if len(below) == 1 else "mixed"


def _observed_share(task: Task, policy: Policy, model: torch.nn.Module, backend: Backend) -> float:
    """The share of parameters that run in low precision, as one forward of the task's
    first validation batch under the policy shows it (the trial's random stream kept)."""
    with torch.random.fork_rng(devices=[]):
        example = task.first_val_batch().to(backend.device)
        resolved = policy.resolve(model, backend)
        resolved.update(observed_dtypes(model, policy, example.run, backend))
    return share_of_parameters(model, resolved)


def _forward(model: torch.nn.Module, prec: Precision, batch: Batch) -> None:
    with prec.autocast():
        batch.run(model)


def draw_batch(
    task: Task, batches: Iterator[Any], step: int, steps: int, backend: Backend
) -> list[Batch]:
    """The ``task.accumulate`` batches of one optimizer step, on the device."""
    drawn: list[Batch] = []
    for _ in range(task.accumulate):
        raw = next(batches, None)
        if raw is None:
            used = step * task.accumulate + len(drawn)
            raise TaskError(
                f"task {task.name!r}: train_data ran out after {used} batches "
                f"(the budget needs {steps * task.accumulate})"
            )
        drawn.append(task.batch(raw).to(backend.device))
    return drawn


def train_step(
    task: Task,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    prec: Precision,
    batches: list[Batch],
    scheduler: Any = None,
    mean: Callable[[float], float] | None = None,
) -> tuple[float, bool | None]:
    """One optimizer step, as a user's loop runs it under the policy: a forward and
    backward per accumulated batch, gradient clipping on unscaled gradients, the step,
    and the scheduler after a step that was taken. Returns the mean loss and whether the
    optimizer stepped; None when a non-finite loss without loss scaling ended the step
    before backward (stepping would corrupt the weights; a guarded precision's own step
    skips such a step, and its guard diagnoses it). ``mean``: a rank's loss made
    the mean over all ranks, so that every rank records and decides on the same loss."""
    optimizer.zero_grad(set_to_none=True)
    loss_value = 0.0
    for batch in batches:
        with prec.autocast():
            outputs = batch.run(model)
        loss = task.compute_loss(outputs, batch.targets) / len(batches)
        part = float(loss.detach()) if mean is None else mean(float(loss.detach()))
        loss_value += part
        unchecked = not prec.scaler.settings.enabled and not prec.checks_gradients
        if not math.isfinite(part) and unchecked:
            return loss_value, None
        prec.backward(loss)
    if task.clip_grad_norm is not None and not prec.unscale_(optimizer):
        torch.nn.utils.clip_grad_norm_(model.parameters(), task.clip_grad_norm)
    stepped = prec.step(optimizer)
    if stepped and scheduler is not None:
        scheduler.step()
    return loss_value, stepped


def time_policies_side_by_side(
    task: Task,
    policies: list[Policy],
    backend: Backend,
    budget: Budget,
    rounds: int = 5,
    compiled: bool = False,
) -> list[float]:
    """Median step time (ms) of each policy, measured in alternating blocks (see
    `time_side_by_side`). Each policy trains its own copy of the model from the same
    initial weights, on the same batches; ``compiled``: under torch.compile, as the
    trials were (the warm-up compiles; a step that compiles again is not timed)."""
    if compiled:
        fresh_compiler()
    with backend.selected():
        candidates = [_Timed(task, policy, backend, budget, compiled) for policy in policies]
    block = max(1, min(SIDE_BY_SIDE_BLOCK, (budget.steps - budget.untimed_steps) // rounds))
    data = iter(task.train_data(budget.seed))
    steps = budget.untimed_steps + block
    with backend.selected():
        batches = [draw_batch(task, data, step, steps, backend) for step in range(steps)]
    for candidate in candidates:
        candidate.batches = batches
    try:
        return time_side_by_side(candidates, backend, rounds, block, budget.untimed_steps)
    finally:
        for candidate in reversed(candidates):
            candidate.prec.remove()


class _Timed:
    """One policy's model, optimizer and precision, trained step by step for timing."""

    def __init__(
        self, task: Task, policy: Policy, backend: Backend, budget: Budget, compiled: bool = False
    ) -> None:
        torch.manual_seed(budget.seed)
        self.task, self.policy, self.backend = task, policy, backend
        self.model = task.model().to(backend.device).train()
        self.prec = policy.apply(self.model, backend)
        self.optimizer = _make_optimizer(task, policy, self.model)
        self.compilation = Compilation(self.model, compiled, backend.now_s, fresh=False)
        self.untimed = budget.untimed_steps
        self.batches: list[list[Batch]] = []

    def warm_up(self, calls: int) -> None:
        self._steps(self.batches[:calls])

    def timed(self, calls: int) -> list[float]:
        return self._steps(self.batches[self.untimed : self.untimed + calls])

    def _steps(self, batches: list[list[Batch]]) -> list[float]:
        backend = self.backend
        previous = backend.set_switches(self.policy.tf32, self.policy.hf32)
        times_s = []
        try:
            for step_batches in batches:
                started_s = backend.now_s()
                with self.compilation.step() as compiling:
                    model = self.compilation.forward_model()
                    train_step(self.task, model, self.optimizer, self.prec, step_batches)
                if not compiling.compiled:  # compile time is no step's
                    times_s.append(backend.now_s() - started_s)
        finally:
            backend.restore_switches(previous)
        return times_s


def _make_optimizer(task: Task, policy: Policy, model: nn.Module) -> torch.optim.Optimizer:
    """The task's optimizer, or where the policy names training states other than fp32,
    the per-group optimizer it describes, from the task's optimizer's class and defaults.
    ``model``: the model itself, not a rank's DDP wrapper (whose parameter names the
    policy's groups would not match); under FSDP2, its sharded parameters, whose states
    torchao shards alike."""
    if policy.optimizer_states.is_default:
        return task.make_optimizer(model.parameters())
    return policy.optimizer(model, task.make_optimizer)


def evaluate(task: Task, model: torch.nn.Module, prec: Any, backend: Backend) -> float:
    """The task's metric over the validation data, weighted by batch size."""
    model.eval()
    total = 0.0
    count = 0
    with torch.no_grad():
        for raw in task.val_data():
            batch = task.batch(raw).to(backend.device)
            with prec.autocast():
                outputs = batch.run(model)
            total += task.score(cast_floats(outputs, torch.float32), batch.targets) * batch.size
            count += batch.size
    if count == 0:
        raise TaskError(f"task {task.name!r}: val_data yielded no batches")
    return total / count


class TrainingTrials:
    """The training mode: each trial trains the task under a policy (`run_trial`) and is
    scored on accuracy, step time and peak memory against fp32 trained the same way."""

    mode: ClassVar[str] = "training"
    objectives: ClassVar[tuple[str, str, str]] = ("accuracy", "peak_memory_mb", "step_time_ms")
    result_type: ClassVar[type[Result]] = TrialResult
    baseline_verb: ClassVar[str] = "train"
    # (task, device, dtype) warmed up in this process: once is enough.
    _warm: ClassVar[set[tuple[str, str, str]]] = set()

    def __init__(
        self,
        *,
        task: Task,
        model: nn.Module,
        backend: Backend,
        budget: Budget,
        accuracy_tolerance: float | None = None,
        prefer: str | None = None,
        study: str | None = None,
        stopping: EarlyStopping | None = None,
        compiled: bool = False,
        forecast_warns: bool = False,
        schedule: dict[str, Any] | None = None,
        confirm_steps: int | None = None,
    ) -> None:
        self.task, self.model, self.backend, self.budget = task, model, backend, budget
        self.asked = (accuracy_tolerance, prefer, study)
        self.stopping = stopping
        self.compiled = compiled  # every trial under torch.compile (`autoprec.trials.compiled`)
        self.forecast_warns = forecast_warns
        # The trials' schedule and the real run's length (`trial_schedule_settings`).
        self.schedule = dict(schedule or {})
        self.confirm_steps = confirm_steps  # the long confirmation (`autoprec.study.confirm`)

    @classmethod
    def of(
        cls, config: Any, task: Task, model: nn.Module, backend: Backend, budget: Budget
    ) -> TrainingTrials:
        """The mode made from a search's settings (`autoprec.study.config.SearchConfig`)."""
        return cls(
            task=task,
            model=model,
            backend=backend,
            budget=budget,
            accuracy_tolerance=config.accuracy_tolerance,
            prefer=config.prefer,
            study=config.study,
            # Trials launched as several ranks run eager (`--compile` is refused with them).
            compiled=bool(getattr(config, "compile", False) or task.compile)
            and getattr(config, "nproc_per_trial", 1) == 1,
            forecast_warns=config.forecast == "warn",
            schedule=trial_schedule_settings(config),
            confirm_steps=config.confirm_steps,
        )

    @property
    def settings(self) -> dict[str, Any]:
        """What changes what a training trial measures or how it is judged: compiled
        trials' figures are not eager ones', a compressed schedule is not the real one,
        the forecast reaches to the real run's length, and under the guard no trial is
        trained longer (None: unguarded, as studies made before the guard are); the long
        confirmation can change the choice."""
        return {
            "compile": self.compiled,
            "confirm_steps": self.confirm_steps,
            **self.schedule,
            "forecast": "warn" if self.forecast_warns else "infeasible",
            "guard": True if self.budget.guarded else None,
        }

    def fit(self, space: SearchSpace, profile: Profile | None) -> SearchSpace:
        """Training runs under autocast: how it treats these layers is watched first. A
        space without an ``optimizer_states`` section searches the states
        `autoprec.optim.offered` offers too, where it says ``optimizer_states: auto`` or
        the search prefers memory."""
        self.backend.check_training_emulation()
        watch_task(self.task, self.model, self.backend)
        supported = {d for d in formats.names() if self.backend.supports(d)}
        space = self._with_offered_states(space)
        return space.fit(self.model, profile, self.backend, mode=self.mode).restrict(supported)

    def _with_offered_states(self, space: SearchSpace) -> SearchSpace:
        from autoprec.optim.offered import offered_states

        prefers_memory = self.asked[1] == "memory"
        if space.optimizer_states is not None or not (space.auto_states or prefers_memory):
            return space
        optimizer = self.task.make_optimizer(self.model.parameters())
        offered = offered_states(self.model, optimizer)
        notes = space.notes if offered.note is None else (*space.notes, offered.note)
        return replace(space, optimizer_states=offered.states, auto_states=True, notes=notes)

    def choice(self, space: SearchSpace) -> Choice:
        """The space's tolerance unless one was given; speed first; the task's name."""
        tolerance, prefer, study = self.asked
        return Choice(
            Feasibility(
                space.accuracy_tolerance if tolerance is None else tolerance,
                forecast_warns=self.forecast_warns,
            ),
            prefer or "speed",
            study or self.task.name,
        )

    def load(self, out_dir: Path, may_train: bool, on_training: Callable[[Path], None]) -> None:
        """Nothing to ready: every trial trains from the task's initial weights."""

    def profile(self, seed: int) -> Profile:
        from autoprec.profile.sensitivity import profile_task

        return profile_task(self.task, self.backend, seed=seed, steps=3)

    def warm_up(self, space: SearchSpace, limit_s: float) -> None:
        """A short untimed run of every dtype the space uses, once per process (per task,
        device and dtype), so that no trial pays the process's one-time costs (lazy
        imports, thread pools, allocator growth, first kernels) in its timings; its
        results are discarded. It is cut off at ``limit_s``."""
        budget = self.budget
        short = Budget(steps=min(budget.steps, 2 * budget.untimed_steps + 2), seed=budget.seed)
        how = " compiled" if self.compiled else ""  # a compiled run warms up apart
        for dtype in sorted({d for g in space.groups for d in g.dtypes}):
            key = (self.task.name, self.backend.name, dtype + how)
            if key not in TrainingTrials._warm:
                policy = Policy.uniform(dtype)
                run_with_time_limit(
                    lambda: run_trial(self.task, policy, self.backend, short, None, self.compiled),  # noqa: B023
                    limit_s,
                    self.failed,
                )
                TrainingTrials._warm.add(key)

    def judged_against(self, baseline: Result, early_stopping: bool) -> TrainingTrials:
        """These trials, stopped early when they trail the baseline (``early_stopping``)."""
        if not early_stopping or not isinstance(baseline, TrialResult):
            return self
        tolerance, prefer, study = self.asked
        return TrainingTrials(
            task=self.task,
            model=self.model,
            backend=self.backend,
            budget=self.budget,
            accuracy_tolerance=tolerance,
            prefer=prefer,
            study=study,
            stopping=EarlyStopping.from_baseline(baseline),
            compiled=self.compiled,
            forecast_warns=self.forecast_warns,
            schedule=self.schedule,
            confirm_steps=self.confirm_steps,
        )

    def measure(self, policy: Policy) -> TrialResult:
        return run_trial(self.task, policy, self.backend, self.budget, self.stopping, self.compiled)

    def failed(self, reason: str) -> TrialResult:
        return TrialResult(
            TrialState.FAILED,
            reason,
            compiled=self.compiled,
            compute_capability=self.backend.compute_capability(),
        )

    def retime(self, policies: list[Policy]) -> list[float]:
        return time_policies_side_by_side(
            self.task, policies, self.backend, self.budget, compiled=self.compiled
        )

    def layer_table(self, policy: Policy, model: nn.Module) -> list[dict[str, Any]]:
        """What each layer computes in, as a forward under autocast shows it."""
        example = self.task.first_val_batch()
        return policy.layer_table(model, self.backend, mode=self.mode, example=example)

    def summary_settings(self) -> dict[str, Any]:
        return {"checkpoint": None}

    def summary_part(self, feasibility: Feasibility) -> dict[str, Any] | None:
        return None

    def leave_behind(
        self, policy: Policy, out_dir: Path, task_spec: str | None, publish: Publisher
    ) -> dict[str, Any] | None:
        return None
