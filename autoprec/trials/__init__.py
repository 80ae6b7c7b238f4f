"""The modes of search, one module each: what a trial is and everything else that differs
between modes, behind the `Trials` protocol (`autoprec.trials.base`).

- `training`: trials train the task under each policy (the default);
- `serving`: trials convert a trained fp32 model's weights and serve it
  (``--mode inference``).

A mode is found by its name in `MODES` and made with its class's ``of(config, task,
model, backend, budget)``. A new mode is one new module with a `Trials` class, and its
line here. The modules load on first use, so that reading the names costs nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from autoprec.devices import Backend
    from autoprec.tasks import Task
    from autoprec.trials.base import Trials
    from autoprec.trials.training import Budget

# --mode name -> "module:class" of its Trials, and the SearchConfig field (None: none)
# holding its own settings.
MODES: dict[str, tuple[str, str | None]] = {
    "training": ("autoprec.trials.training:TrainingTrials", None),
    "inference": ("autoprec.trials.serving:ServingTrials", "serving"),
}


def trials_class(mode: str) -> type[Any]:
    """The `Trials` class of a mode named in `MODES`."""
    module, _, name = MODES[mode][0].partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def trials_of(
    mode: str, config: Any, task: Task, model: nn.Module, backend: Backend, budget: Budget
) -> Trials:
    """The mode's trials, made from a search's settings (checked against the task and
    the device where the mode has settings of its own)."""
    return trials_class(mode).of(config, task, model, backend, budget)  # type: ignore[no-any-return]
