"""Where a policy lands on a model: the leaves its rules match, the submodule it goes on,
the plan of regions it puts there for a device kind, and the `Precision` object that
installs them. ``Policy.plan`` and ``Policy.apply`` are `plan` and `apply`.

A policy is data (`autoprec.policy`); this module reads it and never changes it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import nn

import autoprec.formats as formats
from autoprec.devices import (
    FIXED,
    Backend,
    autocast_behaviour,
    device_kind,
    failing_dtypes,
    get_backend,
)
from autoprec.errors import GuardError, PolicyError
from autoprec.numerics.observe import casts_inputs, lands_by_cast, probe
from autoprec.precision._placement import Placement, announce, place, within
from autoprec.precision.hooks import Precision
from autoprec.precision.plan import (
    AUTOCAST,
    AUTOCAST_INPUT_DTYPE,
    AUTOCAST_INPUTS_CAST,
    CAST,
    CONVERTED,
    FP32,
    FP32_BY_AUTOCAST,
    Plan,
    RegionSpec,
    boundaries,
    is_called,
    own_parameters,
    parameterised_leaves,
)

if TYPE_CHECKING:
    from autoprec.guard.settings import Guard
    from autoprec.precision.view import PolicyView


def matched_leaves(policy: PolicyView, model: nn.Module) -> list[tuple[str, nn.Module, str | None]]:
    """Each leaf with parameters and the dtype of its first matching rule (None where no
    rule matches); raises PolicyError for a rule that matches no such leaf."""
    used = [False] * len(policy.rules)
    found = []
    for name, module in parameterised_leaves(model):
        dtype = None
        for i, rule in enumerate(policy.rules):
            if rule.matches(name, module):
                used[i] = True
                dtype = dtype or rule.dtype
        found.append((name, module, dtype))
    for i, rule in enumerate(policy.rules):
        if not used[i]:
            raise PolicyError(
                f"rules[{i}] ({rule.describe()}): matches no module with parameters "
                f"in {type(model).__name__}"
            )
    return found


def plan(
    policy: PolicyView,
    model: nn.Module,
    device: str | torch.device | Backend | None = None,
    module: str | None = None,
) -> Plan:
    """Where the regions go on this model, for the device kind of ``device``: on the
    submodule the policy lands on (`autoprec.precision._placement`), the layers around
    it fp32 (``Policy.plan``, which says more)."""
    placement = _placement(policy, model, module)
    inner = _plan(policy, placement.module, device_kind(device, model))
    if placement.on_root:
        return inner
    return within(inner, placement.name, [name for name, _ in parameterised_leaves(model)])


def apply(
    policy: PolicyView,
    model: nn.Module,
    device: str | torch.device | Backend | None = None,
    module: str | None = None,
    emulate: str | tuple[str, ...] = (),
    guard: Guard | bool | None = None,
) -> Precision:
    """Install the per-layer dtypes on ``model`` and return its Precision object
    (``Policy.apply``, which says more); with a guard, its `GuardedPrecision`."""
    backend = get_backend(device_of(model) if device is None else device, emulate)
    probe(model, backend)  # as ``resolve`` does, so that both follow one plan
    placement = _placement(policy, model, module)
    planned = plan(policy, model, backend, placement.name)
    for dtype in sorted(set(planned.leaf_dtypes.values())):
        refusal = formats.get(dtype).refusal(backend)
        if refusal is not None:
            raise PolicyError(f"dtype {dtype}: {refusal}")
    _refuse_failing(model, planned, backend)
    settings = _guard_settings(policy, guard, backend)
    announce(placement, policy.name, len(parameterised_leaves(placement.module)))
    if settings is None:
        return Precision(model, planned, policy.loss_scale, backend)
    from autoprec.guard.precision import GuardedPrecision

    def replan(effective: PolicyView) -> Plan:
        return plan(effective, model, backend, placement.name or None)

    return GuardedPrecision(model, planned, policy, backend, settings, replan, placement.name)


def _guard_settings(
    policy: PolicyView, guard: Guard | bool | None, backend: Backend
) -> Guard | None:
    """The guard's settings: ``guard`` as given (True: the defaults, False: none), else the
    policy's own ``guard:`` section; a promotion target the device cannot run is refused."""
    from autoprec.guard.settings import Guard

    if guard is None:
        settings = policy.guard
    elif isinstance(guard, bool):
        settings = Guard() if guard else None
    elif isinstance(guard, Guard):
        settings = guard
    else:
        raise GuardError(f"guard: expected a Guard, True or False, got {type(guard).__name__}")
    if settings is not None:
        for dtype in settings.promote:
            if not backend.supports(dtype):
                raise GuardError(
                    f"guard.promote: {dtype} cannot run on device {backend.name}; "
                    "promote to what it runs (promote=['fp32'])"
                )
    return settings


