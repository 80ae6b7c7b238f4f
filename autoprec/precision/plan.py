"""One boundary algorithm: where casts go between layers of different dtypes.

Training (`autoprec.policy.Policy.plan`, regions under autocast) and serving
(`autoprec.serving.conversion`, weights converted, casts as hooks) both take each leaf's
dtype and ask the same question: which modules are the largest subtrees whose leaves all
take one dtype, so that one cast at each subtree's border does, rather than one per leaf
(wrapping every leaf cost up to 17% of a short step; see DESIGN.md). This module answers it
once, so a boundary bug is fixed in one place; each mode then puts its own kind of cast on
those subtrees. The low-precision share of a model is counted here too, from the same
``{leaf: dtype}`` mapping.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

import autoprec.formats as formats
from autoprec.dtypes import below_fp32
from autoprec.formats.fp8 import FP8

# How a leaf lands in its dtype (`Plan.landings`): autocast runs it in the region's dtype,
# in that dtype on its inputs cast first, or in its input's dtype as it arrives (a uniform
# policy: plain autocast); a cast (its parameters and inputs in the dtype, autocast off:
# where autocast fails it and a cast runs); fp32 as the policy says, fp32 whatever the
# policy says (autocast's fp32 list, or watched so), or converted by its format (fp8:
# torchao's Float8Linear).
AUTOCAST = "autocast"
AUTOCAST_INPUTS_CAST = "autocast, inputs cast"
AUTOCAST_INPUT_DTYPE = "autocast, input's dtype"
CAST = "cast"
FP32 = "fp32"
FP32_BY_AUTOCAST = "fp32 by autocast"
CONVERTED = "converted"


@dataclass(frozen=True)
class RegionSpec:
    """A module that runs in ``dtype`` inside surroundings of dtype ``around``; with
    ``cast_inputs``, its floating inputs are cast to ``dtype`` first (a module that runs
    in its input's dtype); with ``cast_parameters`` too, its own parameters are cast to
    ``dtype`` on the fly and autocast is off inside (a module autocast cannot run in
    ``dtype``: it lands by cast)."""

    name: str
    dtype: str
    around: str
    cast_inputs: bool = False
    cast_parameters: bool = False


@dataclass(frozen=True)
class Plan:
    """How a policy lands on one model on one device kind (``Policy.plan`` makes it): the
    dtype of the outer region entered by ``Precision.autocast()``, the modules that get a
    region of their own (as few as possible: whole same-dtype subtrees; a uniform policy
    needs none but for modules that run in their input's dtype), the dtype each
    parameterised leaf really runs in there (``fp8``: a Linear torchao converts, which
    has no region of its own and takes its inputs in the region around it), the TF32/HF32
    switches to set (None: leave the device's), the fp8 layers' torchao recipe (None
    where there are none), and how each parameterised leaf lands in its dtype
    (``autocast``, ``cast``, ``fp32 by autocast``...: the constants above)."""

    device_kind: str
    outer_dtype: str
    regions: tuple[RegionSpec, ...]
    leaf_dtypes: dict[str, str]
    tf32: bool | None = None
    hf32: bool | None = None
    fp8_recipe: str | None = None
    landings: dict[str, str] = field(default_factory=dict)

    @property
    def fp8_layers(self) -> tuple[str, ...]:
        """The leaves that run in fp8, in module order."""
        return self.converted.get(FP8.name, ())

    @property
    def converted(self) -> dict[str, tuple[str, ...]]:
        """Each conversion format's leaves (`autoprec.formats.Format.converts`), in module
        order, by the format's name."""
        found: dict[str, list[str]] = {}
        for name, dtype in self.leaf_dtypes.items():
            if formats.get(dtype).converts:
                found.setdefault(dtype, []).append(name)
        return {dtype: tuple(names) for dtype, names in found.items()}


@dataclass(frozen=True)
class Subtree:
    """A module called by its parent whose leaves (with a dtype) all take ``dtype``; None
    where no leaf below it has one (it runs in whatever surrounds it)."""

    name: str
    dtype: str | None


@dataclass(frozen=True)
class Boundaries:
    """Where a model's leaf dtypes meet: the dtypes below each module (``""`` is the model
    itself) and, where the model holds more than one, its largest same-dtype subtrees in
    module order. A model of one dtype (``uniform``) has no subtrees: it runs whole in it."""

    dtypes_below: dict[str, frozenset[str]]
    subtrees: tuple[Subtree, ...]

    @property
    def dtypes(self) -> frozenset[str]:
        """Every dtype some leaf of the model takes."""
        return self.dtypes_below[""]

    @property
    def uniform(self) -> str | None:
        """The model's one dtype, where its leaves agree (None where they do not, or where
        no leaf has one)."""
        return next(iter(self.dtypes)) if len(self.dtypes) == 1 else None

    def subtree_of(self, name: str) -> Subtree | None:
        """The subtree module ``name`` lies in (or is), None where it lies in none."""
        ancestors = set(name_and_ancestors(name))
        return next((s for s in self.subtrees if s.name in ancestors), None)

    def single_dtype(self, name: str) -> str | None:
        """The one dtype of the leaves below module ``name``, None unless they agree."""
        below = self.dtypes_below.get(name, frozenset())
        return next(iter(below)) if len(below) == 1 else None


def boundaries(model: nn.Module, leaf_dtypes: Mapping[str, str]) -> Boundaries:
    """The same-dtype subtrees of ``model`` for ``leaf_dtypes`` (leaf module name -> dtype;
    leaves not named take none). The search descends through modules whose leaves differ
    and through containers their parents do not call (``ModuleList``: a cast on it would
    never run), and stops at the first module below which one dtype, or none, remains."""
    below: dict[str, set[str]] = {name: set() for name, _ in model.named_modules()}
    for name, dtype in leaf_dtypes.items():
        for ancestor in {"", *name_and_ancestors(name)}:
            below[ancestor].add(dtype)
    frozen = {name: frozenset(dtypes) for name, dtypes in below.items()}
    subtrees: list[Subtree] = []

    def descend(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}.{child_name}" if prefix else child_name
            if len(frozen[full]) > 1 or not is_called(child):
                descend(full, child)
            else:
                subtrees.append(Subtree(full, next(iter(frozen[full]), None)))

    if len(frozen[""]) > 1:
        descend("", model)
    return Boundaries(frozen, tuple(subtrees))


def name_and_ancestors(name: str) -> tuple[str, ...]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``: the module names a pattern on ``name`` may
    match (the model itself, ``""``, is only itself)."""
    parts = name.split(".")
    return tuple(".".join(parts[: i + 1]) for i in range(len(parts)))


def selects(patterns: Sequence[str], types: Sequence[str], name: str, module: nn.Module) -> bool:
    """Whether a rule's ``patterns`` (on the module's name or an ancestor's) and ``types``
    (class names in its MRO) both take the module; an empty one takes every module."""
    if patterns and not any(
        fnmatch.fnmatchcase(prefix, pattern)
        for pattern in patterns
        for prefix in name_and_ancestors(name)
    ):
        return False
    return not types or bool({cls.__name__ for cls in type(module).__mro__} & set(types))


def is_called(module: nn.Module) -> bool:
    """Whether the module is called when its parent runs: containers without a forward
    (``ModuleList``, ``ModuleDict``) are not, their parents call their children, so a hook
    or a region meant for one must go on those children."""
    return type(module).forward is not nn.Module.forward


def parameterised_leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf modules that hold parameters of their own: the modules a policy assigns."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if next(module.children(), None) is None
        and next(module.parameters(recurse=False), None) is not None
    ]


def tied_leaves(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of leaves with parameters that share a parameter (a tied embedding and
    head), each in module order: a conversion gives them one dtype, or quantizes one of
    them to int8, so a search space keeps each group in one group."""
    owners: dict[int, list[str]] = {}
    for name, module in parameterised_leaves(model):
        for parameter in module.parameters(recurse=False):
            names = owners.setdefault(id(parameter), [])
            if name not in names:
                names.append(name)
    return sorted({tuple(names) for names in owners.values() if len(names) > 1})


def own_parameters(module: nn.Module) -> int:
    """How many parameters the module holds itself (not its children's)."""
    return sum(p.numel() for p in module.parameters(recurse=False))


def low_precision_share(model: nn.Module, leaf_dtypes: Mapping[str, str]) -> float:
    """Share of the parameters of the model's leaves with parameters that run below fp32
    (fp16, bf16, or served int8) in ``leaf_dtypes``; leaves not named count as fp32."""
    total = low = 0
    for name, module in parameterised_leaves(model):
        count = own_parameters(module)
        total += count
        low += count if below_fp32(leaf_dtypes.get(name, "fp32")) else 0
    return low / total if total else 0.0
