"""The Task contract, and loading a task named on the command line."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.errors import TaskError

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Task:
    """A model and the data to train and validate it on.

    - ``model``: zero-argument callable returning a fresh fp32 module (the same initial
      weights for the same torch seed).
    - ``train_data``: ``(seed) -> iterable of (inputs, targets)`` CPU tensors, long
      enough for the trial budget (cycling is the task's business).
    - ``val_data``: zero-argument callable returning an iterable of ``(inputs, targets)``.
    - ``loss``: ``(outputs, targets) -> scalar tensor``; autoprec computes it in fp32.
    - ``metric``: ``"accuracy"`` or ``(outputs, targets) -> float``, higher is better.
    - ``optimizer``: ``(params) -> torch.optim.Optimizer``; Adam with lr 1e-3 if None.
    """

    name: str
    model: Callable[[], nn.Module]
    train_data: Callable[[int], Iterable[Batch]]
    val_data: Callable[[], Iterable[Batch]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metric: str | Callable[[torch.Tensor, torch.Tensor], float] = "accuracy"
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TaskError("Task.name: expected a non-empty string")
        for field_name in ("model", "train_data", "val_data", "loss"):
            if not callable(getattr(self, field_name)):
                raise TaskError(f"Task {self.name!r}: {field_name} must be callable")
        if not (self.metric == "accuracy" or callable(self.metric)):
            raise TaskError(f"Task {self.name!r}: metric must be 'accuracy' or a callable")
        if self.optimizer is not None and not callable(self.optimizer):
            raise TaskError(f"Task {self.name!r}: optimizer must be callable or None")

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.optimizer is None:
            return torch.optim.Adam(params, lr=1e-3)
        return self.optimizer(params)

    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The metric on one batch of outputs (fp32) and targets."""
        if self.metric == "accuracy":
            return float((outputs.argmax(dim=-1) == targets).float().mean())
        return float(self.metric(outputs, targets))  # type: ignore[operator]


def load_task(spec: str) -> Task:
    """A task by built-in name, ``package.module:attr`` or ``path/to/file.py:attr``.

    ``attr`` is a Task or a zero-argument callable returning one.
    """
    from autoprec.tasks.builtin import BUILTIN_TASKS

    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]()
    if ":" not in spec:
        names = ", ".join(sorted(BUILTIN_TASKS))
        raise TaskError(
            f"task {spec!r}: expected a built-in name ({names}), "
            "package.module:attr or path/to/file.py:attr"
        )
    target, attr = spec.rsplit(":", 1)
    module = _import_file(target, spec) if target.endswith(".py") else _import_module(target, spec)
    if not hasattr(module, attr):
        raise TaskError(f"task {spec!r}: {target} has no attribute {attr!r}")
    value = getattr(module, attr)
    if not isinstance(value, Task) and callable(value):
        try:
            value = value()
        except TaskError:
            raise
        except Exception as error:
            raise TaskError(
                f"task {spec!r}: {attr}() raised {type(error).__name__}: {error}"
            ) from None
    if not isinstance(value, Task):
        raise TaskError(
            f"task {spec!r}: {attr} is a {type(value).__name__}, "
            "expected an autoprec.Task or a callable returning one"
        )
    return value


def _import_module(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as error:
        raise TaskError(
            f"task {spec!r}: cannot import {name} ({type(error).__name__}: {error})"
        ) from None


def _import_file(path_text: str, spec: str) -> Any:
    path = Path(path_text)
    if not path.is_file():
        raise TaskError(f"task {spec!r}: no such file {path}")
    module_name = f"_autoprec_task_{path.stem}_{abs(hash(str(path.resolve())))}"
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    if file_spec is None or file_spec.loader is None:
        raise TaskError(f"task {spec!r}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise TaskError(
            f"task {spec!r}: {path} failed to import ({type(error).__name__}: {error})"
        ) from None
    return module


def check_task_data(task: Task, model: nn.Module, steps: int, seed: int) -> None:
    """Draw the batches a trial needs and run one forward and loss in fp32, so that bad
    data fails before any store is opened."""
    try:
        batches = iter(task.train_data(seed))
        for step in range(steps):
            batch = next(batches, None)
            if batch is None:
                raise TaskError(
                    f"task {task.name!r}: train_data ran out after {step} batches "
                    f"(the budget needs {steps})"
                )
            if step == 0:
                inputs, targets = batch
                with torch.no_grad():
                    loss = task.loss(model(inputs).float(), targets)
                if loss.numel() != 1:
                    raise TaskError(f"task {task.name!r}: loss must return a scalar")
        if next(iter(task.val_data()), None) is None:
            raise TaskError(f"task {task.name!r}: val_data yielded no batches")
    except TaskError:
        raise
    except Exception as error:
        first_line = (str(error).splitlines() or [""])[0]
        raise TaskError(
            f"task {task.name!r}: a first training step failed ({type(error).__name__}: "
            f"{first_line})"
        ) from None


def check_task(task: Task) -> nn.Module:
    """Build the task's model once and check the contract; returns the model."""
    try:
        model = task.model()
    except Exception as error:
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
