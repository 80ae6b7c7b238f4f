"""The guard's copy of a run at one step: what a rollback goes back to.

A copy holds the model's parameters and buffers, each optimizer's state, the loss
scaler's state and the random generators' (so that dropout draws the same masks when the
lost steps are trained again). It is taken at a step boundary in two parts: the model,
the scaler and the generators before the step's forward, each optimizer just before its
first step, so that every part is as it stood between the two steps.

In memory the copy lives on the host: one copy of the weights and of the optimizer
state (``nbytes`` says how much), whatever device trains. With a directory it is written
there as ``guard-snapshot.pt``, whole or not at all, and read back without unpickling.
Restoring copies into the tensors the model and the optimizers already hold, so that
every reference to a parameter (an optimizer's, a DDP wrapper's) stays valid.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.errors import GuardError, WriteError

SNAPSHOT_FILE = "guard-snapshot.pt"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) tensor's local shard; any other tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def _to_host(value: Any) -> Any:
    """``value`` with every tensor copied to the host (containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return _local(value).detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_host(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_host(item) for item in value)
    return value


def _sharded_like(saved: Any, current: Any) -> Any:
    """``saved`` (host copies of local shards) with each tensor whose counterpart in
    ``current`` is sharded (an FSDP2 optimizer's state) made a DTensor like it again: an
    optimizer cannot step a sharded parameter with a plain state."""
    if isinstance(saved, torch.Tensor) and hasattr(current, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            saved.to(current.device),
            current.device_mesh,
            current.placements,
            run_check=False,
            shape=current.shape,
            stride=current.stride(),
        )
    if isinstance(saved, dict) and isinstance(current, dict):
        return {key: _sharded_like(item, current.get(key)) for key, item in saved.items()}
    return saved


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_nbytes(item) for item in value)
    return 0


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Snapshot:
    """One step's copy of the run (see the module's docstring)."""

    def __init__(self, step: int, model: nn.Module, scaler_state: dict[str, Any]) -> None:
        self.step = step
        self.model = _to_host(model.state_dict())
        self.scaler = dict(scaler_state)
        self.rng = _rng_state()
        self.optimizers: dict[int, dict[str, Any]] = {}
        self.tracked: dict[int, dict[str, Any]] = {}

    def add_optimizer(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state, taken before its first step after the copy's step."""
        if index not in self.optimizers:
            self.optimizers[index] = _to_host(optimizer.state_dict())

    def add_tracked(self, index: int, state: dict[str, Any]) -> None:
        """The state of an object the loop asked to keep in step (a scheduler)."""
        self.tracked[index] = _to_host(state)

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds on the host."""
        return _nbytes(self.model) + _nbytes(self.optimizers)

    def restore(
        self,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        tracked: list[Any],
    ) -> dict[str, Any]:
        """Put the model, the optimizers, the tracked objects and the generators back as
        they were; returns the loss scaler's state to load."""
        with torch.no_grad():
            current = model.state_dict()
            missing = sorted(set(current) - set(self.model))
            if missing:
                raise GuardError(f"guard: the snapshot of step {self.step} lacks {missing[0]}")
            for name, tensor in current.items():
                _local(tensor).copy_(self.model[name])
        for index, optimizer in enumerate(optimizers):
            if index in self.optimizers:
                saved = _sharded_like(self.optimizers[index], optimizer.state_dict())
                optimizer.load_state_dict(saved)
        for index, obj in enumerate(tracked):
            if index in self.tracked:
                obj.load_state_dict(self.tracked[index])
        _set_rng_state(self.rng)
        return self.scaler

    def to_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.model,
            "scaler": self.scaler,
            "rng": self.rng,
            "optimizers": self.optimizers,
            "tracked": self.tracked,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Snapshot:
        snapshot = cls.__new__(cls)
        snapshot.step = int(state["step"])
        snapshot.model = state["model"]
        snapshot.scaler = state["scaler"]
        snapshot.rng = state["rng"]
        snapshot.optimizers = dict(state["optimizers"])
        snapshot.tracked = dict(state["tracked"])
        return snapshot


class SnapshotStore:
    """Where the guard keeps its one copy: in memory, or in ``directory``."""

    def __init__(self, directory: str | None) -> None:
        self.path = None if directory is None else Path(directory) / SNAPSHOT_FILE
        self._held: Snapshot | None = None

    def keep(self, snapshot: Snapshot) -> None:
        """Keep ``snapshot``, replacing the one before (on disk: written whole first)."""
        if self.path is None:
            self._held = snapshot
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_symlink():
            raise WriteError(
                f"{self.path}: is a symbolic link; the guard writes no file through one"
            )
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".guard-", suffix=".pt")
        os.close(handle)
        try:
            torch.save(snapshot.to_state(), temporary)
            os.replace(temporary, self.path)
        except OSError as error:
            Path(temporary).unlink(missing_ok=True)
            raise WriteError(f"{self.path}: cannot write the guard's snapshot: {error}") from None
        self._held = None  # on disk only: the host keeps no copy

    def load(self) -> Snapshot | None:
        """The copy kept (read from disk where it lives there), or None."""
        if self.path is None or not self.path.exists():
            return self._held
        return Snapshot.from_state(torch.load(self.path, weights_only=True))
