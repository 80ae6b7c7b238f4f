"""A task's learning-rate schedule as short trials see it (``--trial-schedule``).

A task's ``scheduler`` is built for the real run, N steps long (``train_steps``). A trial
of a few hundred steps then sees only the start of it: often only the warm-up, at a small
learning rate, where nothing grows yet. So the schedule's shape is learnt by stepping a
throwaway copy to N (`learn_lr_shape`); a trial that ends before the peak learning rate
gets one warning naming the share of the warm-up it saw (`schedule_warning`). With
``compressed`` each trial runs the same shape squeezed into its steps: the real scheduler,
stepped N/steps times per trial step (`CompressedScheduler`), so that the learning rate
(and whatever else the scheduler sets, OneCycleLR's momentum) at trial step i is the real
run's at step i*N/steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autoprec.errors import TaskError, first_line

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autoprec.tasks import Task

TRIAL_SCHEDULES = ("as-is", "compressed")
# Without --train-steps the real run is taken as this many times a trial's steps.
DEFAULT_TRAIN_STEPS_PER_TRIAL_STEP = 10
# --train-steps at most: a million optimizer steps, past most real runs' schedules. The
# schedule is learnt (and a compressed trial steps it) that far, a few seconds of
# scheduler steps; its shape keeps at most MAX_LR_SAMPLES rates.
MAX_TRAIN_STEPS = 1_000_000
MAX_LR_SAMPLES = 4096


def train_steps_of(config: Any) -> int:
    """How long the real run is: the search's ``train_steps``, else 10x a trial's steps."""
    given = getattr(config, "train_steps", None)
    return int(given) if given else DEFAULT_TRAIN_STEPS_PER_TRIAL_STEP * config.steps


@dataclass(frozen=True)
class LRShape:
    """The learning rate of the optimizer's first parameter group over the real run, to
    ``steps`` steps (N, or where the scheduler refused to go on: ``stopped`` says why).
    ``lrs[i]`` is the rate step ``i * stride`` trains with: at most `MAX_LR_SAMPLES` + 1
    rates, evenly spaced, so that a long run is learnt in bounded memory. The peak (its
    first step) and ``head_peak_lr``, the largest rate of the first ``head`` steps (a
    trial's), are exact."""

    lrs: tuple[float, ...]
    steps: int
    peak_step: int
    peak_lr: float
    stride: int = 1
    head: int = 0
    head_peak_lr: float | None = None
    stopped: str | None = None

    def warmup_seen(self, trial_steps: int) -> float | None:
        """The share of the warm-up a trial of ``trial_steps`` steps trains through, when
        it ends before the peak; None when it reaches the peak (or there is no warm-up)."""
        peak = self.peak_step
        if trial_steps > peak:
            return None
        return trial_steps / peak


def learn_lr_shape(task: Task, model: nn.Module, train_steps: int, head: int = 0) -> LRShape | None:
    """The task's schedule stepped to ``train_steps`` (at most `MAX_TRAIN_STEPS`) on a
    throwaway optimizer over the model's parameters (no optimizer step is taken, so the
    model is left as it is), keeping evenly spaced rates and the largest of the first
    ``head`` steps; None for a task without a scheduler."""
    if task.scheduler is None:
        return None
    try:
        optimizer = task.make_optimizer(model.parameters())
        scheduler = task.make_scheduler(optimizer)
    except Exception as error:  # the task's own code: any error is its
        raise TaskError(
            f"task {task.name!r}: its scheduler could not be made "
            f"({type(error).__name__}: {first_line(error)})"
        ) from None
    train_steps = min(train_steps, MAX_TRAIN_STEPS)
    stride = max(1, -(-train_steps // MAX_LR_SAMPLES))
    lr = _lr(optimizer)
    lrs, peak_step, peak_lr = [lr], 0, lr
    head_peak = lr if head > 0 else None
    stopped, steps = None, train_steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        for step in range(1, train_steps + 1):
            try:
                scheduler.step()
            except Exception as error:  # OneCycleLR past its total_steps, say
                stopped = f"it stops at step {step - 1} ({first_line(error)})"
                steps = step - 1
                break
            lr = _lr(optimizer)
            if lr > peak_lr:
                peak_step, peak_lr = step, lr
            if step < head and head_peak is not None:
                head_peak = max(head_peak, lr)
            if step % stride == 0:
                lrs.append(lr)
    return LRShape(tuple(lrs), steps, peak_step, peak_lr, stride, head, head_peak, stopped)


def _lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def schedule_warning(task: Task, model: nn.Module, config: Any) -> str | None:
    """The one warning for trials that end before the schedule's peak learning rate: what
    share of the warm-up they see, and what to do; or, for ``--trial-schedule compressed``
    on a task without a scheduler, that there is nothing to compress (its trials are the
    same as-is; the study records what was asked). None when the trials see the peak, run
    the compressed schedule, or the task has no scheduler and no schedule was asked."""
    if task.scheduler is None:
        if config.trial_schedule != "compressed":
            return None
        return (
            f"--trial-schedule compressed: task {task.name!r} has no learning-rate "
            "scheduler to compress; its trials train at its optimizer's own rate"
        )
    if config.trial_schedule == "compressed":
        return None
    train_steps = train_steps_of(config)
    shape = learn_lr_shape(task, model, train_steps, head=config.steps)
    if shape is None:
        return None
    seen = shape.warmup_seen(config.steps)
    if seen is None:
        return None
    trial_peak = shape.head_peak_lr or shape.lrs[0]
    return (
        f"task {task.name!r}: its learning rate warms up to {shape.peak_lr:.3g} at step "
        f"{shape.peak_step} of the real run's {train_steps} (--train-steps); a trial of "
        f"{config.steps} steps sees {seen:.0%} of the warm-up, at learning rates up to "
        f"{trial_peak:.3g}, so what the larger rates make grow is not measured "
        "(--trial-schedule compressed squeezes the schedule into the trial's steps)"
    )


class CompressedScheduler:
    """The real scheduler, stepped so that trial step i runs at the real run's step
    ``i * train_steps // trial_steps``: ``train_steps / trial_steps`` real steps per
    trial step, never past ``train_steps``."""

    def __init__(self, real: Any, trial_steps: int, train_steps: int) -> None:
        self.real, self.trial_steps, self.train_steps = real, trial_steps, train_steps
        self.trial_step = 0
        self.real_step = 0

    def step(self) -> None:
        self.trial_step += 1
        target = min(self.trial_step * self.train_steps // self.trial_steps, self.train_steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # several steps after one optimizer step
            while self.real_step < target:
                self.real.step()
                self.real_step += 1

    def get_last_lr(self) -> list[float]:
        return self.real.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return {
            "real": self.real.state_dict(),
            "trial_step": self.trial_step,
            "real_step": self.real_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.real.load_state_dict(state["real"])
        self.trial_step, self.real_step = state["trial_step"], state["real_step"]


@dataclass(frozen=True)
class CompressedSchedule:
    """A task's scheduler factory made compressed: ``(optimizer) -> CompressedScheduler``
    over the real one (kept as ``real``, for runs as long as the real one)."""

    real: Callable[[torch.optim.Optimizer], Any]
    trial_steps: int
    train_steps: int

    def __call__(self, optimizer: torch.optim.Optimizer) -> CompressedScheduler:
        return CompressedScheduler(self.real(optimizer), self.trial_steps, self.train_steps)


def for_trials(task: Task, model: nn.Module, config: Any) -> Task:
    """The task as the search's trials train it: with ``compressed``, its schedule
    squeezed into the trials' steps (to where the real scheduler goes, if short of N)."""
    if config.trial_schedule != "compressed" or task.scheduler is None:
        return task
    shape = learn_lr_shape(task, model, train_steps_of(config))
    assert shape is not None
    return replace(task, scheduler=CompressedSchedule(task.scheduler, config.steps, shape.steps))


def real_task(task: Task) -> Task:
    """The task with the schedule the real run has (a compressed one undone)."""
    if isinstance(task.scheduler, CompressedSchedule):
        return replace(task, scheduler=task.scheduler.real)
    return task


def trial_schedule_settings(config: Any) -> dict[str, Any]:
    """What a study's trials are identified by of the schedule: the one asked for (a
    compressed one on a task without a scheduler trains as-is, but the study records what
    was asked, so that a continuation that asks otherwise is refused), and the real run's
    length, to which the compressed schedule and the range forecast reach."""
    return {
        "trial_schedule": config.trial_schedule,
        "train_steps": train_steps_of(config),
    }
