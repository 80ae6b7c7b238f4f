"""The modes of search: one `Mode` object each, registered once in `MODES`, and everything
that differs between modes behind it.

- ``training``: trials train the task under each policy (the default);
- ``serving``: trials convert a trained fp32 model's weights and serve it (``--mode
  serving``; ``inference``, its earlier name, is still accepted).

A mode is a `Mode` (`autoprec.trials.mode`): its name, its `Trials` class and what the
generic code asks of it (its settings section, its preferences and dtypes, its export
formats, its report view and words, its summary's own part). The generic code (space,
policy, CLI, settings, summary, report, exports, the confirmation) asks the mode object
and never names a mode. A new mode is one `Mode` subclass with its `Trials`, and
`register` (or a line in `MODES`); one with settings of its own also declares their
section in `autoprec.settings` and a `SearchConfig` field. The registry imports nothing
heavy: ``autoprec search --help`` reads the modes' names without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoprec.errors import AutoprecError
from autoprec.trials.mode import Mode, ServingMode, TrainingMode

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

# Every mode by its name: the one registry.
MODES: dict[str, Mode] = {}
DEFAULT_MODE = "training"


def register(mode: Mode) -> Mode:
    """Add ``mode`` to `MODES` under its name (a mode of that name is replaced)."""
    MODES[mode.name] = mode
    return mode


register(TrainingMode())
register(ServingMode())


def mode_named(name: str | None) -> Mode:
    """The mode of that name, or of a name it was known by (``inference``: serving);
    None is the default mode. Any other name is an AutoprecError listing the modes."""
    if name is None:
        return MODES[DEFAULT_MODE]
    found = MODES.get(name) or next((m for m in MODES.values() if name in m.aliases), None)
    if found is None:
        raise AutoprecError(f"--mode: expected {' or '.join(MODES)}, got {name!r}")
    return found


def mode_of(mode: Mode | str | None) -> Mode:
    """A `Mode` as it is, or the mode of that name (None: the default mode)."""
    return mode if isinstance(mode, Mode) else mode_named(mode)


def canonical(name: Any) -> Any:
    """A mode's name as it is now, where ``name`` is one it was known by; anything else
    unchanged (an unknown name is for the caller to refuse in its own words)."""
    for mode in MODES.values():
        if name in mode.aliases:
            return mode.name
    return name


def trials_of(
    mode: str, config: Any, task: Task, model: nn.Module, backend: Backend, budget: Budget
) -> Trials:
    """The mode's trials, made from a search's settings (checked against the task and
    the device where the mode has settings of its own)."""
    return mode_named(mode).trials_class().of(config, task, model, backend, budget)  # type: ignore[no-any-return]
