"""The policy's training state per parameter group: the optimizer state's dtype and the
master weight's dtype.

Plain data, like the layer rules: groups match the module that owns a parameter by glob
patterns on its ``named_modules()`` name (an ancestor's name matches too) and/or by type
names in its MRO, the first matching group wins, and parameters no group matches take the
section's defaults. What each state kind means is what the library that implements it
stores (`autoprec.optim.optimizer` builds the optimizer):

- ``fp32``: the user's own optimizer class (``torch.optim.AdamW``), states in fp32;
- ``bf16``: torchao's Adam step with both moments stored in bf16 (round to nearest);
- ``8bit``: ``torchao.optim.AdamW8bit`` (blockwise dynamic-tree quantisation, block 256);
- ``4bit``: ``torchao.optim.AdamW4bit`` (block 128);
- ``fp8``: ``torchao.optim.AdamWFp8`` (float8_e4m3fn, block 256);
- ``fp8-bf16``: MS-AMP O2-like moments: the first moment in torchao's blockwise fp8, the
  second in bf16 (MS-AMP keeps it in scaled fp16; bf16 needs no scale).

torchao keeps tensors under 4,096 elements (or not a multiple of the block) in the
parameter's dtype, as bitsandbytes does: such a parameter's state is fp32 whatever the
group says, and the memory count (`state_nbytes`) says so, since it counts what is stored.

The master weight is ``fp32`` (the parameter stays fp32), or ``bf16``: the parameter is
stored in bf16 and torchao's step rounds its fp32 update stochastically
(``bf16_stochastic_round=True``), so small updates are not lost on average. A bf16 master
suits layers that compute in bf16; in an fp32 layer the weight is read in bf16.

``library: bitsandbytes`` (the section's; torchao by default, not written) builds the whole
optimizer from bitsandbytes instead: ``bitsandbytes.optim.AdamW8bit`` (``Adam8bit``), with
``GlobalOptimManager.override_config(param, "optim_bits", 32)`` for the parameters whose
state is ``fp32``, as bitsandbytes' documentation keeps embeddings in 32 bits. It
implements ``fp32`` and ``8bit`` states and fp32 masters only (`LIBRARY_KINDS`); it keeps
tensors under 4,096 elements in fp32 too, but quantises any larger one (a last, partial
block of 256 included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import autoprec.formats as formats
from autoprec._util.safe_names import check_name
from autoprec.errors import PolicyError

if TYPE_CHECKING:
    from torch import nn

STATE_KINDS = ("fp32", "bf16", "8bit", "4bit", "fp8", "fp8-bf16")
MASTER_DTYPES = ("fp32", "bf16")
LIBRARIES = ("torchao", "bitsandbytes")
# What each library implements: state kinds, then master dtypes.
LIBRARY_KINDS = {
    "torchao": (STATE_KINDS, MASTER_DTYPES),
    "bitsandbytes": (("fp32", "8bit"), ("fp32",)),
}
# Bytes one parameter's Adam state (two moments) takes per element, quantised in full
# (scales and code maps add a little: `state_nbytes` counts them).
STATE_BYTES_PER_ELEMENT = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0, "4bit": 1.0, "fp8": 2.0}
STATE_BYTES_PER_ELEMENT["fp8-bf16"] = 3.0
_GROUP_FIELDS = ("name", "patterns", "types", "state", "master")
_SECTION_FIELDS = ("library", "state", "master", "groups")


def _check_kind(value: Any, where: str) -> str:
    if value not in STATE_KINDS:
        raise PolicyError(
            f"{where}: unknown optimizer state {value!r} (expected {', '.join(STATE_KINDS)})"
        )
    return value


def _check_master(value: Any, where: str) -> str:
    if value not in MASTER_DTYPES:
        raise PolicyError(f"{where}: unknown master weight dtype {value!r} (expected fp32 or bf16)")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PolicyError(f"{where}: expected a list of non-empty strings, got {value!r}")
    return tuple(value)


def in_reference(kind: str) -> bool:
    """Whether a state kind or master dtype is the reference format (fp32): the optimizer's
    own states, full-precision master weights."""
    return formats.known(kind) and formats.get(kind).reference


@dataclass(frozen=True)
class TrainingState:
    """What one parameter's training keeps: the optimizer state kind and master dtype."""

    state: str = "fp32"
    master: str = "fp32"

    def describe(self) -> str:
        return self.state if in_reference(self.master) else f"{self.state}, master {self.master}"