def device_of(model: nn.Module) -> torch.device:
    """Where the model's parameters are (the CPU for a model without any)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _placement(policy: PolicyView, model: nn.Module, module: str | None) -> Placement:
    """Where on ``model`` the policy lands: a submodule that its parent calls (the region
    in the outer dtype goes on its forward) on which every rule matches."""

    def fits(candidate: nn.Module) -> bool:
        if candidate is not model and not is_called(candidate):
            return False
        leaves = parameterised_leaves(candidate)
        return all(any(rule.matches(n, m) for n, m in leaves) for rule in policy.rules)

    placement = place(model, fits, module)
    if not placement.on_root and not is_called(placement.module):
        raise PolicyError(
            f"module={placement.name!r}: a {type(placement.module).__name__} is not called "
            "by its parent; name the model the policy was found on"
        )
    return placement


def _plan(policy: PolicyView, model: nn.Module, kind: str) -> Plan:
    _refuse_serving_dtypes(policy)
    chosen: dict[str, str] = {}
    converted: dict[str, str] = {}  # leaf -> its conversion format: run in the region around
    landings: dict[str, str] = {}
    weight: Counter[str] = Counter()
    for name, module, ruled in matched_leaves(policy, model):
        dtype = ruled or policy.default
        if (kept := formats.get(dtype)).converts:
            refusal = kept.layer_refusal(module)
            if refusal is None:
                converted[name] = dtype
                continue
            if ruled is not None:
                raise PolicyError(f"{name} ({type(module).__name__}): cannot be {dtype}: {refusal}")
            dtype = kept.rest  # what the layers it cannot take run in
        landings[name] = _landing(kind, module, dtype, uniform=not policy.rules)
        if autocast_behaviour(kind, module) == FIXED and landings[name] != CAST:
            continue  # no region: autocast keeps it in fp32 anyway
        chosen[name] = dtype
        weight[dtype] += own_parameters(module)

    found = boundaries(model, chosen)
    if found.uniform is not None:
        outer = found.uniform
    elif found.dtypes:
        # The outer region takes the dtype holding most parameters: fewest boundaries.
        outer = max(sorted(weight), key=lambda d: (weight[d], formats.get(d).reference))
    else:
        default = formats.get(policy.default)
        outer = default.rest if default.converts else policy.default
    # Each same-dtype subtree in another dtype than the outer region gets a region.
    regions = {
        s.name: RegionSpec(s.name, s.dtype, outer)
        for s in found.subtrees
        if s.dtype is not None and s.dtype != outer
    }
    # A module that runs in its input's dtype gets its input cast, wherever it is (and one
    # that lands by cast, its parameters too): its surroundings are the outer region's at
    # a subtree's border, else its subtree's.
    for name in chosen:
        if landings[name] not in (AUTOCAST_INPUTS_CAST, CAST):
            continue
        subtree = found.subtree_of(name)
        if found.uniform is None and subtree is None:
            continue  # below a container its parent never calls: nothing runs it
        outside = outer if subtree is None or subtree.name == name else chosen[name]
        by_cast = landings[name] == CAST
        regions[name] = RegionSpec(name, chosen[name], outside, True, cast_parameters=by_cast)
    regions = {name: regions[name] for name, _ in model.named_modules() if name in regions}
    recipe = policy.fp8_recipe if any(formats.get(d).recipes for d in converted.values()) else None
    for name, dtype in converted.items():
        subtree = found.subtree_of(name)
        around = subtree.dtype if subtree is not None and subtree.dtype else outer
        refusal = formats.get(dtype).region_refusal(kind, recipe, around)
        if refusal is not None:
            raise PolicyError(
                f"quantization.{dtype}: {recipe} cannot run {name} inside a {around} "
                f"region on {kind}: {refusal}"
            )
    chosen.update(converted)
    landings.update(dict.fromkeys(converted, CONVERTED))
    leaves = [name for name, _ in parameterised_leaves(model)]
    fp32 = formats.reference().name
    return Plan(
        kind,
        outer,
        tuple(regions.values()),
        {name: chosen.get(name, fp32) for name in leaves},
        policy.tf32,
        policy.hf32,
        recipe,
        {name: landings[name] for name in leaves},
    )


def _landing(kind: str, module: nn.Module, dtype: str, uniform: bool) -> str:
    """How a leaf put in ``dtype`` lands there on this device kind (`Plan.landings`): by a
    cast where autocast fails it there and a cast runs, else by autocast, its inputs cast
    where the plan casts them (`casts_inputs`, the rule the profile follows too)."""
    if formats.get(dtype).reference:
        return FP32
    if lands_by_cast(kind, module, dtype):
        return CAST
    behaviour = autocast_behaviour(kind, module)
    if behaviour == FIXED:
        return FP32_BY_AUTOCAST
    if casts_inputs(kind, module, dtype, uniform):
        return AUTOCAST_INPUTS_CAST
    return AUTOCAST_INPUT_DTYPE if behaviour == "input" else AUTOCAST


def _refuse_serving_dtypes(policy: PolicyView) -> None:
    """Layers in a serving-only format (int8), and fp8 ones by a serving method, are
    converted for serving (`autoprec.load_served_model`); no region runs them."""
    for where, dtype in (
        *((f"rules[{i}]", rule.dtype) for i, rule in enumerate(policy.rules)),
        ("default", policy.default),
    ):
        if not formats.get(dtype).trains:
            raise PolicyError(
                f"{where}: {dtype} is for serving only (autoprec.load_served_model); "
                f"training runs {', '.join(formats.names('training'))}"
            )
    if policy.fp8_method is not None and policy.names_fp8:
        raise PolicyError(
            f"quantization.fp8: {policy.fp8_method} is a serving method "
            "(autoprec.load_served_model); training takes a torchao float8 recipe"
        )


def _refuse_failing(model: nn.Module, planned: Plan, backend: Backend) -> None:
    """A leaf put in a dtype it was seen to fail in on this device kind (an LSTM in fp16
    on the CPU: oneDNN has no such kernel) is refused before anything runs."""
    modules = dict(model.named_modules())
    for name, dtype in planned.leaf_dtypes.items():
        reason = failing_dtypes(backend.kind, modules[name]).get(dtype)
        if reason is not None:
            raise PolicyError(
                f"{name} ({type(modules[name]).__name__}): cannot run in {dtype} on "
                f"{backend.kind}: {reason}"
            )
