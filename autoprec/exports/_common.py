"""What the export formats share: their error and warning types (defined in
`autoprec.errors`), the layers a policy runs in fp32, one low-precision dtype for formats
that know only one, and the notes that say what a format approximates."""

from __future__ import annotations

import textwrap
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.files import write_atomic
from autoprec.dtypes import LOW_PRECISION
from autoprec.errors import ExportError, ExportWarning
from autoprec.optim.state import TrainingState
from autoprec.policy import Policy

COMMENT_WIDTH = 92


def require(value: object, what: str, fmt: str) -> None:
    """One line that says which argument the format needs, instead of an AttributeError
    deep in an exporter."""
    if value is None:
        raise ExportError(f"format {fmt!r}: needs {what}")


def out_folder(out_dir: str | Path) -> Path:
    folder = Path(out_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ExportError(f"{folder}: cannot create ({error.strerror or error})") from None
    return folder


def write(path: Path, text: str) -> Path:
    try:
        write_atomic(path, text)
    except OSError as error:  # a WriteError: its message names the file
        raise ExportError(str(error)) from None
    return path


def warn(notes: Iterable[str]) -> None:
    """Each note as an ExportWarning (the CLI prints them on stderr)."""
    for note in notes:
        warnings.warn(note, ExportWarning, stacklevel=3)


def comment(text: str, first: str = "# ", rest: str = "# ") -> list[str]:
    """``text`` as comment lines of a generated file, wrapped to fit a screen."""
    return textwrap.wrap(text, COMMENT_WIDTH, initial_indent=first, subsequent_indent=rest)


def policy_label(policy: Policy) -> str:
    """The policy's name as generated files show it: quoted (``repr``), so that no name, even
    one that skipped ``load_policy``'s check, can end a comment or a string there."""
    return f"policy {policy.name!r}" if policy.name else "policy (unnamed)"


def docstring(lines: Iterable[str]) -> list[str]:
    """``lines`` as a Python docstring that cannot end early: backslashes and double quotes
    escaped, whatever values the text holds."""
    escaped = "\n".join(lines).replace("\\", "\\\\").replace('"', '\\"')
    return ['"""' + escaped, '"""']


def note_lines(notes: Iterable[str]) -> list[str]:
    """The notes for a file's header, so that a reader of the file sees what the warning
    said."""
    return [line for note in notes for line in comment(note, "# NOTE: ", "#   ")]


def own_parameters(model: nn.Module, name: str) -> int:
    return sum(p.numel() for p in model.get_submodule(name).parameters(recurse=False))


def names(layers: Iterable[str], limit: int = 8) -> str:
    """``a, b, c and 5 more``: layer names for a comment line."""
    layers = [layer or "(model)" for layer in layers]
    shown = ", ".join(layers[:limit])
    return shown + (f" and {len(layers) - limit} more" if len(layers) > limit else "")


@dataclass(frozen=True)
class OneLowDtype:
    """A policy's layers as a format with one low-precision dtype can hold them: ``dtypes``
    maps every layer to fp32 or ``low`` (None: all fp32); the layers of the other low dtype,
    if any, are kept in fp32 (wider, so never less accurate than the policy, only slower),
    and ``notes`` say so."""

    dtypes: dict[str, str]
    low: str | None
    notes: tuple[str, ...]

    @property
    def fp32_layers(self) -> list[str]:
        return [name for name, dtype in self.dtypes.items() if formats.get(dtype).reference]


def one_low_dtype(policy: Policy, model: nn.Module, device: str, fmt: str) -> OneLowDtype:
    """The policy on ``model`` as it runs on ``device`` (``Policy.resolve``), with fp16 and
    bf16 layers both present reduced to the dtype holding more parameters."""
    resolved = policy.resolve(model, device)
    weight = {low: 0 for low in LOW_PRECISION}
    for name, dtype in resolved.items():
        if dtype in weight:
            weight[dtype] += own_parameters(model, name)
    present = [low for low in LOW_PRECISION if any(d == low for d in resolved.values())]
    if len(present) <= 1:
        return OneLowDtype(dict(resolved), present[0] if present else None, ())
    low = max(present, key=lambda d: (weight[d], formats.get(d).limits.range_bits))  # bf16
    other = next(d for d in present if d != low)
    widened = tuple(name for name, dtype in resolved.items() if dtype == other)
    dtypes = {name: "fp32" if dtype == other else dtype for name, dtype in resolved.items()}
    note = (
        f"{fmt} holds one low-precision dtype and the policy mixes fp16 and bf16: the "
        f"{len(widened)} {other} layer(s) ({names(widened)}) are kept in fp32 instead, "
        f"{low} holding more parameters ({weight[low]} against {weight[other]})"
    )
    return OneLowDtype(dtypes, low, (note,))


def example_inputs(example: Any, fmt: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)`` from a task's batch (``.args`` and
    ``.kwargs``), a tensor, a tuple of positional inputs or a mapping of keyword inputs.
    ``labels`` are dropped: an inference graph takes none, and transformers models given
    labels add the loss to the graph."""
    if hasattr(example, "args") and hasattr(example, "kwargs"):
        args, kwargs = tuple(example.args), dict(example.kwargs)
    elif isinstance(example, torch.Tensor):
        args, kwargs = (example,), {}
    elif isinstance(example, Mapping):
        args, kwargs = (), dict(example)
    elif isinstance(example, tuple | list):
        args, kwargs = tuple(example), {}
    else:
        raise ExportError(
            f"format {fmt!r}: example must be a batch (task.batch(raw)), a tensor, a tuple or a "
            f"mapping of inputs, got {type(example).__name__}"
        )
    kwargs.pop("labels", None)
    return args, kwargs


# torch.optim.AdamW's defaults: what a generated optimizer file takes when not told.
ADAMW_SIGNATURE = (
    "lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, "
    "weight_decay: float = 0.01"
)
ADAMW_ARGUMENTS = "lr=lr, betas=betas, eps=eps, weight_decay=weight_decay"


def parameters_by_state(
    policy: Policy, model: nn.Module | None, fmt: str
) -> dict[TrainingState, list[str]]:
    """The model's trainable parameters by name, grouped by the training state the policy's
    ``optimizer`` section gives them (in ``named_parameters()`` order, as
    ``policy.optimizer`` groups them)."""
    require(model, "a model (the fp32 module, for its parameter names)", fmt)
    assert model is not None
    grouped: dict[TrainingState, list[str]] = {}
    for name, state in policy.resolve_states(model).items():
        grouped.setdefault(state, []).append(name)
    return grouped


def library_note(policy: Policy, library: str) -> list[str]:
    """A note where the export's library is not the one the search measured the states in."""
    measured = policy.optimizer_states.library
    if measured == library or "8bit" not in policy.optimizer_states.kinds():
        return []
    return [
        f"the policy's states were measured with {measured}'s optimizers; {library}'s "
        "quantise differently, so its 8-bit states are not bit for bit what the trials ran"
    ]
