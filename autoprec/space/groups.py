"""Groups of layers searched together, ``groups: auto``, and the rules a group's chosen
dtype gives a policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from autoprec.dtypes import FP8
from autoprec.errors import SpaceError
from autoprec.policy import Rule

AUTO_FIELDS = ("max_groups", "own_groups")


@dataclass(frozen=True)
class Group:
    """Layers searched together. An optional group that matches nothing in a model is
    dropped for that model; any other group must match something."""

    name: str
    rule: Rule
    dtypes: tuple[str, ...]
    optional: bool = False
    # fitted where weights are converted and only some of its layers can be int8 (a
    # decoder block's Linear layers beside its norms): the layers int8 takes; the others
    # stay fp32
    int8_leaves: tuple[str, ...] = ()
    # fitted where it offers fp8: the layers fp8 takes, named one by one so that an fp8
    # rule never meets a layer the group does not search
    fp8_leaves: tuple[str, ...] = ()
    # fitted where weights are converted and only some of its layers can be fp8: the
    # others stay fp32
    fp8_kept: bool = False


@dataclass(frozen=True)
class AutoGroups:
    """``groups: auto``: groups built from the model's structure when the space is fitted
    (repeated blocks by block range and role, the rest by type family and position, the
    head on its own; see `autoprec.profile.autogroups`), at most ``max_groups`` of them. Given a
    profile, the ``own_groups`` riskiest modules come first as groups of their own
    (``risk.<name>``)."""

    max_groups: int = 12
    own_groups: int = 3

    def __post_init__(self) -> None:
        for key in AUTO_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpaceError(f"auto_groups.{key}: expected an integer, got {value!r}")
        if self.max_groups < 1:
            raise SpaceError(f"auto_groups.max_groups: expected at least 1, got {self.max_groups}")
        if not 0 <= self.own_groups < self.max_groups:
            raise SpaceError(
                f"auto_groups.own_groups: expected 0 to max_groups - 1 ({self.max_groups - 1}), "
                f"got {self.own_groups}"
            )


# What a group that cannot take the low dtype runs in beside it: for fp8, the autocast
# region torchao's float8 layers usually sit in (bf16), else the widest the group offers.
_REST_FIRST = {FP8: ("bf16", "fp32", "fp16")}
_WIDEST_FIRST = ("fp32", "bf16", "fp16", FP8, "int8")


def dtype_beside(group: Group, low: str) -> str:
    """``low`` where ``group`` offers it; otherwise, beside fp8, bf16 where the group
    offers it (the region around torchao's float8 layers), else its widest dtype."""
    if low in group.dtypes:
        return low
    order = _REST_FIRST.get(low, _WIDEST_FIRST)
    return next((d for d in (*order, *_WIDEST_FIRST) if d in group.dtypes), group.dtypes[0])


def group_rules(group: Group, params: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The rules a group's chosen dtype gives: one, or for int8 or fp8 in a group only
    some of whose layers can take it, that dtype for those and fp32 for the rest."""
    dtype = params[f"dtype.{group.name}"]
    if dtype == FP8 and group.fp8_kept:
        return (
            Rule(FP8, patterns=group.fp8_leaves, name=group.name),
            replace(group.rule, dtype="fp32", name=f"{group.name}.kept"),
        )
    if dtype == FP8:
        return (Rule(FP8, patterns=group.fp8_leaves, name=group.name),)
    if dtype == "int8" and group.int8_leaves:
        return (
            Rule("int8", patterns=group.int8_leaves, name=group.name),
            replace(group.rule, dtype="fp32", name=f"{group.name}.kept"),
        )
    return (replace(group.rule, dtype=dtype),)
