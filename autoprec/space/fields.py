"""`SpaceFields`: what a search space holds, as plain data, below the modules that act on
a space (``fitting``, ``policies``, ``rules``); `SearchSpace` (``base``) is it with the
thin methods that call them, so that they type a space by its fields and never import the
class whose methods import them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import autoprec.formats as formats
from autoprec.dtypes import AUTOCAST_DTYPES
from autoprec.formats.fp8 import DEFAULT_FP8_RECIPE
from autoprec.modes import DEFAULT_MODE
from autoprec.optim.space import StateSpace
from autoprec.space.groups import AutoGroups, Group
from autoprec.space.loss_scale import LossScaleSpace

FSDP_REDUCE_PARAM = "fsdp.reduce_dtype"  # the reduce dtype's parameter under FSDP2
DDP_REDUCE_PARAM = "ddp.reduce_dtype"  # and under DDP (its compression hook)


@dataclass(frozen=True)
class SpaceFields:
    """What a space holds, as read (groups by hand, or ``auto`` until fitted) or fitted to
    a model, a device and a mode: the groups and the dtypes each may take, and the rest of
    what a search chooses. `autoprec.space.base.SearchSpace` is it with its methods."""

    name: str
    groups: tuple[Group, ...]
    accuracy_tolerance: float = 0.01
    loss_scale: LossScaleSpace = field(default_factory=LossScaleSpace)
    description: str = ""
    source: str = "<space>"
    dtypes: tuple[str, ...] = AUTOCAST_DTYPES  # fp8 only where a space lists it
    auto: AutoGroups | None = None  # set until ``fit`` builds the groups of ``groups: auto``
    # the mode it was fitted for (`autoprec.modes.MODES`), whose `SpaceRules` it follows
    mode: str = DEFAULT_MODE
    switch: str | None = None  # fitted where a mode searches it: "tf32" or "hf32"
    head: str | None = None  # fitted: the group of the model's last layer, when it has others
    # fitted where tied leaves are searched with their leader: (leaf, group) for each leaf
    # sharing a parameter with an earlier leaf, which takes the dtype of that leaf's group
    # (one tensor has one dtype)
    ties: tuple[tuple[str, str], ...] = ()
    # fitted where weights are converted: the method its int8 layers are measured with,
    # which every policy with an int8 layer records (`autoprec.serving.quantizers`), so it
    # serves what was measured
    int8_method: str | None = None
    # torchao float8 recipes searched for the fp8 layers (``fp8.recipe`` where several)
    fp8_recipes: tuple[str, ...] = (DEFAULT_FP8_RECIPE,)
    # fitted where weights are converted: the method its fp8 layers are measured with
    # (`autoprec.serving.fp8`), recorded in every policy with an fp8 layer, as int8's is
    fp8_method: str | None = None
    # trials on several devices: the dtypes gradients may be communicated in, searched as
    # ``reduce_param`` where several (``fsdp.reduce_dtype`` under FSDP2, ``ddp.reduce_dtype``
    # under DDP; `autoprec.distributed`); empty elsewhere
    reduce_dtypes: tuple[str, ...] = ()
    reduce_param: str = FSDP_REDUCE_PARAM
    # the optimizer state kinds and master dtypes searched per parameter group (the
    # ``optimizer_states`` section, `autoprec.optim.space`); None: not searched
    optimizer_states: StateSpace | None = None
    # ``optimizer_states: auto``: the states `autoprec.optim.offered` offers, fitted where
    # the task trains with Adam or AdamW (as ``--prefer memory`` offers them to a space
    # without the section)
    auto_states: bool = False
    # fitted: what the fitting left out and why, one line each, for the user (not searched,
    # so not in the fingerprint)
    notes: tuple[str, ...] = ()

    @property
    def offers_fp8(self) -> bool:
        """Whether some group may take fp8."""
        offered = [d for g in self.groups for d in g.dtypes]
        offered += list(self.dtypes) if self.auto is not None else []
        return any(formats.get(d).records_conversion for d in offered)

    @property
    def anchor_recipe(self) -> str:
        """The fp8 recipe of the uniform-fp8 anchor and the guided search's fp8 probes:
        torchao's default (tensorwise) where the space searches it, else its first."""
        recipes = self.fp8_recipes
        return DEFAULT_FP8_RECIPE if DEFAULT_FP8_RECIPE in recipes else recipes[0]


# A space, fitted or not, as a function that returns one of the same class takes it.
SpaceT = TypeVar("SpaceT", bound=SpaceFields)
