"""The modes of search: one `Mode` object each, registered once in `MODES`, and everything
that differs between modes behind it.

- ``training``: trials train the task under each policy (the default);
- ``serving``: trials convert a trained fp32 model's weights and serve it (``--mode
  serving``; ``inference``, its earlier name, is still accepted).

A mode is a `Mode`: its name, its `Trials` class and what the generic code asks of it (its
settings section, its preferences and dtypes, its export formats, its report view and
words, its summary's own part). The modes and their registry live in `autoprec.modes`,
below the trials, so that the space and the policy find a mode without importing them;
this package names them too. The generic code (space,
policy, CLI, settings, summary, report, exports, the confirmation) asks the mode object
and never names a mode. A new mode is one `Mode` subclass with its `Trials`, and
`register` (or a line in `MODES`); one with settings of its own also declares their
section in `autoprec.settings` and a `SearchConfig` field. The registry imports nothing
heavy: ``autoprec search --help`` reads the modes' names without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoprec.modes import DEFAULT_MODE, MODES, Mode, canonical, mode_named, mode_of, register

if TYPE_CHECKING:
    from torch import nn

    from autoprec.devices import Backend
    from autoprec.tasks import Task
    from autoprec.trials.base import Trials
    from autoprec.trials.training import Budget

__all__ = [
    "DEFAULT_MODE",
    "MODES",
    "Mode",
    "canonical",
    "mode_named",
    "mode_of",
    "register",
    "trials_of",
]


def trials_of(
    mode: str, config: Any, task: Task, model: nn.Module, backend: Backend, budget: Budget
) -> Trials:
    """The mode's trials, made from a search's settings (checked against the task and
    the device where the mode has settings of its own)."""
    return mode_named(mode).trials_class().of(config, task, model, backend, budget)  # type: ignore[no-any-return]
