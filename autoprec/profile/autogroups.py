"""Automatic groups: a search space shaped like the model.

A model is searched group by group, and the groups decide what a search can find. They
follow the model's own structure:

- **repeated blocks**: a module whose children are two or more blocks of one class (a
  ``ModuleList`` or ``Sequential`` such as ``transformer.h``, ``encoder.layer`` or a
  ResNet stage) is a run of blocks. Inside a block, leaves are grouped by *role*: the
  block's sub-module they sit in (``attn``, ``mlp``, ``attention``, ``downsample``), or
  for leaves directly in the block, their type family (``convs``, ``norms``,
  ``linears``, ``other``). Blocks of one class form one sequence, across containers
  (all four ResNet stages), so that a group is a range of blocks in one role:
  ``h.0-1.attn``, ``layer1.0-layer2.1.convs``;
- **everything else** is grouped by type family and position: the child of the model
  (looking through single-child wrappers) it sits under, or the shallowest sub-module
  that holds no repeated blocks (``norms.ln_f``, ``linears.pooler``);
- the **head**, the last layer in the model's order when it is outside the blocks, is a
  group of its own (``head``);
- with a sensitivity profile, the ``own`` riskiest modules come first as groups of their
  own (``risk.<name>``), so that the one layer that overflows is not tied to its
  harmless neighbours.

Neighbouring segments of a row (one role, or one family outside the blocks) are merged,
fewest parameters first, until there are at most ``max_groups`` groups. Groups are
plain (name, patterns, types) triples in first-match-wins order; `autoprec.space` turns
them into a space's groups.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from autoprec.errors import SpaceError

if TYPE_CHECKING:
    from autoprec.profile.sensitivity import Profile

# Type families, in group order; "other" takes what the others leave.
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("convs", ("_ConvNd",)),
    ("norms", ("_NormBase", "LayerNorm", "GroupNorm", "RMSNorm")),
    ("linears", ("Linear", "Bilinear")),
    ("other", ()),
)
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_.-]")
_NORM_NAME = re.compile(r"Norm(\d+d)?$")  # LayerNorm, RMSNorm, BatchNorm2d, T5LayerNorm


@dataclass(frozen=True)
class GroupSpec:
    """One automatic group: its name, and the rule that takes its leaves."""

    name: str
    patterns: tuple[str, ...]
    types: tuple[str, ...] = ()


@dataclass
class _Segment:
    """Neighbouring places of one row: one group once merging is done."""

    places: list[str]  # module paths, each covering everything below it
    labels: list[str]  # the same, readable
    parameters: int = 0


@dataclass
class _Row:
    """Segments that may merge with their neighbours: one role of a block class, or one
    family outside the blocks (or the head)."""

    kind: str  # "role" (a sub-module of the block), "family", "block" (whole blocks), "head"
    role: str  # the role or family name
    block: str | None = None  # the block class, for rows of blocks
    segments: list[_Segment] = field(default_factory=list)

    def add(self, place: str, label: str, parameters: int) -> None:
        if not self.segments or self.segments[-1].places[-1] != place:
            self.segments.append(_Segment([place], [label]))
        self.segments[-1].parameters += parameters


def build_groups(
    model: nn.Module,
    leaves: Sequence[tuple[str, nn.Module]],
    max_groups: int,
    own_groups: int,
    profile: Profile | None,
    source: str,
) -> list[GroupSpec]:
    """The groups of ``groups: auto`` for the searched ``leaves`` of ``model`` (see the
    module docstring)."""
    if not leaves:
        raise SpaceError(f"{source}: {type(model).__name__} has no module to search")
    own = _own_groups(model, leaves, own_groups, profile, source)
    taken = {leaf for covered in own.values() for leaf in covered}
    rows = _rows(model, [(n, m) for n, m in leaves if n not in taken])
    names: list[str] = []

    def spec(name: str, patterns: Sequence[str], types: Sequence[str] = ()) -> GroupSpec:
        names.append(_unique(name, names))
        return GroupSpec(names[-1], tuple(patterns), tuple(types))

    # A family's rule names its own classes and those of the leaves found in it (a norm
    # of another library's or the user's own is a norm by its name, not by its base).
    family_types = {
        family: types and (*types, *_named_only(leaves, family, types))
        for family, types in FAMILIES
    }
    groups = [spec(f"risk.{name}", (name,)) for name in own]
    budget = max_groups - len(own)
    if len(rows) > budget:  # too few groups for every role: the roles of a block merge
        rows = _merge_roles(rows, {name: i for i, (name, _) in enumerate(model.named_modules())})
    if len(rows) > budget:  # still too few: one group for the rest
        return [*groups, spec("rest", ("*",))]
    while sum(len(row.segments) for row in rows) > budget:
        # Merge, in the row with the most segments (of those, the one whose neighbours
        # hold fewest parameters), the neighbours with fewest parameters.
        row = max(rows, key=lambda r: (len(r.segments), -_cheapest_pair(r)[1]))
        segments = row.segments
        i = _cheapest_pair(row)[0]
        second = segments.pop(i + 1)
        segments[i].places += second.places
        segments[i].labels += second.labels
        segments[i].parameters += second.parameters
    for row in rows:
        for segment in row.segments:
            label = _range_label(segment.labels)
            if row.kind == "head":
                groups.append(spec("head", segment.places))
            elif row.kind == "block":
                groups.append(spec(label, segment.places))
            elif row.kind == "role":
                places = [f"{place}.{row.role}" for place in segment.places]
                groups.append(spec(f"{label}.{row.role}", places))
            elif row.block is not None:
                types = family_types[row.role]
                groups.append(spec(f"{label}.{row.role}", segment.places, types))
            else:
                types = family_types[row.role]
                groups.append(spec(f"{row.role}.{label}", segment.places, types))
    return groups


def _cheapest_pair(row: _Row) -> tuple[int, int]:
    """(index, parameters) of the neighbouring segments holding fewest parameters."""
    pairs = [
        (i, row.segments[i].parameters + row.segments[i + 1].parameters)
        for i in range(len(row.segments) - 1)
    ]
    return min(pairs, key=lambda pair: pair[1], default=(0, 0))


def _rows(model: nn.Module, leaves: Sequence[tuple[str, nn.Module]]) -> list[_Row]:
    """Every leaf placed in its row, in first-match-wins order: roles of blocks, then
    families inside blocks, then families outside them, then the head."""
    modules = dict(model.named_modules())
    blocks = repeated_blocks(model)
    level = _position_level(model)
    head = _head(leaves, blocks, modules, level)
    rows: dict[tuple[str, str, str | None], _Row] = {}
    for name, module in leaves:
        parameters = sum(p.numel() for p in module.parameters(recurse=False))
        block = _enclosing(name, blocks)
        if head is not None and _covers(head, name):
            key: tuple[str, str, str | None] = ("head", "head", None)
            place, label = head, head
        elif block is not None:
            path, label = block, blocks[block]
            rest = name[len(path) + 1 :].split(".")
            block_class = type(modules[path]).__name__
            if len(rest) > 1:  # inside a sub-module of the block: that is its role
                key = ("role", rest[0], block_class)
            else:
                key = ("family", _family(module), block_class)
            place = path
        else:
            place, label = _position(name, level, blocks, modules)
            key = ("family", _family(module), None)
        row = rows.setdefault(key, _Row(key[0], key[1], key[2]))
        row.add(place, label, parameters)
    family_order = [family for family, _ in FAMILIES]

    def order(row: _Row) -> tuple[int, int]:
        if row.kind == "role":
            return (0, 0)
        if row.kind == "family":
            return (1 if row.block is not None else 2, family_order.index(row.role))
        return (3, 0)

    return sorted(rows.values(), key=order)  # stable: model order within a rank


def _merge_roles(rows: list[_Row], order: dict[str, int]) -> list[_Row]:
    """The rows of each block class merged into one whose segments are whole blocks, for
    a budget smaller than the number of roles."""
    kept = [row for row in rows if row.block is None]
    merged: dict[str, dict[str, _Segment]] = {}
    for row in rows:
        if row.block is None:
            continue
        places = merged.setdefault(row.block, {})
        for segment in row.segments:
            for place, label in zip(segment.places, segment.labels, strict=True):
                places.setdefault(place, _Segment([place], [label]))
            places[segment.places[0]].parameters += segment.parameters
    blocks = [
        _Row("block", "", block, sorted(places.values(), key=lambda s: order[s.places[0]]))
        for block, places in merged.items()
    ]
    return [*blocks, *kept]


def repeated_blocks(model: nn.Module) -> dict[str, str]:
    """Each repeated block (the outermost ones) mapped to its readable label, e.g.
    ``transformer.h.3`` -> ``h.3``."""
    blocks: dict[str, str] = {}
    for name, module in model.named_modules():
        if any(_covers(block, name) for block in blocks):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(child) for _, child in children}) != 1:
            continue
        if next(children[0][1].children(), None) is None:
            continue  # leaves of one type are not blocks
        if next(module.parameters(), None) is None:
            continue
        label = name.rsplit(".", 1)[-1] if name else ""
        for child_name, _ in children:
            path = f"{name}.{child_name}" if name else child_name
            blocks[path] = f"{label}.{child_name}" if label else child_name
    return blocks


def _enclosing(name: str, blocks: dict[str, str]) -> str | None:
    return next((block for block in blocks if _covers(block, name) and block != name), None)


def _covers(prefix: str, name: str) -> bool:
    return name == prefix or name.startswith(f"{prefix}.")


def _head(
    leaves: Sequence[tuple[str, nn.Module]],
    blocks: dict[str, str],
    modules: dict[str, nn.Module],
    level: str,
) -> str | None:
    """The position of the model's last searched leaf when it is outside the blocks and
    not a norm (the output layer), if the model has more than one position."""
    if not blocks:
        return None
    name, module = leaves[-1]
    if _enclosing(name, blocks) is not None or _family(module) == "norms":
        return None
    return _position(name, level, blocks, modules)[0]


def _position_level(model: nn.Module) -> str:
    """The module whose children are the positions: the root, or the first module below
    it with more than one child (a model that wraps its backbone in one child)."""
    prefix, module = "", model
    while True:
        children = list(module.named_children())
        if len(children) != 1:
            return prefix
        name, module = children[0]
        prefix = f"{prefix}.{name}" if prefix else name


def _position(
    leaf: str, level: str, blocks: dict[str, str], modules: dict[str, nn.Module]
) -> tuple[str, str]:
    """(pattern, readable label) of the position a leaf outside the blocks sits at: the
    child of the level it is under, or below that the shallowest module holding no
    blocks."""
    if leaf == level:  # the chain of single children ends in this leaf
        return (leaf or "*"), (leaf.rsplit(".", 1)[-1] or "model")
    rest = (leaf[len(level) + 1 :] if level else leaf).split(".")
    path = level
    for part in rest:
        path = f"{path}.{part}" if path else part
        if not any(_covers(path, block) for block in blocks):
            return path, part
    return leaf, rest[-1]


def _range_label(labels: list[str]) -> str:
    """``h.0`` and ``h.1`` -> ``h.0-1``; ``layer1.2`` and ``layer2.0`` ->
    ``layer1.2-layer2.0``."""
    first, last = labels[0], labels[-1]
    if first == last:
        return first
    container, _, _ = first.rpartition(".")
    last_container, _, last_index = last.rpartition(".")
    if container and container == last_container:
        return f"{first}-{last_index}"
    return f"{first}-{last}"


def _own_groups(
    model: nn.Module,
    leaves: Sequence[tuple[str, nn.Module]],
    count: int,
    profile: Profile | None,
    source: str,
) -> dict[str, list[str]]:
    """The ``count`` riskiest modules of the profile (with risk above 0) that cover some
    searched leaf, and are neither inside nor around one chosen before, as long as the
    chosen together leave some leaf to the other groups (a profile may rank a whole
    backbone next to its head): module name -> the leaves it covers."""
    own: dict[str, list[str]] = {}
    if profile is None or count == 0:
        return own
    missing = profile.first_missing(model)
    if missing is not None:
        raise SpaceError(
            f"{source}: the profile of {profile.task!r} names module {missing!r}, "
            f"which {type(model).__name__} does not have"
        )
    for module in profile.modules:
        if len(own) == count or not module.risk > 0:
            break
        if any(_related(module.name, chosen) for chosen in own):
            continue
        covered = [n for n, _ in leaves if _covers(module.name, n)]
        taken = sum(len(names) for names in own.values())
        if covered and taken + len(covered) < len(leaves):
            own[module.name] = covered
    return own


def _related(a: str, b: str) -> bool:
    return _covers(a, b) or _covers(b, a)


def _named_only(
    leaves: Sequence[tuple[str, nn.Module]], family: str, types: tuple[str, ...]
) -> list[str]:
    """Classes of ``leaves`` in ``family`` by their name alone (no base in ``types``)."""
    return sorted(
        {
            type(m).__name__
            for _, m in leaves
            if _family(m) == family
            and not {c.__name__ for c in type(m).__mro__}.intersection(types)
        }
    )


def _family(module: nn.Module) -> str:
    """The module's type family: by its classes' names, and for the norms of other
    libraries and users (``LlamaRMSNorm``, ``T5LayerNorm``: plain ``nn.Module``
    subclasses) by a class name that ends in ``Norm``."""
    class_names = {cls.__name__ for cls in type(module).__mro__}
    if any(_NORM_NAME.search(name) for name in class_names):
        return "norms"
    for family, types in FAMILIES:
        if not types or class_names.intersection(types):
            return family
    raise AssertionError("the last family takes every module")


def _unique(name: str, taken: list[str]) -> str:
    """A valid group name, not yet taken."""
    name = _NOT_IN_NAME.sub("_", name)
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    return candidate
