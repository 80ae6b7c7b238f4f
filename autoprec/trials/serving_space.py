"""The serving mode's space rules (`autoprec.space.SpaceRules`): policies convert the
layers' weights, so a space searches every layer with parameters, a leaf that shares a
parameter with an earlier one takes that leaf's group's dtype (one tensor has one dtype),
groups may take int8 and fp8 where their layers can be served so (by the methods settled
for the search, which the policies record), TF32 or HF32 is searched for the fp32 layers
on CUDA and Ascend, and no loss is scaled nor optimizer state searched."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import autoprec.formats as formats
from autoprec.devices import fp8_unavailable_reason
from autoprec.errors import SpaceError
from autoprec.precision.plan import parameterised_leaves, tied_leaves
from autoprec.precision.resolution import int8_capable
from autoprec.serving.fp8 import fp8_layer_refusal
from autoprec.space.policies import uniform_params

if TYPE_CHECKING:
    from torch import nn

    from autoprec.formats import Format
    from autoprec.optim.space import StateSpace
    from autoprec.policy import Policy
    from autoprec.space import Group, SpaceRules
    from autoprec.space.fields import SpaceFields, SpaceT

# The switch searched for the fp32 layers' matmuls, by device kind.
_SWITCHES = {"cuda": "tf32", "npu": "hf32"}


class ServingSpaceRules:
    converts_weights = True
    scales_loss = False  # serving scales no loss

    def searched_leaves(self, model: nn.Module, kind: str) -> list[tuple[str, nn.Module]]:
        """Every leaf with parameters: its weights are converted."""
        return parameterised_leaves(model)

    def refuse(
        self, space: SpaceFields, model: nn.Module, device: Any, fp8_method: str | None
    ) -> None:
        """fp8 is offered only where an fp8 serving method was settled for the search."""
        if not space.offers_fp8:
            return
        reason = fp8_unavailable_reason(device, model)
        if reason is None and fp8_method is None:
            reason = "fp8 serving is off (--fp8 off), or no fp8 serving method runs here"
        if reason is not None:
            raise SpaceError(f"{space.source}: dtypes: {reason}")

    def tie_followers(self, model: nn.Module) -> dict[str, str]:
        """Each leaf that shares a parameter with an earlier leaf, mapped to the first one."""
        return {name: group[0] for group in tied_leaves(model) for name in group[1:]}

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
        """int8 and fp8 offered where the groups' layers take them, the methods recorded,
        and the fp32 layers' matmuls in TF32 (CUDA) or HF32 (Ascend) searched."""
        kept = groups  # int8 (Linear, Conv1D) first, then fp8: the order a group offers them in
        for made in sorted(
            (f for f in formats.all_formats() if f.policy_records), key=lambda f: f.converts
        ):
            takes = partial(_fp8_takes, fp8_method) if made.converts else int8_capable
            kept = _where_it_fits(kept, assignment, model, made, takes)
        for made in formats.all_formats():  # MXFP8, MXFP4, NVFP4: where a space lists them
            if made.quantizes and not made.policy_records:
                kept = _where_every_layer_fits(kept, assignment, model, made)
        return replace(
            space,
            groups=tuple(kept),
            switch=_SWITCHES.get(kind),
            int8_method=int8_method,
            fp8_method=fp8_method,
        )

    def searched_states(self, space: SpaceFields) -> StateSpace | None:
        return None

    def fp8_made_with(self, space: SpaceFields, params: Mapping[str, Any]) -> str | None:
        """The fp8 serving method the space's layers were fitted for."""
        return space.fp8_method

    def fp8_fingerprint(self, space: SpaceFields) -> dict[str, Any]:
        return {"fp8_method": space.fp8_method}

    def uniform_fp8(self, space: SpaceFields, dtype: str) -> dict[str, Any]:
        """As int8: what fp8 cannot take stays fp32."""
        fp32 = formats.reference().name
        return {f"dtype.{g.name}": dtype if dtype in g.dtypes else fp32 for g in space.groups}

    def anchors(self, space: SpaceFields) -> dict[str, dict[str, Any]]:
        """fp16, bf16, int8 and fp8 where the layers take them, and the classic fp16 body
        with an fp32 head (the group of the model's last layer, whatever its name)."""
        anchors = {}
        low = [f for f in formats.all_formats() if f.low_precision]
        for made in (f for f in low if f.autocasts):  # fp16, bf16: every group, or none
            if all(made.name in g.dtypes for g in space.groups):
                anchors[f"uniform-{made.name}"] = uniform_params(space, made.name)
        # quantized (int8), then converted (fp8): where some group takes them
        for made in sorted((f for f in low if f.policy_records), key=lambda f: f.converts):
            if any(made.name in g.dtypes for g in space.groups):
                anchors[f"uniform-{made.name}"] = uniform_params(space, made.name)
        body = [g for g in space.groups if g.name != space.head]
        # fp16, whose narrow range training scales the loss for, with the head in fp32
        for made in (f for f in low if f.scales_loss and space.head is not None):
            if all(made.name in g.dtypes for g in body):
                head = {f"dtype.{space.head}": formats.reference().name}
                anchors[f"{made.name}-body-fp32-head"] = {
                    **uniform_params(space, made.name),
                    **head,
                }
        return anchors

    def recorded(
        self, space: SpaceFields, policy: Policy, dtypes: Mapping[str, str]
    ) -> dict[str, str]:
        """The switch, where one is searched (no loss scaling)."""
        if space.switch is None:
            return {}
        return {f"switch.{space.switch}": str(getattr(policy, space.switch))}


def _where_it_fits(
    groups: list[Group],
    assignment: dict[str, str],
    model: nn.Module,
    made: Format,
    takes: Callable[[nn.Module], bool],
) -> list[Group]:
    """``made`` (int8, fp8) offered to the groups with a layer it ``takes``; in a group
    where only some can (a decoder block with its norms), it takes those and the others
    stay fp32."""
    modules = dict(model.named_modules())
    capable: dict[str, list[str]] = {g.name: [] for g in groups}
    others: dict[str, int] = {g.name: 0 for g in groups}
    for leaf, group_name in assignment.items():
        if takes(modules[leaf]):
            capable[group_name].append(leaf)
        else:
            others[group_name] += 1
    fitted = []
    for group in groups:
        leaves, some = tuple(capable[group.name]), bool(others[group.name])
        dtypes = tuple(d for d in group.dtypes if d != made.name) + ((made.name,) if leaves else ())
        if made.converts:  # fp8's layers are named one by one
            group = replace(group, fp8_leaves=leaves, fp8_kept=bool(leaves) and some)
        else:
            group = replace(group, int8_leaves=leaves if some else ())
        fitted.append(replace(group, dtypes=dtypes))
    return fitted


def _where_every_layer_fits(
    groups: list[Group], assignment: dict[str, str], model: nn.Module, made: Format
) -> list[Group]:
    """``made`` left to the groups that list it and whose layers it all serves."""
    modules = dict(model.named_modules())
    refused = {
        group
        for leaf, group in assignment.items()
        if made.serving_layer_refusal(modules[leaf], None) is not None
    }
    return [
        replace(g, dtypes=tuple(d for d in g.dtypes if d != made.name)) if g.name in refused else g
        for g in groups
    ]


def _fp8_takes(method: str | None, module: nn.Module) -> bool:
    """Whether the fp8 serving ``method`` (None: fp8 is off) takes this layer
    (`autoprec.serving.fp8.fp8_layer_refusal`: a Linear it can serve)."""
    return method is not None and fp8_layer_refusal(module, method) is None


RULES: SpaceRules = ServingSpaceRules()
