"""The Task contract: a model, its data, its loss and metric, and how batches call it."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec._util.structures import (
    cast_floats,
    describe,
    first_tensor,
    map_tensors,
    tensors,
    to_device,
)
from autoprec.errors import TaskError, first_line

RawBatch = Any  # (inputs, targets), or one mapping (transformers style)
IGNORE_INDEX = -100  # targets with this value are not scored (transformers' convention)
METRICS = ("accuracy", "next_token_accuracy")


@dataclass(frozen=True)
class Batch:
    """One batch as the model is called with it: ``model(*args, **kwargs)``, and the
    targets that the loss and the metric receive.

    A raw batch is ``(inputs, targets)``, with ``inputs`` a tensor (``model(x)``), a
    tuple or list (``model(*x)``) or a mapping (``model(**x)``); or a single mapping, as
    transformers' Trainer feeds it (``model(**batch)``, targets ``batch.get("labels")``).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    targets: Any
    raw_inputs: Any  # what the task gave as inputs, for messages

    @classmethod
    def of(cls, raw: RawBatch) -> Batch:
        if isinstance(raw, Mapping):
            return cls((), dict(raw), raw.get("labels"), raw)
        if not isinstance(raw, tuple | list) or len(raw) != 2:
            raise TaskError(
                f"a batch must be (inputs, targets) or a mapping of model arguments, "
                f"got {describe(raw)}"
            )
        inputs, targets = raw
        if isinstance(inputs, Mapping):
            return cls((), dict(inputs), targets, inputs)
        if isinstance(inputs, tuple | list) and not hasattr(inputs, "_fields"):
            return cls(tuple(inputs), {}, targets, inputs)
        return cls((inputs,), {}, targets, inputs)

    def run(self, model: nn.Module) -> Any:
        return model(*self.args, **self.kwargs)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            to_device(self.args, device),
            to_device(self.kwargs, device),
            to_device(self.targets, device),
            self.raw_inputs,
        )

    @property
    def size(self) -> int:
        """Samples in the batch: the first dimension of its first input tensor."""
        first = first_tensor((self.args, self.kwargs))
        return int(first.shape[0]) if first is not None and first.dim() > 0 else 1

    def head(self, samples: int) -> Batch:
        """The first ``samples`` samples, where every tensor is batch-first (the same first
        dimension throughout); else the whole batch."""
        size = self.size
        everything = list(tensors((self.args, self.kwargs, self.targets)))
        if size <= samples or any(t.dim() == 0 or t.shape[0] != size for t in everything):
            return self
        cut = partial(map_tensors, lambda t: t[:samples])
        return Batch(cut(self.args), cut(self.kwargs), cut(self.targets), self.raw_inputs)

    def mismatch(self, model: nn.Module) -> str | None:
        """Why the model's forward cannot be called with this batch, if it cannot."""
        try:
            signature = inspect.signature(model.forward)
        except (TypeError, ValueError):
            return None
        try:
            signature.bind(*self.args, **self.kwargs)
        except TypeError:
            return self.describe(model)
        return None

    def describe(self, model: nn.Module) -> str:
        """``inputs is a dict with keys [...]; the model's forward takes (...)``."""
        try:
            takes = ", ".join(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            takes = "?"
        return f"inputs is {describe(self.raw_inputs)}; the model's forward takes ({takes})"


@dataclass
class Task:
    """A model and the data to train and validate it on.

    - ``model``: zero-argument callable returning a fresh fp32 module (the same initial
      weights for the same torch seed).
    - ``train_data``: ``(seed) -> iterable of batches``, long enough for the trial budget
      (cycling is the task's business). A batch is ``(inputs, targets)`` with ``inputs``
      a tensor, a tuple/list (positional arguments) or a mapping (keyword arguments); or
      one mapping of keyword arguments whose ``labels`` are the targets. Tensors may be on
      the CPU: autoprec moves them. Across several ranks it may take ``(seed, rank,
      world)`` and yield that rank's batches; a ``train_data(seed)`` yields global
      batches, which each rank slices (`autoprec.shard`).
    - ``val_data``: zero-argument callable returning an iterable of batches of that form.
    - ``loss``: ``(outputs, targets) -> scalar tensor``, given the outputs with every
      floating tensor in fp32 (container types kept: a ``ModelOutput`` stays one); None
      when the model computes its own loss (``outputs.loss``, or ``outputs[0]``).
    - ``metric``: ``"accuracy"`` (argmax of the logits against the targets, positions
      whose target is -100 left out), ``"next_token_accuracy"`` (the same, each position
      predicting the next target: causal language models) or
      ``(outputs, targets) -> float``; higher is better.
    - ``optimizer``: ``(params) -> torch.optim.Optimizer``; Adam with lr 1e-3 if None.
    - ``scheduler``: ``(optimizer) -> LR scheduler``, stepped after every optimizer step
      that was taken (not skipped by the loss scaler); None for none. autoprec also makes
      one on a throwaway optimizer to read the schedule ahead (the search's warm-up
      warning, a trial's forecast), stepping only it: no optimizer step is taken.
    - ``clip_grad_norm``: clip the gradients' total norm to this (after unscaling).
    - ``accumulate``: batches per optimizer step (gradient accumulation).
    - ``checkpoint``: a file of trained fp32 weights (a state dict), which a serving search
      (``--mode serving``) converts instead of training the model itself.
    - ``compile``: train every trial under ``torch.compile`` (as ``--compile`` asks;
      `autoprec.trials.compiled`), for a model that is trained compiled.
    """

    name: str
    model: Callable[[], nn.Module]
    train_data: Callable[[int], Iterable[RawBatch]]
    val_data: Callable[[], Iterable[RawBatch]]
    loss: Callable[[Any, Any], torch.Tensor] | None
    metric: str | Callable[[Any, Any], float] = "accuracy"
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    clip_grad_norm: float | None = None
    accumulate: int = 1
    checkpoint: str | Path | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TaskError("Task.name: expected a non-empty string")
        for field_name in ("model", "train_data", "val_data"):
            if not callable(getattr(self, field_name)):
                raise TaskError(f"Task {self.name!r}: {field_name} must be callable")
        if self.loss is not None and not callable(self.loss):
            raise TaskError(f"Task {self.name!r}: loss must be callable, or None (the model's)")
        if not (self.metric in METRICS or callable(self.metric)):
            raise TaskError(
                f"Task {self.name!r}: metric must be one of {', '.join(METRICS)} or a callable"
            )
        for field_name in ("optimizer", "scheduler"):
            value = getattr(self, field_name)
            if value is not None and not callable(value):
                raise TaskError(f"Task {self.name!r}: {field_name} must be callable or None")
        clip = self.clip_grad_norm
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0
        ):
            raise TaskError(f"Task {self.name!r}: clip_grad_norm must be a positive number")
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int):
            raise TaskError(f"Task {self.name!r}: accumulate must be a positive integer")
        if self.accumulate < 1:
            raise TaskError(f"Task {self.name!r}: accumulate must be a positive integer")
        if not isinstance(self.compile, bool):
            raise TaskError(f"Task {self.name!r}: compile must be True or False")

    def batch(self, raw: RawBatch) -> Batch:
        """A raw batch of this task's data as the model is called with it."""
        try:
            return Batch.of(raw)
        except TaskError as error:
            raise TaskError(f"task {self.name!r}: {error}") from None

    def first_val_batch(self) -> Batch:
        """The first validation batch, as the model is called with it: the example every
        watched forward, served-model signature and export reads."""
        raw = next(iter(self.val_data()), None)
        if raw is None:
            raise TaskError(f"task {self.name!r}: val_data yielded no batch")
        return self.batch(raw)

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.optimizer is None:
            return torch.optim.Adam(params, lr=1e-3)
        return self.optimizer(params)

    def make_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        return None if self.scheduler is None else self.scheduler(optimizer)

    def compute_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The loss in fp32: the task's, on the outputs cast up, or the model's own."""
        outputs = cast_floats(outputs, torch.float32)
        if self.loss is not None:
            return self.loss(outputs, targets)
        loss = _field(outputs, "loss", index=0)
        if not isinstance(loss, torch.Tensor):
            raise TaskError(
                f"task {self.name!r}: loss=None, but the model returned {describe(outputs)} "
                "with no loss (pass labels in the batch, or give the task a loss)"
            )
        return loss

    def score(self, outputs: Any, targets: Any) -> float:
        """The metric on one batch of outputs (floating tensors in fp32) and targets."""
        if callable(self.metric):
            return float(self.metric(outputs, targets))
        logits = logits_of(outputs)
        if not isinstance(targets, torch.Tensor) or logits is None:
            raise TaskError(
                f"task {self.name!r}: metric {self.metric!r} compares the logits with "
                f"target class indices; got outputs {describe(outputs)} and targets "
                f"{describe(targets)} (give the task a metric callable)"
            )
        if self.metric == "next_token_accuracy":
            logits, targets = logits[..., :-1, :], targets[..., 1:]
        scored = targets != IGNORE_INDEX
        hits = (logits.argmax(dim=-1) == targets) & scored
        return float(hits.sum()) / max(int(scored.sum()), 1)


def _field(value: Any, name: str, index: int) -> Any:
    """A named field of a model output (attribute or key), or its ``index``-th item."""
    if isinstance(value, Mapping):
        return value.get(name)
    if hasattr(value, name):
        return getattr(value, name)
    if isinstance(value, tuple | list) and len(value) > index:
        return value[index]
    return value if index == 0 and isinstance(value, torch.Tensor) else None


def logits_of(outputs: Any) -> torch.Tensor | None:
    """The logits of a model output: the tensor itself, its ``logits`` field, or the first
    tensor of a tuple that is not a scalar (a tuple may start with the loss)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = _field(outputs, "logits", index=-1)
    if isinstance(logits, torch.Tensor):
        return logits
    return next((t for t in tensors(outputs) if t.dim() > 0), None)


