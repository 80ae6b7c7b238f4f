"""Groups of layers searched together, ``groups: auto``, and the rules a group's chosen
dtype gives a policy."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import autoprec.formats as formats
from autoprec.errors import SpaceError
from autoprec.formats import Format
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


def widest(dtypes: Iterable[str]) -> str:
    """The widest of ``dtypes``: the most bytes, then the most range (fp32, bf16, fp16...)."""
    made = (formats.get(d) for d in dtypes)
    return max(made, key=lambda f: (f.bytes_per_element, f.limits.range_bits)).name


def dtype_beside(group: Group, low: str) -> str:
    """``low`` where ``group`` offers it; otherwise what ``low`` leaves to the layers it
    cannot take (its `rest`: bf16 beside fp8, the region around torchao's float8 layers)
    where the group offers it, else the group's widest dtype."""
    if low in group.dtypes:
        return low
    rest = formats.get(low).rest
    return rest if rest in group.dtypes else widest(group.dtypes)


def group_rules(group: Group, params: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The rules a group's chosen dtype gives: one, or for a converted format (fp8, its
    layers named one by one) or a quantized one (int8) in a group only some of whose layers
    can take it, that dtype for those and fp32 for the rest."""
    dtype = params[f"dtype.{group.name}"]
    made = formats.get(dtype)
    if made.records_conversion:
        leaves, kept = group.fp8_leaves, group.fp8_kept
    elif made.policy_records and group.int8_leaves:
        leaves, kept = group.int8_leaves, True
    else:
        return (replace(group.rule, dtype=dtype),)
    rest = replace(group.rule, dtype=formats.reference().name, name=f"{group.name}.kept")
    return (Rule(dtype, patterns=leaves, name=group.name), *((rest,) if kept else ()))


def formats_among(values: Iterable[object]) -> list[Format]:
    """The formats that ``values`` name (a policy's dtypes, or a space's parameter values,
    whose recipes and switches name none)."""
    return [formats.get(str(v)) for v in values if formats.known(v)]
