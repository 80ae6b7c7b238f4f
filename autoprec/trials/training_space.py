"""The training mode's space rules (`autoprec.space.SpaceRules`): policies run the layers
under autocast, so a space searches the layers whose dtype autocast lets a policy change,
offers each group the dtypes its layers can train in on the device (fp8 where torchao
converts every layer of it, by the recipes that run there), and searches loss scaling
beside fp16 and the optimizer states its section lists. It is the base `Mode`'s: a mode
that names no rules of its own fits its spaces as training does."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import autoprec.formats as formats
from autoprec.devices import autocast_behaviour, failing_dtypes, fp8_unavailable_reason
from autoprec.errors import SpaceError
from autoprec.precision.plan import parameterised_leaves
from autoprec.space.groups import Group, dtype_beside, formats_among, widest
from autoprec.space.loss_scale import flat_loss_scale
from autoprec.space.policies import uniform_params

if TYPE_CHECKING:
    from torch import nn

    from autoprec.formats import Format
    from autoprec.optim.space import StateSpace
    from autoprec.policy import Policy
    from autoprec.space import SpaceRules
    from autoprec.space.fields import SpaceFields, SpaceT


class TrainingSpaceRules:
    converts_weights = False
    scales_loss = True

    def searched_leaves(self, model: nn.Module, kind: str) -> list[tuple[str, nn.Module]]:
        """All but the leaves autocast runs in fp32 there whatever a policy says
        (embeddings everywhere, LayerNorm and GroupNorm on CUDA and Ascend)."""
        leaves = parameterised_leaves(model)
        fixed = formats.reference().name  # what autocast says of a layer it runs in fp32
        return [(n, m) for n, m in leaves if autocast_behaviour(kind, m) != fixed]

    def refuse(self, space: SpaceFields, model: nn.Module, device: Any, fp8_method: Any) -> None:
        """int8 is a serving choice (a training search would silently leave it out); fp8
        is offered only on a device that runs it."""
        listed = [("dtypes", space.dtypes)] + [
            (f"groups[{i}].dtypes", g.dtypes) for i, g in enumerate(space.groups)
        ]
        for where, dtypes in listed:
            for made in formats_among(dtypes):
                if "training" not in made.modes:
                    raise SpaceError(
                        f"{space.source}: {where}: {made.name} is for serving (--mode serving); "
                        "a training search runs fp32, fp16 and bf16"
                    )
        reason = fp8_unavailable_reason(device, model) if space.offers_fp8 else None
        if reason is not None:
            raise SpaceError(f"{space.source}: dtypes: {reason}")

    def tie_followers(self, model: nn.Module) -> dict[str, str]:
        return {}  # a tied parameter trains in the dtype of whichever layer computes with it

    def fitted(
        self,
        space: SpaceT,
        groups: list[Group],
        assignment: dict[str, str],
        model: nn.Module,
        kind: str,
        int8_method: str | None,
        fp8_method: str | None,
    ) -> SpaceT:
        """Each group without the dtypes some layer of it fails in on the device kind,
        with fp8 only where torchao converts its layers (and the recipes that run there),
        and the optimizer-state groups fitted to the model's parameters."""
        kept = _without_failing_dtypes(groups, assignment, model, kind)
        fitted = replace(space, int8_method=None, fp8_method=None)
        for made in formats.all_formats():  # fp8, MXFP8: where a group's layers take it
            if made.converts and any(made.name in g.dtypes for g in kept):
                kept = _with_fp8_where_it_fits(kept, assignment, model, space.source, made)
            if made.records_conversion and space.offers_fp8:
                fitted = replace(fitted, fp8_recipes=_runnable_recipes(space, kept, kind, made))
        if space.optimizer_states is not None:
            states = space.optimizer_states.fit(model, lambda m: SpaceError(f"{space.source}: {m}"))
            fitted = replace(fitted, optimizer_states=states)
        return replace(fitted, groups=tuple(kept))

    def searched_states(self, space: SpaceFields) -> StateSpace | None:
        return space.optimizer_states

    def fp8_made_with(self, space: SpaceFields, params: Mapping[str, Any]) -> str | None:
        """The torchao float8 recipe chosen (``fp8.recipe``), or the space's only one."""
        return params.get("fp8.recipe", space.fp8_recipes[0])  # type: ignore[no-any-return]

    def fp8_fingerprint(self, space: SpaceFields) -> dict[str, Any]:
        return {"fp8_recipes": space.fp8_recipes}

    def uniform_fp8(self, space: SpaceFields, dtype: str) -> dict[str, Any]:
        """fp8 where a group can take it, the rest beside it as `dtype_beside` says (bf16
        where it may: torchao's float8 inside bf16 autocast), with the anchor's recipe."""
        params: dict[str, Any] = {f"dtype.{g.name}": dtype_beside(g, dtype) for g in space.groups}
        if len(space.fp8_recipes) > 1:
            params["fp8.recipe"] = space.anchor_recipe
        return params

    def anchors(self, space: SpaceFields) -> dict[str, dict[str, Any]]:
        """fp16 as ``model.half()`` gives it (no loss scaling) and as Apex O1/O2 or
        GradScaler give it (dynamic scaling), bf16, fp8 where some group offers it, and
        the optimizer states' own anchors."""
        anchors = {}
        for made in _low_autocast():
            if not all(made.name in g.dtypes for g in space.groups):
                continue
            params = uniform_params(space, made.name)
            anchors[f"uniform-{made.name}"] = params
            scaled = params.get("loss_scale.mode", "none") != "none"
            if made.scales_loss and scaled and "none" in space.loss_scale.modes:
                # the layers' dtypes and the optimizer states (fp32) without the scaling
                unscaled = {k: v for k, v in params.items() if not k.startswith("loss_scale.")}
                anchors[f"uniform-{made.name}-noscale"] = {**unscaled, "loss_scale.mode": "none"}
        for made in formats.all_formats():
            if made.records_conversion and any(made.name in g.dtypes for g in space.groups):
                anchors[f"uniform-{made.name}"] = uniform_params(space, made.name)
        if space.optimizer_states is not None:
            # the states' anchors beside each group's widest dtype (fp32 where it may)
            high = uniform_params(space, formats.reference().name)
            high.update({f"dtype.{g.name}": widest(g.dtypes) for g in space.groups})
            anchors.update(space.optimizer_states.anchors(high))
        return anchors

    def recorded(
        self, space: SpaceFields, policy: Policy, dtypes: Mapping[str, str]
    ) -> dict[str, str]:
        """The loss scaling, the fp8 recipe, the reduce dtype and the optimizer states,
        each where the space searches it."""
        flat = flat_loss_scale(policy.loss_scale)
        if space.offers_fp8:
            converted = any(f.records_conversion for f in formats_among(dtypes.values()))
            flat["fp8.recipe"] = policy.fp8_recipe if converted else "-"
        if space.reduce_dtypes:
            flat[space.reduce_param] = policy.reduce_dtype or "fp32"
        if space.optimizer_states is not None:
            flat.update(space.optimizer_states.flat_params(policy.optimizer_states))
        return flat


