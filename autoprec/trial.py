"""One trial: train a task under a policy for a fixed budget and measure it.

Pure: no Optuna, no MLflow, no global state left behind. Every trial of a search
starts from the task's same initial weights (torch seed), sees the same batches in the
same order, and is evaluated on the same validation data, so results differ only by
policy. A trial never raises for a numerical or runtime problem: a non-finite loss
ends it as ``pruned`` and an exception as ``failed``, with the reason kept.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autoprec.devices import Backend
from autoprec.errors import AutoprecError, TaskError
from autoprec.policy import Policy
from autoprec.precision import Precision
from autoprec.tasks import Task
from autoprec.telemetry import UnderflowCount

# With loss scaling, a few non-finite losses in a row are survivable: the scaler skips
# those steps. More than this many in a row means the policy does not train.
NONFINITE_PATIENCE = 5
FINAL_LOSS_WINDOW = 5
# Timed steps per policy and round when candidates are re-timed side by side.
SIDE_BY_SIDE_BLOCK = 20


@dataclass(frozen=True)
class Budget:
    """How long a trial trains. The first ``warmup_steps`` steps are not timed."""

    steps: int = 200
    warmup_steps: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 2:
            raise AutoprecError(f"steps: must be an integer of at least 2, got {self.steps!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise AutoprecError(
                f"warmup_steps: must be a non-negative integer, got {self.warmup_steps!r}"
            )

    @property
    def untimed_steps(self) -> int:
        return min(self.warmup_steps, self.steps // 2)


@dataclass
class TrialResult:
    """What a trial measured. Metric names are the ones used everywhere (DESIGN.md)."""

    state: str  # "complete", "pruned" or "failed"
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

    METRICS = (
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

    def metrics(self) -> dict[str, float]:
        """The numeric metrics that were measured (None and non-finite values left out)."""
        values = {name: getattr(self, name) for name in self.METRICS}
        return {k: float(v) for k, v in values.items() if v is not None and math.isfinite(float(v))}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def run_trial(task: Task, policy: Policy, backend: Backend, budget: Budget) -> TrialResult:
    """Train ``task`` under ``policy`` on ``backend`` for ``budget``; never raises for a
    problem of the trial itself (bad input to autoprec still raises AutoprecError)."""
    started = time.perf_counter()
    try:
        result = _train_and_evaluate(task, policy, backend, budget)
    except AutoprecError:
        raise
    except torch.OutOfMemoryError as error:
        result = TrialResult("failed", f"out of memory: {str(error).splitlines()[0]}")
    except Exception as error:
        first_line = (str(error).splitlines() or [""])[0]
        result = TrialResult("failed", f"{type(error).__name__}: {first_line}"[:500])
    finally:
        if backend.kind != "cpu":
            getattr(torch, backend.kind).empty_cache()
    result.run_time_s = time.perf_counter() - started
    return result


def _train_and_evaluate(
    task: Task, policy: Policy, backend: Backend, budget: Budget
) -> TrialResult:
    torch.manual_seed(budget.seed)
    model = task.model().to(backend.device)
    model.train()
    optimizer = task.make_optimizer(model.parameters())
    prec = policy.apply(model, backend)
    result = TrialResult(
        "complete",
        peak_memory_is_estimate=backend.memory_meter().is_estimate,
        low_precision_share=policy.low_precision_share(model),
        switches=dict(prec.switches),
    )
    meter = backend.memory_meter()
    meter.start(model)
    underflow = UnderflowCount()
    step_times_s: list[float] = []
    batches = iter(task.train_data(budget.seed))
    nonfinite_in_a_row = 0
    try:
        for step in range(budget.steps):
            try:
                inputs, targets = next(batches)
            except StopIteration:
                raise TaskError(
                    f"task {task.name!r}: train_data ran out after {step} batches "
                    f"(the budget needs {budget.steps})"
                ) from None
            inputs, targets = inputs.to(backend.device), targets.to(backend.device)
            timed = step >= budget.untimed_steps
            scale_used = prec.loss_scale
            with contextlib.nullcontext() if timed else meter.step():
                started_s = backend.now_s() if timed else 0.0
                loss, stepped = _train_step(task, model, optimizer, prec, inputs, targets)
                if timed:
                    step_times_s.append(backend.now_s() - started_s)
            loss_value = float(loss.detach())
            result.steps_run = step + 1
            result.losses.append(loss_value)
            result.loss_scales.append(scale_used)
            result.overflow_steps += 0 if stepped else 1
            if math.isfinite(loss_value):
                nonfinite_in_a_row = 0
                if stepped:
                    underflow.add(
                        (p.grad for p in model.parameters() if p.grad is not None), scale_used
                    )
                continue
            result.nonfinite_steps += 1
            nonfinite_in_a_row += 1
            if not policy.loss_scale.enabled:
                result.state = "pruned"
                result.reason = f"non-finite loss ({loss_value}) at step {step}, no loss scaling"
                break
            if nonfinite_in_a_row >= NONFINITE_PATIENCE:
                result.state = "pruned"
                result.reason = (
                    f"non-finite loss in {nonfinite_in_a_row} steps in a row (to step {step})"
                )
                break
        result.grad_underflow_ratio = underflow.ratio
        result.peak_memory_mb = meter.peak_mb(model, optimizer)
        if step_times_s:
            result.step_time_ms = statistics.median(step_times_s) * 1000.0
        finite = [v for v in result.losses if math.isfinite(v)]
        if finite:
            result.final_loss = statistics.fmean(finite[-FINAL_LOSS_WINDOW:])
        if result.state == "complete":
            result.accuracy = _evaluate(task, model, prec, backend)
        return result
    finally:
        prec.remove()


def _train_step(
    task: Task,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    prec: Precision,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, bool]:
    """One training step, exactly as a user's loop would run it under the policy."""
    optimizer.zero_grad(set_to_none=True)
    with prec.autocast():
        outputs = model(inputs)
    loss = task.loss(outputs.float(), targets)
    prec.backward(loss)
    return loss, prec.step(optimizer)


