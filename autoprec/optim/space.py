"""The optimizer-state part of a search space: which state kinds and master dtypes each
parameter group may take, searched beside the layers' dtypes and loss scaling.

A space asks for it with an ``optimizer_states`` section (a space without one searches
the states `autoprec.optim.offered` offers under ``--prefer memory``, and ``auto`` offers
them under any preference)::

    optimizer_states:
      states: [fp32, 8bit]          # choices of a group that lists none
      masters: [fp32]               # master weight dtypes (fp32, bf16)
      groups:                       # first match wins, on the module owning a parameter
        - {name: embeddings, types: [Embedding]}
        - {name: rest, patterns: ["*"]}

Each group is an Optuna parameter ``state.<group>`` (and ``master.<group>`` where several
masters are listed). Anchors: every state in 8 bits with embeddings in fp32 (the
bitsandbytes recipe) and MS-AMP O2-like moments (``fp8-bf16``), where the section offers
them; every state in fp32 is the fp32 baseline itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from autoprec.errors import PolicyError
from autoprec.optim.state import (
    MASTER_DTYPES,
    STATE_KINDS,
    OptimizerStates,
    StateGroup,
    in_reference,
)

if TYPE_CHECKING:
    from autoprec.numerics.state_health import GroupStateLoss

_SECTION_FIELDS = ("states", "masters", "groups")
_GROUP_FIELDS = ("name", "patterns", "types", "states", "masters", "optional")
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class StateChoice:
    """One searched parameter group: the parameters its rule matches, the state kinds and
    master dtypes it may take."""

    name: str
    group: StateGroup  # its patterns and types (state and master set per trial)
    states: tuple[str, ...]
    masters: tuple[str, ...] = ("fp32",)
    optional: bool = False

    @property
    def holds_embeddings(self) -> bool:
        return "Embedding" in self.group.types or any(
            "emb" in pattern.lower() or pattern in ("wte", "wpe") for pattern in self.group.patterns
        )


@dataclass(frozen=True)
class StateSpace:
    groups: tuple[StateChoice, ...]
    # the library the policies' states are built with (`OptimizerStates.library`): a
    # section read from YAML searches torchao's; the states offered without a section
    # (`autoprec.optim.offered`) come from the library installed
    library: str = "torchao"

    def kinds(self) -> set[str]:
        """Every state kind some group may take."""
        return {kind for choice in self.groups for kind in choice.states}

    @classmethod
    def from_dict(cls, data: Any, fail: Any) -> StateSpace:
        if not isinstance(data, dict):
            raise fail("optimizer_states: expected a mapping")
        unknown = sorted(set(data) - set(_SECTION_FIELDS))
        if unknown:
            raise fail(
                f"optimizer_states.{unknown[0]}: unknown field (expected {list(_SECTION_FIELDS)})"
            )
        states = _choices(
            data.get("states", ["fp32", "8bit"]), STATE_KINDS, "optimizer_states.states", fail
        )
        masters = _choices(
            data.get("masters", ["fp32"]), MASTER_DTYPES, "optimizer_states.masters", fail
        )
        items = data.get("groups") or [{"name": "all", "patterns": ["*"]}]
        if not isinstance(items, list):
            raise fail("optimizer_states.groups: expected a list")
        groups: list[StateChoice] = []
        for i, item in enumerate(items):
            where = f"optimizer_states.groups[{i}]"
            if not isinstance(item, dict):
                raise fail(f"{where}: expected a mapping")
            unknown = sorted(set(item) - set(_GROUP_FIELDS))
            if unknown:
                raise fail(f"{where}.{unknown[0]}: unknown field (expected {list(_GROUP_FIELDS)})")
            name = item.get("name")
            if not isinstance(name, str) or not _GROUP_NAME.match(name):
                raise fail(f"{where}.name: expected a name of letters, digits, '.', '-' and '_'")
            if any(g.name == name for g in groups):
                raise fail(f"{where}.name: group {name!r} is named twice")
            try:
                rule = StateGroup.from_dict(
                    {k: item[k] for k in ("patterns", "types") if k in item} | {"state": "fp32"},
                    where,
                )
            except PolicyError as error:
                raise fail(str(error)) from None
            optional = item.get("optional", False)
            if not isinstance(optional, bool):
                raise fail(f"{where}.optional: expected true or false")
            groups.append(
                StateChoice(
                    name,
                    StateGroup(rule.patterns, rule.types, "fp32", name=name),
                    _choices(
                        item.get("states", list(states)), STATE_KINDS, f"{where}.states", fail
                    ),
                    _choices(
                        item.get("masters", list(masters)), MASTER_DTYPES, f"{where}.masters", fail
                    ),
                    optional,
                )
            )
        return cls(tuple(groups))

    def fit(self, model: nn.Module, fail: Any) -> StateSpace:
        """The groups that take some trainable parameter of ``model`` (first match wins);
        one that takes none is dropped when optional, else refused."""
        taken = set(self.assignment(model).values())
        kept = []
        for i, choice in enumerate(self.groups):
            if choice.name in taken:
                kept.append(choice)
            elif not choice.optional:
                raise fail(
                    f"optimizer_states.groups[{i}] ({choice.name}): matches no trainable "
                    f"parameter of {type(model).__name__} that an earlier group has not taken"
                )
        return StateSpace(tuple(kept), self.library)

    def without(self, kinds: set[str]) -> StateSpace:
        """The space without the state kinds ``kinds`` (a group keeps fp32 at least)."""
        groups = []
        for choice in self.groups:
            left = tuple(k for k in choice.states if k not in kinds) or ("fp32",)
            groups.append(replace(choice, states=left))
        return StateSpace(tuple(groups), self.library)

    def assignment(self, model: nn.Module) -> dict[str, str]:
        """Each trainable parameter's name mapped to the group that takes it."""
        modules = dict(model.named_modules())
        found = {}
        for name, parameter in model.named_parameters():
            if not parameter.requires_grad:
                continue
            owner = name.rpartition(".")[0]
            for choice in self.groups:
                if choice.group.matches(owner, modules[owner]):
                    found[name] = choice.name
                    break
        return found

    def suggest(self, trial: Any) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for choice in self.groups:
            key = f"state.{choice.name}"
            params[key] = trial.suggest_categorical(key, list(choice.states))
            if len(choice.masters) > 1:
                key = f"master.{choice.name}"
                params[key] = trial.suggest_categorical(key, list(choice.masters))
        return params

    def states(self, params: Mapping[str, Any]) -> OptimizerStates:
        """The policy's training states for a set of parameter values (a group without a
        value takes fp32 where it may, else its first choice)."""
        groups = []
        for choice in self.groups:
            state = params.get(f"state.{choice.name}", _first(choice.states))
            master = params.get(f"master.{choice.name}", _first(choice.masters))
            groups.append(
                StateGroup(choice.group.patterns, choice.group.types, state, master, choice.name)
            )
        # Every state in fp32 is the task's own optimizer whichever library the others
        # take (bitsandbytes' 32-bit step is not it): the fp32 baseline is the task's.
        quantised = not all(
            in_reference(g.state or "") and in_reference(g.master or "") for g in groups
        )
        return OptimizerStates(
            groups=tuple(groups), library=self.library if quantised else "torchao"
        )

    def anchors(self, layers_fp32: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Every state in 8 bits with embeddings in fp32 (bitsandbytes' recipe) and MS-AMP
        O2-like moments, with every layer in fp32: those the groups offer. All states in
        fp32 is the baseline (a group without a value takes fp32), measured anyway."""
        anchors: dict[str, dict[str, Any]] = {}

        def uniform(state: str, keep: Any = lambda choice: False) -> dict[str, Any] | None:
            params = dict(layers_fp32)
            for choice in self.groups:
                wanted = "fp32" if keep(choice) else state
                if wanted not in choice.states:
                    return None
                params[f"state.{choice.name}"] = wanted
            return params

        candidates = {
            "states-8bit-embeddings-fp32": uniform("8bit", lambda c: c.holds_embeddings),
            "states-msamp-o2": uniform("fp8-bf16"),
        }
        anchors.update({name: params for name, params in candidates.items() if params})
        return anchors

    def risk_order(self, losses: Sequence[GroupStateLoss], kind: str) -> list[str]:
        """The group names, those whose states ``kind`` loses most first, by what its
        quantiser did to the fp32 baseline's real states (`rank_state_groups`)."""
        from autoprec.numerics.state_health import rank_state_groups

        return rank_state_groups(losses, kind, [choice.name for choice in self.groups])

    def flat_params(self, states: OptimizerStates) -> dict[str, str]:
        by_name = {group.name: group for group in states.groups}
        flat = {}
        for choice in self.groups:
            group = by_name.get(choice.name)
            flat[f"state.{choice.name}"] = group.state if group and group.state else "fp32"
            if len(choice.masters) > 1:
                flat[f"master.{choice.name}"] = group.master if group and group.master else "fp32"
        return flat

    def fingerprint_content(self) -> list[Any]:
        content: list[Any] = [
            (c.name, c.group.to_dict(), c.states, c.masters, c.optional) for c in self.groups
        ]
        return content if self.library == "torchao" else [*content, self.library]


def _first(choices: tuple[str, ...]) -> str:
    return next((choice for choice in choices if in_reference(choice)), choices[0])


def _choices(value: Any, allowed: tuple[str, ...], where: str, fail: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise fail(f"{where}: expected a non-empty list of {', '.join(allowed)}")
    for item in value:
        if item not in allowed:
            raise fail(f"{where}: unknown choice {item!r} (expected {', '.join(allowed)})")
    return tuple(dict.fromkeys(value))