def check_task_data(task: Task, model: nn.Module, steps: int, seed: int) -> None:
    """Draw the batches a trial needs and run one forward, loss and metric in fp32, so
    that bad data fails before any store is opened, with one line that says why."""
    needed = steps * task.accumulate
    batch = None
    try:
        batches = iter(task.train_data(seed))
        for index in range(needed):
            raw = next(batches, None)
            if raw is None:
                raise TaskError(
                    f"task {task.name!r}: train_data ran out after {index} batches "
                    f"(the budget needs {needed})"
                )
            if index == 0:
                batch = task.batch(raw)
                _check_batch(task, model, batch)
        first_val = next(iter(task.val_data()), None)
        if first_val is None:
            raise TaskError(f"task {task.name!r}: val_data yielded no batches")
        batch = task.batch(first_val)
        with torch.no_grad():
            task.score(cast_floats(batch.run(model), torch.float32), batch.targets)
    except TaskError:
        raise
    except Exception as error:  # the task's own code: any error is its
        where = f"; {batch.describe(model)}" if batch is not None else ""
        raise TaskError(
            f"task {task.name!r}: a first training step failed ({type(error).__name__}: "
            f"{first_line(error)}){where}"
        ) from None


def _check_batch(task: Task, model: nn.Module, batch: Batch) -> None:
    mismatch = batch.mismatch(model)
    if mismatch is not None:
        raise TaskError(f"task {task.name!r}: the model cannot take a batch: {mismatch}")
    with torch.no_grad():
        outputs = batch.run(model)
        loss = task.compute_loss(outputs, batch.targets)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TaskError(
            f"task {task.name!r}: the loss must be a scalar tensor, got {describe(loss)}"
        )
    refuse_nan_outputs(task, outputs, "on its first training batch")
    if not torch.isfinite(loss).all():
        raise TaskError(f"task {task.name!r}: the fp32 loss on the first batch is {loss.item()}")


def refuse_nan_outputs(task: Task, outputs: Any, when: str) -> None:
    """A model whose fp32 outputs hold NaN measures nothing: say so before any store
    opens, rather than after the fp32 baseline has trained (-inf, as attention masks
    write it, is left alone)."""
    if any(t.is_floating_point() and bool(t.isnan().any()) for t in tensors(outputs)):
        raise TaskError(f"task {task.name!r}: the fp32 model's outputs are NaN {when}")


def check_task(task: Task) -> nn.Module:
    """Build the task's model once and check the contract; returns the model."""
    try:
        model = task.model()
    except Exception as error:  # the task's own code: any error is its
        raise TaskError(
            f"task {task.name!r}: model() raised {type(error).__name__}: {error}"
        ) from None
    if not isinstance(model, nn.Module):
        raise TaskError(
            f"task {task.name!r}: model() returned {type(model).__name__}, not an nn.Module"
        )
    if next(model.parameters(), None) is None:
        raise TaskError(f"task {task.name!r}: the model has no parameters to train")
    wrong = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if wrong:
        raise TaskError(
            f"task {task.name!r}: parameter {wrong[0]} is not fp32; models start in fp32"
        )
    return model
