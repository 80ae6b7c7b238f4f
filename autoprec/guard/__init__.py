"""The guard: a watcher in the user's own run that promotes a layer before it fails, rolls
back what it must, and records every change.

``prec = policy.apply(model, guard=Guard())`` returns a `GuardedPrecision`; the loop stays
the loop (``docs/guard.md``). `Guard` is the settings (plain data, a policy's ``guard:``
section); `Change` one recorded change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoprec.guard.settings import Guard

if TYPE_CHECKING:
    from autoprec.guard.changes import Change
    from autoprec.guard.precision import GuardedPrecision

__all__ = ["Change", "Guard", "GuardedPrecision"]


def __getattr__(name: str) -> Any:
    # The settings are torch-free; what runs them loads on first use.
    if name == "Change":
        from autoprec.guard.changes import Change

        return Change
    if name == "GuardedPrecision":
        from autoprec.guard.precision import GuardedPrecision

        return GuardedPrecision
    raise AttributeError(f"module 'autoprec.guard' has no attribute {name!r}")
