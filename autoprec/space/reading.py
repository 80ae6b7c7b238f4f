"""Reading a space's YAML: each section checked on its own, every mistake one SpaceError
that names the file and the field."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import autoprec.formats as formats
from autoprec.dtypes import AUTOCAST_DTYPES
from autoprec.errors import PolicyError, SpaceError
from autoprec.formats.fp8 import DEFAULT_FP8_RECIPE, check_recipe
from autoprec.optim.space import StateSpace
from autoprec.policy import Rule
from autoprec.space.groups import AUTO_FIELDS, AutoGroups, Group
from autoprec.space.loss_scale import read_loss_scale

Fail = Callable[[str], SpaceError]

_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_SPACE_FIELDS = (
    "name",
    "description",
    "accuracy_tolerance",
    "dtypes",
    "groups",
    "auto_groups",
    "loss_scale",
    "fp8_recipes",
    "optimizer_states",
)
_GROUP_FIELDS = ("name", "patterns", "types", "dtypes", "optional")


def space_fields(data: Any, source: str) -> dict[str, Any]:
    """The fields of the `SearchSpace` a YAML mapping describes (``source``: where it was
    read, for messages)."""

    def fail(message: str) -> SpaceError:
        return SpaceError(f"{source}: {message}")

    if not isinstance(data, dict):
        raise fail("expected a mapping at the top")
    _refuse_unknown(data, _SPACE_FIELDS, "", fail)
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str) or not name:
        raise fail("name: expected a non-empty string")
    tolerance = data.get("accuracy_tolerance", 0.01)
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or tolerance < 0:
        raise fail(f"accuracy_tolerance: expected a number of at least 0, got {tolerance!r}")
    dtypes = _dtype_list(data.get("dtypes", list(AUTOCAST_DTYPES)), "dtypes", fail)
    recipes = _fp8_recipes(data.get("fp8_recipes", [DEFAULT_FP8_RECIPE]), fail)
    auto = _auto_groups(data, fail)
    groups = () if auto is not None else _groups(data.get("groups"), dtypes, fail)
    return {
        "name": name,
        "groups": groups,
        "accuracy_tolerance": float(tolerance),
        "loss_scale": read_loss_scale(data.get("loss_scale"), fail),
        "description": str(data.get("description", "")),
        "source": source,
        "dtypes": dtypes,
        "auto": auto,
        "fp8_recipes": recipes,
        **_optimizer_states(data, fail),
    }


def _optimizer_states(data: dict[str, Any], fail: Fail) -> dict[str, Any]:
    """The ``optimizer_states`` section: a mapping (`StateSpace`), or ``auto`` (the states
    `autoprec.optim.offered` offers, where the task trains with Adam or AdamW)."""
    if "optimizer_states" not in data:
        return {"optimizer_states": None}
    section = data["optimizer_states"]
    if section == "auto":
        return {"optimizer_states": None, "auto_states": True}
    if isinstance(section, str):
        raise fail(f"optimizer_states: expected a mapping or 'auto', got {section!r}")
    return {"optimizer_states": StateSpace.from_dict(section, fail)}


def _refuse_unknown(data: dict[str, Any], known: tuple[str, ...], where: str, fail: Fail) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise fail(f"{where}{unknown[0]}: unknown field (expected {list(known)})")


def _dtype_list(value: Any, where: str, fail: Fail) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise fail(f"{where}: expected a non-empty list of dtypes")
    for item in value:
        if not formats.known(item):  # a format registered from outside the package too
            raise fail(
                f"{where}: unknown dtype {item!r} "
                "(expected fp32, fp16, bf16, fp8 to train, or int8 to serve)"
            )
    return tuple(dict.fromkeys(formats.get(item).name for item in value))


def _fp8_recipes(recipes: Any, fail: Fail) -> tuple[str, ...]:
    if not isinstance(recipes, list) or not recipes:
        raise fail("fp8_recipes: expected a non-empty list of torchao float8 recipes")
    try:
        return tuple(dict.fromkeys(check_recipe(r, "fp8_recipes") for r in recipes))
    except PolicyError as error:
        raise fail(str(error)) from None


def _auto_groups(data: dict[str, Any], fail: Fail) -> AutoGroups | None:
    """`AutoGroups` for ``groups: auto`` (its ``auto_groups`` settings), else None."""
    if data.get("groups") != "auto":
        if "auto_groups" in data:
            raise fail("auto_groups: only with 'groups: auto'")
        return None
    settings = data.get("auto_groups") or {}
    if not isinstance(settings, dict):
        raise fail("auto_groups: expected a mapping")
    _refuse_unknown(settings, AUTO_FIELDS, "auto_groups.", fail)
    try:
        return AutoGroups(**settings)
    except SpaceError as error:
        raise fail(str(error)) from None


def _groups(data: Any, dtypes: tuple[str, ...], fail: Fail) -> tuple[Group, ...]:
    """The groups written by hand (``dtypes``: those of a group that lists none)."""
    if not isinstance(data, list) or not data:
        raise fail("groups: expected a non-empty list or 'auto'")
    groups: list[Group] = []
    for i, item in enumerate(data):
        groups.append(_group(item, f"groups[{i}]", dtypes, [g.name for g in groups], fail))
    return tuple(groups)


def _group(item: Any, where: str, dtypes: tuple[str, ...], earlier: list[str], fail: Fail) -> Group:
    """One group (``earlier``: the names of the groups before it)."""
    if not isinstance(item, dict):
        raise fail(f"{where}: expected a mapping")
    _refuse_unknown(item, _GROUP_FIELDS, f"{where}.", fail)
    name = item.get("name")
    if not isinstance(name, str) or not _GROUP_NAME.fullmatch(name):
        raise fail(f"{where}.name: expected a name of letters, digits, '.', '-' and '_'")
    if name in earlier:
        raise fail(f"{where}.name: group {name!r} is named twice")
    matching = {k: item[k] for k in ("patterns", "types") if k in item}
    try:
        rule = Rule.from_dict(matching | {"dtype": "fp32"}, where)
    except PolicyError as error:
        raise fail(str(error)) from None
    listed = _dtype_list(item.get("dtypes", list(dtypes)), f"{where}.dtypes", fail)
    optional = item.get("optional", False)
    if not isinstance(optional, bool):
        raise fail(f"{where}.optional: expected true or false")
    return Group(name, replace(rule, name=name), listed, optional)
