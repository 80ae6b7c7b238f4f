"""Fitting a space to a model and a device for a mode: the groups it keeps, the leaves
each takes, and what they may run in there (the mode's `SpaceRules` decide the rest)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from autoprec.devices import device_kind
from autoprec.errors import SpaceError
from autoprec.modes import mode_of
from autoprec.policy import Rule
from autoprec.profile.autogroups import build_groups
from autoprec.space.groups import Group
from autoprec.space.rules import space_rules

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autoprec.devices import Backend
    from autoprec.modes import Mode
    from autoprec.profile.sensitivity import Profile
    from autoprec.space.fields import SpaceFields, SpaceT


def fit_space(
    space: SpaceT,
    model: nn.Module,
    profile: Profile | None = None,
    device: str | torch.device | Backend | None = None,
    mode: Mode | str | None = None,
    int8_method: str | None = None,
    fp8_method: str | None = None,
) -> SpaceT:
    """`SearchSpace.fit`: the space for this model on the device kind of ``device``,
    fitted for ``mode``: its groups (built here for ``groups: auto``), those that take no
    leaf dropped, the group of the model's last layer, and the leaves that share a
    parameter with an earlier one; the mode's rules fit the rest."""
    found = mode_of(mode)
    rules = space_rules(found)
    kind = device_kind(device, model)
    rules.refuse(space, model, device, fp8_method)
    followers = rules.tie_followers(model)
    fitted = replace(space, mode=found.name, ties=tuple((f, "") for f in followers))
    if space.auto is not None:
        leaves = [leaf for leaf in rules.searched_leaves(model, kind) if leaf[0] not in followers]
        specs = build_groups(
            model, leaves, space.auto.max_groups, space.auto.own_groups, profile, space.source
        )
        groups = tuple(
            Group(g.name, Rule("fp32", g.patterns, g.types, g.name), space.dtypes) for g in specs
        )
        fitted = replace(fitted, groups=groups, auto=None)
    kept = _kept_groups(fitted, model, kind)
    assigned = leaf_groups(fitted, model, kind)
    ties = tuple((f, assigned[leader]) for f, leader in followers.items() if leader in assigned)
    # The output layer is registered last; a head tied to the embedding is in its group.
    group_of = {**assigned, **dict(ties)}
    order = [n for n, _ in rules.searched_leaves(model, kind) if n in group_of]
    last = group_of[order[-1]]
    fitted = replace(fitted, head=last if len(kept) > 1 else None, ties=ties)
    return rules.fitted(fitted, kept, assigned, model, kind, int8_method, fp8_method)


def _kept_groups(space: SpaceFields, model: nn.Module, kind: str) -> list[Group]:
    """The groups that take some leaf; an optional one that takes none is dropped, any
    other is refused."""
    taken = set(leaf_groups(space, model, kind).values())
    kept = []
    for i, group in enumerate(space.groups):
        if group.name in taken:
            kept.append(group)
        elif not group.optional:
            raise SpaceError(
                f"{space.source}: groups[{i}] ({group.name}, {group.rule.describe()}): "
                f"matches no module with parameters in {type(model).__name__} "
                f"that an earlier group has not taken and whose dtype can change on {kind}"
            )
    if not kept:
        raise SpaceError(f"{space.source}: no group matches any module of {type(model).__name__}")
    return kept


def leaf_groups(
    space: SpaceFields, model: nn.Module, device: str | torch.device | Backend | None = None
) -> dict[str, str]:
    """`SearchSpace.assignment`: each searched leaf mapped to the group that takes it."""
    assigned = {}
    followers = {leaf for leaf, _ in space.ties}
    leaves = space_rules(space.mode).searched_leaves(model, device_kind(device, model))
    for name, module in leaves:
        if name in followers:
            continue  # it takes the dtype of the leaf it shares a parameter with
        for group in space.groups:
            if group.rule.matches(name, module):
                assigned[name] = group.name
                break
    return assigned


def group_risk(space: SpaceFields, profile: Profile, model: nn.Module) -> list[tuple[str, float]]:
    """`SearchSpace.group_risk`: the groups with their risk in ``profile``, riskiest first."""
    if not space.groups:
        raise SpaceError(f"{space.source}: fit the space to the model before group_risk")
    missing = profile.first_missing(model)
    if missing is not None:
        raise SpaceError(
            f"profile of {profile.task!r}: module {missing!r} is not in "
            f"{type(model).__name__}; profile the same model"
        )
    group_of = leaf_groups(space, model, device_kind(profile.device))
    risks = {group.name: 0.0 for group in space.groups}
    first_rank = {group.name: len(profile.modules) + 1 for group in space.groups}
    for module in profile.modules:  # riskiest first: the first to set a risk ranks best
        for leaf, group in group_of.items():
            covers = leaf == module.name or leaf.startswith(f"{module.name}.")
            if covers and module.risk > risks[group]:
                risks[group], first_rank[group] = module.risk, module.rank
    order = sorted(risks, key=lambda name: (-risks[name], first_rank[name]))
    return [(name, risks[name]) for name in order]


def fp8_group_order(space: SpaceFields, profile: Profile, model: nn.Module) -> list[str]:
    """The (fitted) space's groups that hold fp8-risk figures in ``profile``, riskiest
    first by the largest fp8 risk of the layers each assigns (groups without any are left
    out: the guided search takes them as the least risky)."""
    group_of = leaf_groups(space, model, device_kind(profile.device))
    risks: dict[str, float] = {}
    for module in profile.modules:
        if module.fp8_risk is None:
            continue
        for leaf, group in group_of.items():
            if leaf == module.name or leaf.startswith(f"{module.name}."):
                risks[group] = max(risks.get(group, 0.0), module.fp8_risk)
    names = [g.name for g in space.groups]
    return sorted(risks, key=lambda g: (-risks[g], names.index(g)))


def restrict_space(space: SpaceT, supported: set[str]) -> SpaceT:
    """`SearchSpace.restrict`: the space without the dtypes a device cannot run."""
    groups = []
    for group in space.groups:
        dtypes = tuple(d for d in group.dtypes if d in supported)
        if not dtypes:
            raise SpaceError(
                f"{space.source}: group {group.name!r}: none of its dtypes "
                f"({', '.join(group.dtypes)}) runs on this device"
            )
        groups.append(replace(group, dtypes=dtypes))
    dtypes = tuple(d for d in space.dtypes if d in supported)
    if space.auto is not None and not dtypes:
        raise SpaceError(
            f"{space.source}: dtypes: none of {', '.join(space.dtypes)} runs on this device"
        )
    return replace(space, groups=tuple(groups), dtypes=dtypes)
