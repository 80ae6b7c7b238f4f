"""Figures measured on an emulated dtype, and the one label every view puts on them.

``--emulate fp8`` runs torchao's float8 on the CPU: its numerics are real
(``torch._scaled_mm`` runs), its speed and memory are the CPU's, no fp8 device's. A trial
whose policy names an emulated dtype records it (`emulated_dtypes`), and the console
table, summary.json's entries and the HTML report label it with `emulated_label`, so that
nobody reads an emulated step time as a device's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autoprec.devices import Backend
    from autoprec.policy import Policy

# What an emulated format runs as: its own name on the device's kind (``CPU fp8``).
EMULATED_MARK = "^"  # the console table's mark on the figures of an emulated row


def emulated_dtypes(policy: Policy, backend: Backend) -> list[str]:
    """The dtypes of ``policy`` that ``backend`` runs emulated (``["fp8"]``, or none)."""
    return sorted(set(backend.emulated()) & set(policy.named_dtypes))


def emulated_label(dtypes: Iterable[str]) -> str | None:
    """``emulated (CPU fp8): speed is not the device's``; None for no emulated dtype."""
    names = sorted(set(dtypes))
    if not names:
        return None
    ran_as = ", ".join(f"CPU {name}" for name in names)
    return f"emulated ({ran_as}): speed and memory are not the device's"


def emulated_note(searched: Iterable[str], rows: Iterable[Iterable[str]] = ()) -> str | None:
    """The note on a search's figures where it ran dtypes emulated (``searched``: the
    dtypes its device was told to emulate; ``rows``: each row's emulated dtypes):
    ``^ emulated (CPU fp8): ...``, the mark saying which rows; None where nothing was."""
    label = emulated_label([*searched, *(dtype for row in rows for dtype in row)])
    return None if label is None else f"{EMULATED_MARK} {label} (rows marked {EMULATED_MARK})"


def emulated_mark(dtypes: Iterable[str]) -> str:
    """The mark a row's figures carry where they ran emulated (``^``), else nothing."""
    return EMULATED_MARK if list(dtypes) else ""