def _without_failing_dtypes(
    groups: list[Group], assignment: dict[str, str], model: nn.Module, kind: str
) -> list[Group]:
    """Each group without the dtypes some layer of it was seen to fail in on this device
    kind (`autoprec.numerics.observe.learn`: an LSTM in fp16 on the CPU), so that no policy
    the space offers crashes for a combination the device cannot run."""
    modules = dict(model.named_modules())
    failing: dict[str, set[str]] = {g.name: set() for g in groups}
    for name, group in assignment.items():
        failing[group].update(failing_dtypes(kind, modules[name]))
    return [
        replace(g, dtypes=tuple(d for d in g.dtypes if d not in failing[g.name])) for g in groups
    ]


def _with_fp8_where_it_fits(
    groups: list[Group], assignment: dict[str, str], model: nn.Module, source: str, made: Format
) -> list[Group]:
    """fp8 (``made``, a converted format) offered to the groups whose layers it can all
    convert (for fp8, plain Linear layers with dimensions that are multiples of 16), and to
    no other: a group offered only fp8 with a layer it cannot take is refused, naming it."""
    modules = dict(model.named_modules())
    leaves: dict[str, list[str]] = {g.name: [] for g in groups}
    refused: dict[str, str] = {}
    for leaf, group_name in assignment.items():
        leaves[group_name].append(leaf)
        reason = made.layer_refusal(modules[leaf])
        if reason is not None and group_name not in refused:
            refused[group_name] = f"{leaf} ({type(modules[leaf]).__name__}): {reason}"
    fitted = []
    for group in groups:
        others = tuple(d for d in group.dtypes if d != made.name)
        if others == group.dtypes:
            fitted.append(group)
        elif group.name not in refused:
            own = tuple(leaves[group.name]) if made.records_conversion else group.fp8_leaves
            fitted.append(replace(group, fp8_leaves=own))
        elif not others:
            raise SpaceError(
                f"{source}: group {group.name!r}: offers only {made.name}, but "
                f"{refused[group.name]}"
            )
        else:
            fitted.append(replace(group, dtypes=others))
    return fitted


def _runnable_recipes(
    space: SpaceFields, groups: list[Group], kind: str, made: Format
) -> tuple[str, ...]:
    """The space's recipes without those ``made`` (fp8) says fail on this device kind inside
    the region some group may put around its layers (fp16, bf16)."""
    low = _low_autocast()
    regions = [f.name for g in groups for f in formats_among(g.dtypes) if f in low]
    if not regions:
        return space.fp8_recipes
    refused = {r: made.region_refusal(kind, r, regions[0]) for r in space.fp8_recipes}
    kept = tuple(recipe for recipe, why in refused.items() if why is None)
    if not kept:
        recipe = space.fp8_recipes[0]
        raise SpaceError(f"{space.source}: fp8_recipes: {recipe} on {kind}: {refused[recipe]}")
    return kept


def _low_autocast() -> list[Format]:
    """The formats below fp32 a region autocasts to (fp16, bf16)."""
    return [f for f in formats.all_formats() if f.autocasts and f.low_precision]


RULES: SpaceRules = TrainingSpaceRules()