@dataclass(frozen=True)
class StateGroup:
    """Parameters whose owning module matches ``patterns`` and/or ``types`` keep their
    optimizer state in ``state`` and their master weight in ``master`` (None: the
    section's default)."""

    patterns: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    state: str | None = None
    master: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", tuple(self.patterns))
        object.__setattr__(self, "types", tuple(self.types))
        if not self.patterns and not self.types:
            raise PolicyError("optimizer group: needs patterns, types or both")
        if self.state is not None:
            _check_kind(self.state, "state")
        if self.master is not None:
            _check_master(self.master, "master")
        if self.state is None and self.master is None:
            raise PolicyError("optimizer group: needs state, master or both")

    def matches(self, name: str, module: nn.Module) -> bool:
        from autoprec.precision.plan import selects  # on a model: a policy is torch-free data

        return selects(self.patterns, self.types, name, module)

    def describe(self) -> str:
        parts = []
        if self.patterns:
            parts.append("patterns " + ", ".join(self.patterns))
        if self.types:
            parts.append("types " + ", ".join(self.types))
        return self.name or " and ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.name:
            data["name"] = self.name
        if self.patterns:
            data["patterns"] = list(self.patterns)
        if self.types:
            data["types"] = list(self.types)
        if self.state is not None:
            data["state"] = self.state
        if self.master is not None:
            data["master"] = self.master
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str) -> StateGroup:
        if not isinstance(data, dict):
            raise PolicyError(f"{where}: expected a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_GROUP_FIELDS))
        if unknown:
            raise PolicyError(
                f"{where}.{unknown[0]}: unknown field (expected {list(_GROUP_FIELDS)})"
            )
        patterns = _strings(data["patterns"], f"{where}.patterns") if "patterns" in data else ()
        types = _strings(data["types"], f"{where}.types") if "types" in data else ()
        state = data.get("state")
        master = data.get("master")
        try:
            return cls(
                patterns,
                types,
                None if state is None else _check_kind(state, f"{where}.state"),
                None if master is None else _check_master(master, f"{where}.master"),
                check_name(data.get("name"), f"{where}.name"),
            )
        except PolicyError as error:
            message = str(error)
            raise PolicyError(
                message if message.startswith(where) else f"{where}: {message}"
            ) from None


@dataclass(frozen=True)
class OptimizerStates:
    """The policy's ``optimizer`` section: default state kind and master dtype, groups
    that override them, and the library that implements the states (``torchao`` or
    ``bitsandbytes``). The default (fp32 states, fp32 masters, no groups, torchao) is
    what a policy without the section means, and is not written in its YAML."""

    state: str = "fp32"
    master: str = "fp32"
    groups: tuple[StateGroup, ...] = ()
    # Out of the repr, which policy identities hash: a torchao section's stays what it was
    # (Policy.identity adds another library).
    library: str = field(default="torchao", repr=False)

    def __post_init__(self) -> None:
        _check_kind(self.state, "optimizer.state")
        _check_master(self.master, "optimizer.master")
        object.__setattr__(self, "groups", tuple(self.groups))
        if self.library not in LIBRARIES:
            raise PolicyError(
                f"optimizer.library: unknown library {self.library!r} "
                f"(expected {', '.join(LIBRARIES)})"
            )
        kinds, masters = LIBRARY_KINDS[self.library]
        named: list[tuple[str, str | None, str | None]] = [("optimizer", self.state, self.master)]
        named += [(f"optimizer.groups[{i}]", g.state, g.master) for i, g in enumerate(self.groups)]
        for where, state, master in named:
            if state is not None and state not in kinds:
                raise PolicyError(
                    f"{where}.state: {self.library} implements {' and '.join(kinds)} states, "
                    f"not {state} (library: torchao has it)"
                )
            if master is not None and master not in masters:
                raise PolicyError(
                    f"{where}.master: {self.library} keeps fp32 master weights, not {master} "
                    "(library: torchao rounds bf16 ones stochastically)"
                )

    @property
    def is_default(self) -> bool:
        return self == OptimizerStates()

    def all_fp32(self, model: nn.Module | None = None) -> bool:
        """Whether every parameter (of ``model``; without one, every group and the
        default) keeps fp32 states and an fp32 master in the user's own optimizer: what
        a policy without the section measures (bitsandbytes' fp32 states are its own
        32-bit step, so never)."""
        if self.library != "torchao":
            return False
        if model is not None:
            return all(s == TrainingState() for s in self.assign(model).values())
        named = [(g.state or "fp32", g.master or "fp32") for g in self.groups]
        pairs = [(self.state, self.master), *named]
        return all(in_reference(s) and in_reference(m) for s, m in pairs)

    def kinds(self) -> set[str]:
        """Every state kind the section names."""
        return {self.state, *(g.state for g in self.groups if g.state is not None)}

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.library != "torchao":
            data["library"] = self.library
        data.update(state=self.state, master=self.master)
        if self.groups:
            data["groups"] = [group.to_dict() for group in self.groups]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> OptimizerStates:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise PolicyError(f"optimizer: expected a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_SECTION_FIELDS))
        if unknown:
            raise PolicyError(
                f"optimizer.{unknown[0]}: unknown field (expected {list(_SECTION_FIELDS)})"
            )
        groups_data = data.get("groups") or []
        if not isinstance(groups_data, list):
            raise PolicyError("optimizer.groups: expected a list")
        groups = tuple(
            StateGroup.from_dict(g, f"optimizer.groups[{i}]") for i, g in enumerate(groups_data)
        )
        return cls(
            _check_kind(data.get("state", "fp32"), "optimizer.state"),
            _check_master(data.get("master", "fp32"), "optimizer.master"),
            groups,
            data.get("library", "torchao"),
        )

    def assign(self, model: nn.Module) -> dict[str, TrainingState]:
        """Every trainable parameter's name (as ``named_parameters()`` gives it, a shared
        parameter once) mapped to its training state; raises PolicyError for a group that
        matches no parameter of the model."""
        modules = dict(model.named_modules())
        used = [False] * len(self.groups)
        assigned: dict[str, TrainingState] = {}
        for name, parameter in model.named_parameters():
            if not parameter.requires_grad:
                continue
            owner = name.rpartition(".")[0]
            state, master = None, None
            for i, group in enumerate(self.groups):
                if group.matches(owner, modules[owner]):
                    used[i] = True
                    if state is None and master is None:
                        state, master = group.state, group.master
            assigned[name] = TrainingState(state or self.state, master or self.master)
        for i, group in enumerate(self.groups):
            if not used[i]:
                raise PolicyError(
                    f"optimizer.groups[{i}] ({group.describe()}): matches no trainable "
                    f"parameter in {type(model).__name__}"
                )
        return assigned

    def group_of(self, model: nn.Module, parameter: str) -> StateGroup | None:
        """The first group whose rule takes ``parameter`` (a ``named_parameters()``
        name), or None where the section's default state applies."""
        owner = parameter.rpartition(".")[0]
        module = model.get_submodule(owner)
        return next((g for g in self.groups if g.matches(owner, module)), None)

    def by_module(self, model: nn.Module) -> dict[str, TrainingState]:
        """Each module that owns parameters, by name, mapped to its parameters' state
        (one group matches all of a module's own parameters)."""
        found: dict[str, TrainingState] = {}
        for name, state in self.assign(model).items():
            found.setdefault(name.rpartition(".")[0], state)
        return found


def optimizer_state_nbytes(optimizer: Any) -> int:
    """Bytes of every tensor in the optimizer's state as it is stored (each storage once)."""
    import torch

    from autoprec.devices import state_nbytes

    storages: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storages.update(state_nbytes(value))
    return sum(storages.values())