def time_side_by_side(
    task: Task, policies: list[Policy], backend: Backend, budget: Budget, rounds: int = 3
) -> list[float]:
    """Median step time (ms) of each policy, measured in alternating blocks.

    Separate trials run minutes apart on a shared machine and drift by 10-20%; timing
    the candidates in turn, round after round, exposes them to the same conditions.
    Each policy trains its own copy of the model from the same initial weights.
    """
    runs = []
    for policy in policies:
        torch.manual_seed(budget.seed)
        model = task.model().to(backend.device).train()
        optimizer = task.make_optimizer(model.parameters())
        runs.append((policy, model, optimizer, policy.apply(model, backend)))
    block = max(1, min(SIDE_BY_SIDE_BLOCK, (budget.steps - budget.untimed_steps) // rounds))
    data = iter(task.train_data(budget.seed))
    batches = [
        tuple(t.to(backend.device) for t in next(data)) for _ in range(budget.untimed_steps + block)
    ]
    times_s: list[list[float]] = [[] for _ in runs]
    try:
        for round_index in range(rounds + 1):  # round 0 warms up, untimed
            for times, (policy, model, optimizer, prec) in zip(times_s, runs, strict=True):
                previous = backend.set_switches(policy.tf32, policy.hf32)
                for i, (inputs, targets) in enumerate(batches):
                    if round_index == 0 and i >= budget.untimed_steps:
                        break
                    if round_index > 0 and i < budget.untimed_steps:
                        continue
                    started_s = backend.now_s()
                    _train_step(task, model, optimizer, prec, inputs, targets)
                    if round_index > 0:
                        times.append(backend.now_s() - started_s)
                backend.restore_switches(previous)
    finally:
        for _, _, _, prec in runs:
            prec.remove()
    return [statistics.median(times) * 1000.0 for times in times_s]


def _evaluate(task: Task, model: torch.nn.Module, prec: Any, backend: Backend) -> float:
    model.eval()
    total = 0.0
    count = 0
    with torch.no_grad(), prec.autocast():
        for inputs, targets in task.val_data():
            outputs = model(inputs.to(backend.device)).float()
            n = len(targets)
            total += task.score(outputs, targets.to(backend.device)) * n
            count += n
    if count == 0:
        raise TaskError(f"task {task.name!r}: val_data yielded no batches")
    return total / count
