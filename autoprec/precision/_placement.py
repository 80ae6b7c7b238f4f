"""Placement: which submodule of a model a policy lands on, and its plan seen from the root.

A search runs on the task's model, so its policy names that model's layers (``fc1``,
``head``). Users hold that model inside something else: a LightningModule's ``self.net``,
their own ``nn.Module``, a DataParallel-style ``.module``. The policy lands on the model
itself where every rule matches there; otherwise on the one submodule where every rule
matches, or on the submodule named by ``module="net"``. On a submodule, its plan is moved
under that name: the submodule gets a region in the plan's outer dtype (its outputs handed
on in fp32), and the layers around it, which the policy never measured, stay in fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from torch import nn

import autoprec.formats as formats
from autoprec.errors import PolicyError
from autoprec.precision.plan import FP32, Plan, RegionSpec

_log = logging.getLogger("autoprec")


@dataclass(frozen=True)
class Placement:
    """The submodule a policy lands on: its dotted name (``""`` for the model itself)."""

    name: str
    module: nn.Module

    @property
    def on_root(self) -> bool:
        return not self.name


def place(model: nn.Module, fits: Callable[[nn.Module], bool], module: str | None) -> Placement:
    """The model itself if ``fits`` it, else the one submodule it fits; ``module`` names
    the submodule instead. Raises PolicyError where several fit, naming them; where none
    does, the model itself (whose plan then names the rule that matches nothing)."""
    if module is not None:
        return Placement(module, _named_submodule(model, module))
    if fits(model):
        return Placement("", model)
    fitting = [name for name, sub in model.named_modules() if name and fits(sub)]
    if len(fitting) > 1:
        names = ", ".join(repr(name) for name in fitting)
        raise PolicyError(
            f"the policy fits several submodules of {type(model).__name__} ({names}): "
            f'pass module="{fitting[0]}" (or another) to say which'
        )
    if not fitting:
        return Placement("", model)
    return Placement(fitting[0], model.get_submodule(fitting[0]))


def _named_submodule(model: nn.Module, name: str) -> nn.Module:
    if not isinstance(name, str):
        raise PolicyError(f"module={name!r}: expected a dotted submodule name such as 'net'")
    if not name:
        return model
    try:
        return model.get_submodule(name)
    except AttributeError:
        children = ", ".join(child for child, _ in model.named_children()) or "none"
        raise PolicyError(
            f"module={name!r}: {type(model).__name__} has no such submodule "
            f"(its children: {children})"
        ) from None


def within(plan: Plan, name: str, leaves: Iterable[str]) -> Plan:
    """The plan of submodule ``name`` seen from the root, whose layers with parameters are
    ``leaves``: its regions and layers named from the root, one region in the plan's outer
    dtype on the submodule, and fp32 around it."""
    regions = [replace(spec, name=_under(name, spec.name)) for spec in plan.regions]
    if formats.get(plan.outer_dtype).low_precision:
        regions.insert(0, RegionSpec(name, plan.outer_dtype, "fp32"))
    inside = {_under(name, leaf): dtype for leaf, dtype in plan.leaf_dtypes.items()}
    landed = {_under(name, leaf): landing for leaf, landing in plan.landings.items()}
    leaves = list(leaves)
    return replace(
        plan,
        outer_dtype="fp32",
        regions=tuple(regions),
        leaf_dtypes={leaf: inside.get(leaf, "fp32") for leaf in leaves},
        landings={leaf: landed.get(leaf, FP32) for leaf in leaves},
    )


def _under(name: str, inner: str) -> str:
    return f"{name}.{inner}" if inner else name


def announce(placement: Placement, policy_name: str | None, layers: int) -> None:
    """One line on the ``autoprec`` logger saying which submodule the policy landed on
    (nothing when it is the model itself: that is what the search measured)."""
    if placement.on_root:
        return
    _log.warning(
        "autoprec: %s applied to submodule %r (%s, %d layers)",
        f"policy {policy_name}" if policy_name else "the policy",
        placement.name,
        type(placement.module).__name__,
        layers,
    )
