"""Search spaces: which dtypes each group of layers may take, and the loss-scale ranges.

A space is read from YAML (see ``search_spaces/*.yaml``)::

    name: digits-mlp
    accuracy_tolerance: 0.01     # feasible when accuracy drops at most this much from fp32
    dtypes: [fp32, fp16, bf16]   # choices of a group that lists none
    groups:                      # first match wins, as in a policy
      - {name: fc1, patterns: [fc1]}
      - {name: norms, types: [LayerNorm], dtypes: [fp32, bf16]}
    loss_scale:
      modes: [none, static, dynamic]
      static_scale_log2: [0, 24]   # static scale 2**k, k in this range
      init_scale_log2: [8, 24]     # dynamic: initial scale 2**k
      growth_interval: [10, 2000]  # dynamic: sampled on a log scale
      hysteresis: [1, 1]           # dynamic: a fixed value when both ends agree

Each Optuna parameter is named after what it sets: ``dtype.<group>``,
``loss_scale.mode``, ``loss_scale.init_scale_log2`` and so on. Loss scaling is only
searched when some group is fp16: bf16 has fp32's exponent range and needs none.
Layers with parameters that no group takes stay in fp32 (add a catch-all group such as
``{name: rest, patterns: ["*"], optional: true}`` to search them too).

``groups: auto`` (with ``auto_groups: {max_groups: 12, own_groups: 3}``, the defaults)
builds the groups when the space is fitted to a model: following its structure
(``h.0-1.attn``, ``h.2-3.mlp``, ``norms.ln_f``, ``head``), with the riskiest modules of a
sensitivity profile first as groups of their own (``risk.features``); see
`autoprec.profile.autogroups`. The fitted space holds the concrete groups, and its fingerprint
says so.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from autoprec._util.files import load_yaml
from autoprec.devices import (
    Backend,
    autocast_behaviour,
    device_kind,
    failing_dtypes,
    fp8_unavailable_reason,
)
from autoprec.dtypes import AUTOCAST_DTYPES, FP8, LOW_PRECISION, POLICY_DTYPES
from autoprec.errors import PolicyError, SpaceError
from autoprec.optim.space import StateSpace
from autoprec.optim.state import OptimizerStates
from autoprec.policy import (
    Policy,
    Quantization,
    Rule,
    int8_capable,
    parameterised_leaves,
    tied_leaves,
)
from autoprec.precision.fp8 import (
    DEFAULT_FP8_RECIPE,
    FAILS_UNDER_AUTOCAST,
    check_recipe,
    fp8_refusal,
)
from autoprec.precision.scaling import LOSS_SCALE_MODES, LossScale
from autoprec.profile.autogroups import build_groups
from autoprec.serving.fp8 import fp8_layer_refusal

if TYPE_CHECKING:
    from autoprec.profile.sensitivity import Profile

DEFAULT_SPACE = "default"
FSDP_REDUCE_PARAM = "fsdp.reduce_dtype"  # the reduce dtype's parameter under FSDP2
DDP_REDUCE_PARAM = "ddp.reduce_dtype"  # and under DDP (its compression hook)
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
_AUTO_FIELDS = ("max_groups", "own_groups")
_GROUP_FIELDS = ("name", "patterns", "types", "dtypes", "optional")
_RANGE_FIELDS = {
    "static_scale_log2": (0, 24),
    "init_scale_log2": (16, 16),
    "growth_interval": (2000, 2000),
    "hysteresis": (1, 1),
}
# Dynamic-scaling settings searched as a choice among listed values (one value: fixed).
_CHOICE_FIELDS: dict[str, tuple[float, ...]] = {
    "growth_factor": (2.0,),
    "backoff_factor": (0.5,),
    "min_scale": (0.0,),
}
_TORCH_DEFAULTS = {
    "static_scale_log2": 16,
    "init_scale_log2": 16,
    "growth_interval": 2000,
    "hysteresis": 1,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "min_scale": 0.0,
}


class Suggester(Protocol):
    """What a space needs from an Optuna trial (``optuna.Trial`` satisfies it)."""

    def suggest_categorical(self, name: str, choices: Any) -> Any: ...

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int: ...


@dataclass(frozen=True)
class Group:
    """Layers searched together. An optional group that matches nothing in a model is
    dropped for that model; any other group must match something."""

    name: str
    rule: Rule
    dtypes: tuple[str, ...]
    optional: bool = False
    # fitted for serving, where only some of its layers can be int8 (a decoder block's
    # Linear layers beside its norms): the layers int8 takes; the others stay fp32
    int8_leaves: tuple[str, ...] = ()
    # fitted for training where it offers fp8: its layers, each of which fp8 can take, named
    # one by one so that an fp8 rule never meets a layer the group does not search
    fp8_leaves: tuple[str, ...] = ()
    # fitted for serving, where only some of its layers can be fp8: the others stay fp32
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
        for key in _AUTO_FIELDS:
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


@dataclass(frozen=True)
class LossScaleSpace:
    modes: tuple[str, ...] = ("none", "static", "dynamic")
    ranges: Mapping[str, tuple[int, int]] = field(default_factory=lambda: dict(_RANGE_FIELDS))
    choices: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: dict(_CHOICE_FIELDS))


@dataclass(frozen=True)
class SearchSpace:
    name: str
    groups: tuple[Group, ...]
    accuracy_tolerance: float = 0.01
    loss_scale: LossScaleSpace = field(default_factory=LossScaleSpace)
    description: str = ""
    source: str = "<space>"
    dtypes: tuple[str, ...] = AUTOCAST_DTYPES  # fp8 only where a space lists it
    auto: AutoGroups | None = None  # set until ``fit`` builds the groups of ``groups: auto``
    inference: bool = False  # fitted for serving: weights converted, int8 possible
    switch: str | None = None  # serving on CUDA or Ascend: "tf32" or "hf32" is searched too
    head: str | None = None  # fitted: the group of the model's last layer, when it has others
    # fitted for serving: (leaf, group) for each leaf sharing a parameter with an earlier
    # leaf, which takes the dtype of that leaf's group (one tensor has one dtype)
    ties: tuple[tuple[str, str], ...] = ()
    # fitted for serving: the method its int8 layers are measured with, which every policy
    # with an int8 layer records (`autoprec.serving.quantizers`), so it serves what was measured
    int8_method: str | None = None
    # torchao float8 recipes searched for the fp8 layers (``fp8.recipe`` where several)
    fp8_recipes: tuple[str, ...] = (DEFAULT_FP8_RECIPE,)
    # fitted for serving: the method its fp8 layers are measured with (`autoprec.serving.fp8`),
    # recorded in every policy with an fp8 layer, as int8's is
    fp8_method: str | None = None
    # trials on several devices: the dtypes gradients may be communicated in, searched as
    # ``reduce_param`` where several (``fsdp.reduce_dtype`` under FSDP2, ``ddp.reduce_dtype``
    # under DDP; `autoprec.distributed`); empty elsewhere
    reduce_dtypes: tuple[str, ...] = ()
    reduce_param: str = FSDP_REDUCE_PARAM
    # the optimizer state kinds and master dtypes searched per parameter group (the
    # ``optimizer_states`` section, `autoprec.optim.space`); None: not searched
    optimizer_states: StateSpace | None = None

    @property
    def offers_fp8(self) -> bool:
        """Whether some group may take fp8."""
        return any(FP8 in g.dtypes for g in self.groups) or (
            self.auto is not None and FP8 in self.dtypes
        )

    # -- reading -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, source: str) -> SearchSpace:
        def fail(message: str) -> SpaceError:
            return SpaceError(f"{source}: {message}")

        if not isinstance(data, dict):
            raise fail("expected a mapping at the top")
        unknown = sorted(set(data) - set(_SPACE_FIELDS))
        if unknown:
            raise fail(f"{unknown[0]}: unknown field (expected {list(_SPACE_FIELDS)})")
        name = data.get("name", Path(source).stem)
        if not isinstance(name, str) or not name:
            raise fail("name: expected a non-empty string")
        tolerance = data.get("accuracy_tolerance", 0.01)
        if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or tolerance < 0:
            raise fail(f"accuracy_tolerance: expected a number of at least 0, got {tolerance!r}")
        space_dtypes = _dtype_list(data.get("dtypes", list(AUTOCAST_DTYPES)), "dtypes", fail)
        recipes = data.get("fp8_recipes", [DEFAULT_FP8_RECIPE])
        if not isinstance(recipes, list) or not recipes:
            raise fail("fp8_recipes: expected a non-empty list of torchao float8 recipes")
        try:
            recipes = tuple(dict.fromkeys(check_recipe(r, "fp8_recipes") for r in recipes))
        except PolicyError as error:
            raise fail(str(error)) from None
        groups_data = data.get("groups")
        auto = None
        if groups_data == "auto":
            auto_data = data.get("auto_groups") or {}
            if not isinstance(auto_data, dict):
                raise fail("auto_groups: expected a mapping")
            unknown = sorted(set(auto_data) - set(_AUTO_FIELDS))
            if unknown:
                raise fail(
                    f"auto_groups.{unknown[0]}: unknown field (expected {list(_AUTO_FIELDS)})"
                )
            try:
                auto = AutoGroups(**auto_data)
            except SpaceError as error:
                raise fail(str(error)) from None
            groups_data = []
        elif "auto_groups" in data:
            raise fail("auto_groups: only with 'groups: auto'")
        elif not isinstance(groups_data, list) or not groups_data:
            raise fail("groups: expected a non-empty list or 'auto'")
        groups: list[Group] = []
        for i, item in enumerate(groups_data):
            where = f"groups[{i}]"
            if not isinstance(item, dict):
                raise fail(f"{where}: expected a mapping")
            unknown = sorted(set(item) - set(_GROUP_FIELDS))
            if unknown:
                raise fail(f"{where}.{unknown[0]}: unknown field (expected {list(_GROUP_FIELDS)})")
            group_name = item.get("name")
            if not isinstance(group_name, str) or not _GROUP_NAME.fullmatch(group_name):
                raise fail(f"{where}.name: expected a name of letters, digits, '.', '-' and '_'")
            if any(g.name == group_name for g in groups):
                raise fail(f"{where}.name: group {group_name!r} is named twice")
            try:
                rule = Rule.from_dict(
                    {k: item[k] for k in ("patterns", "types") if k in item} | {"dtype": "fp32"},
                    where,
                )
            except PolicyError as error:
                raise fail(str(error)) from None
            dtypes = _dtype_list(item.get("dtypes", list(space_dtypes)), f"{where}.dtypes", fail)
            optional = item.get("optional", False)
            if not isinstance(optional, bool):
                raise fail(f"{where}.optional: expected true or false")
            groups.append(Group(group_name, replace(rule, name=group_name), dtypes, optional))
        return cls(
            name=name,
            groups=tuple(groups),
            accuracy_tolerance=float(tolerance),
            loss_scale=_loss_scale_space(data.get("loss_scale"), fail),
            description=str(data.get("description", "")),
            source=source,
            dtypes=space_dtypes,
            auto=auto,
            fp8_recipes=recipes,
            optimizer_states=(
                StateSpace.from_dict(data["optimizer_states"], fail)
                if "optimizer_states" in data
                else None
            ),
        )

    # -- fitting a model and a device ----------------------------------------------------

    def fit(
        self,
        model: nn.Module,
        profile: Profile | None = None,
        device: str | torch.device | Backend | None = None,
        inference: bool = False,
        int8_method: str | None = None,
        fp8_method: str | None = None,
    ) -> SearchSpace:
        """The space for this model on the device kind of ``device`` (default: where the
        model's parameters are); for serving, ``int8_method`` is what int8 layers are
        measured with, recorded in the policies. Each group must take (first match wins) at
        least one leaf module with parameters whose dtype a policy can change there (in training,
        embeddings, and on CUDA and Ascend LayerNorm and GroupNorm, compute in fp32
        whatever it says; for serving, ``inference``, every layer's weights convert); an
        optional group that takes none is dropped. For serving, a group whose layers can
        all be int8 (Linear, Conv1D) may also take int8, and no other may; with
        ``fp8_method`` (a serving method the device runs, `autoprec.serving.fp8`), a group
        with a Linear layer that method takes may also take fp8.

        A ``groups: auto`` space builds its groups here (see `AutoGroups`), with the
        riskiest modules of ``profile`` as groups of their own; a space with groups
        written by hand ignores the profile."""
        kind = device_kind(device, model)
        if not inference:
            self._refuse_int8()
        if self.offers_fp8:
            self._refuse_fp8(device, model, inference and fp8_method is None)
        followers = _tie_followers(model) if inference else {}
        space = replace(
            self,
            inference=inference,
            ties=tuple((f, "") for f in followers),
            int8_method=int8_method if inference else None,
            fp8_method=fp8_method if inference else None,
        )
        if self.auto is not None:
            specs = build_groups(
                model,
                [
                    leaf
                    for leaf in searched_leaves(model, kind, inference)
                    if leaf[0] not in followers
                ],
                self.auto.max_groups,
                self.auto.own_groups,
                profile,
                self.source,
            )
            groups = tuple(
                Group(g.name, Rule("fp32", g.patterns, g.types, g.name), self.dtypes) for g in specs
            )
            space = replace(space, groups=groups, auto=None)
        taken = set(space.assignment(model, kind).values())
        kept = []
        for i, group in enumerate(space.groups):
            if group.name in taken:
                kept.append(group)
            elif not group.optional:
                raise SpaceError(
                    f"{self.source}: groups[{i}] ({group.name}, {group.rule.describe()}): "
                    f"matches no module with parameters in {type(model).__name__} "
                    f"that an earlier group has not taken and whose dtype can change on {kind}"
                )
        if not kept:
            raise SpaceError(
                f"{self.source}: no group matches any module of {type(model).__name__}"
            )
        assigned = space.assignment(model, kind)
        ties = tuple((f, assigned[leader]) for f, leader in followers.items() if leader in assigned)
        # The output layer is registered last; a head tied to the embedding is in its group.
        group_of = {**assigned, **dict(ties)}
        order = [n for n, _ in searched_leaves(model, kind, inference) if n in group_of]
        last = group_of[order[-1]]
        space = replace(space, head=last if len(kept) > 1 else None, ties=ties)
        if inference:
            kept = _with_int8_where_it_fits(kept, assigned, model)
            kept = _with_fp8_serving_where_it_fits(kept, assigned, model, fp8_method)
            # The fp32 layers' matmuls in TF32 (CUDA) or HF32 (Ascend): searched for serving.
            space = replace(space, switch={"cuda": "tf32", "npu": "hf32"}.get(kind))
        else:
            kept = _without_failing_dtypes(kept, assigned, model, kind)
            if space.offers_fp8:
                kept = _with_fp8_where_it_fits(kept, assigned, model, self.source)
                space = replace(space, fp8_recipes=self._runnable_recipes(kept, kind))
            if self.optimizer_states is not None:
                states = self.optimizer_states.fit(
                    model, lambda m: SpaceError(f"{self.source}: {m}")
                )
                space = replace(space, optimizer_states=states)
        return replace(space, groups=tuple(kept))

    def _refuse_fp8(
        self, device: str | torch.device | Backend | None, model: nn.Module, inference: bool
    ) -> None:
        """fp8 is offered only where it runs: on a device that runs it (for serving,
        ``inference`` here: no fp8 serving method was settled for the search)."""
        reason = fp8_unavailable_reason(device, model)
        if inference and reason is None:
            reason = "fp8 serving is off (--fp8 off), or no fp8 serving method runs here"
        if reason is not None:
            raise SpaceError(f"{self.source}: dtypes: {reason}")

    def _runnable_recipes(self, groups: list[Group], kind: str) -> tuple[str, ...]:
        """The space's recipes without those seen to fail inside an autocast region on
        this device kind, where some group may be fp16 or bf16 around the fp8 layers."""
        if not any(d in LOW_PRECISION for g in groups for d in g.dtypes):
            return self.fp8_recipes
        failing = FAILS_UNDER_AUTOCAST.get(kind, {})
        kept = tuple(r for r in self.fp8_recipes if r not in failing)
        if not kept:
            recipe = self.fp8_recipes[0]
            raise SpaceError(f"{self.source}: fp8_recipes: {recipe} on {kind}: {failing[recipe]}")
        return kept

    def _refuse_int8(self) -> None:
        """int8 is a serving choice: a training search would silently leave it out."""
        listed = [("dtypes", self.dtypes)] + [
            (f"groups[{i}].dtypes", g.dtypes) for i, g in enumerate(self.groups)
        ]
        for where, dtypes in listed:
            if "int8" in dtypes:
                raise SpaceError(
                    f"{self.source}: {where}: int8 is for serving (--mode serving); a "
                    "training search runs fp32, fp16 and bf16"
                )

    def assignment(
        self, model: nn.Module, device: str | torch.device | Backend | None = None
    ) -> dict[str, str]:
        """Each searched leaf (a leaf with parameters whose dtype a policy can change on
        the device kind) mapped to the group that takes it, first match wins; leaves that
        no group takes are left out (they stay fp32)."""
        assigned = {}
        followers = {leaf for leaf, _ in self.ties}
        for name, module in searched_leaves(model, device_kind(device, model), self.inference):
            if name in followers:
                continue  # it takes the dtype of the leaf it shares a parameter with
            for group in self.groups:
                if group.rule.matches(name, module):
                    assigned[name] = group.name
                    break
        return assigned

    def group_risk(self, profile: Profile, model: nn.Module) -> list[tuple[str, float]]:
        """This (fitted) space's group names with their risk in ``profile``, riskiest first.

        A group's risk is the largest risk of the modules it assigns (first match wins,
        as in the space's policy): a module counts for every group its parameterised
        leaves belong to, so a block whose leaves all belong to one group counts for that
        group, and one whose leaves span several counts for each. Among groups of equal
        risk, the one whose riskiest module ranks first comes first (a module that only
        passes on what another put out of range ranks after it).
        """
        if not self.groups:
            raise SpaceError(f"{self.source}: fit the space to the model before group_risk")
        missing = profile.first_missing(model)
        if missing is not None:
            raise SpaceError(
                f"profile of {profile.task!r}: module {missing!r} is not in "
                f"{type(model).__name__}; profile the same model"
            )
        group_of = self.assignment(model, device_kind(profile.device))
        risks = {group.name: 0.0 for group in self.groups}
        first_rank = {group.name: len(profile.modules) + 1 for group in self.groups}
        for module in profile.modules:  # riskiest first: the first to set a risk ranks best
            for leaf, group in group_of.items():
                covers = leaf == module.name or leaf.startswith(f"{module.name}.")
                if covers and module.risk > risks[group]:
                    risks[group], first_rank[group] = module.risk, module.rank
        order = sorted(risks, key=lambda name: (-risks[name], first_rank[name]))
        return [(name, risks[name]) for name in order]

    def restrict(self, supported: set[str]) -> SearchSpace:
        """The space without the dtypes a device cannot run."""
        groups = []
        for group in self.groups:
            dtypes = tuple(d for d in group.dtypes if d in supported)
            if not dtypes:
                raise SpaceError(
                    f"{self.source}: group {group.name!r}: none of its dtypes "
                    f"({', '.join(group.dtypes)}) runs on this device"
                )
            groups.append(replace(group, dtypes=dtypes))
        dtypes = tuple(d for d in self.dtypes if d in supported)
        if self.auto is not None and not dtypes:
            raise SpaceError(
                f"{self.source}: dtypes: none of {', '.join(self.dtypes)} runs on this device"
            )
        return replace(self, groups=tuple(groups), dtypes=dtypes)

    def fingerprint(self) -> str:
        """A short hash of what the space searches (not its name or description)."""
        content: dict[str, Any] = {
            "groups": [(g.name, g.rule.to_dict(), g.dtypes, g.optional) for g in self.groups],
            "auto": None if self.auto is None else [self.auto.max_groups, self.auto.own_groups],
            "dtypes": self.dtypes if self.auto is not None else None,
            "inference": self.inference,
            "switch": self.switch,
            "loss_scale": [
                self.loss_scale.modes,
                sorted(self.loss_scale.ranges.items()),
                sorted(self.loss_scale.choices.items()),
            ],
        }
        if self.ties:  # only where there are any: older studies keep their fingerprint
            content["ties"] = self.ties
        if self.offers_fp8 and self.inference:  # likewise
            content["fp8_method"] = self.fp8_method
        elif self.offers_fp8:
            content["fp8_recipes"] = self.fp8_recipes
        if self.reduce_dtypes:  # likewise
            content["reduce_dtypes"] = self.reduce_dtypes
        if self.reduce_param != FSDP_REDUCE_PARAM:  # likewise: FSDP2 studies keep theirs
            content["reduce_param"] = self.reduce_param
        if self.optimizer_states is not None:  # likewise
            content["optimizer_states"] = self.optimizer_states.fingerprint_content()
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:12]

    # -- from Optuna parameters to a policy ----------------------------------------------

    def suggest(self, trial: Suggester) -> Policy:
        """Ask the trial for every parameter of this space and build the policy."""
        params: dict[str, Any] = {}
        for group in self.groups:
            params[f"dtype.{group.name}"] = trial.suggest_categorical(
                f"dtype.{group.name}", list(group.dtypes)
            )
        if self.switch is not None:
            name = f"switch.{self.switch}"
            params[name] = trial.suggest_categorical(name, [False, True])
        if len(self.reduce_dtypes) > 1:
            params[self.reduce_param] = trial.suggest_categorical(
                self.reduce_param, list(self.reduce_dtypes)
            )
        if self.optimizer_states is not None and not self.inference:
            params.update(self.optimizer_states.suggest(trial))
        # the layers' dtypes (not an fp16 gradient communication, nor an fp8 state kind)
        layers = {value for key, value in params.items() if key.startswith("dtype.")}
        if FP8 in layers and len(self.fp8_recipes) > 1:
            params["fp8.recipe"] = trial.suggest_categorical("fp8.recipe", list(self.fp8_recipes))
        if "fp16" in layers and not self.inference:  # serving scales no loss
            space = self.loss_scale
            mode = trial.suggest_categorical("loss_scale.mode", list(space.modes))
            params["loss_scale.mode"] = mode
            for key in _mode_fields(mode):
                name = f"loss_scale.{key}"
                if key in space.choices:
                    if len(space.choices[key]) > 1:
                        params[name] = trial.suggest_categorical(name, list(space.choices[key]))
                    continue
                low, high = space.ranges[key]
                if low != high:
                    params[name] = trial.suggest_int(name, low, high, log=key == "growth_interval")
        return self.policy(params)

    def policy(self, params: Mapping[str, Any]) -> Policy:
        """The policy for a set of parameter values (missing loss-scale values take the
        low end of their range, or none when no group is fp16)."""
        tied = tuple(
            Rule(params[f"dtype.{group}"], patterns=(leaf,), name=f"tied.{group}")
            for leaf, group in self.ties
        )
        rules = tied + tuple(rule for g in self.groups for rule in _group_rules(g, params))
        mode = params.get("loss_scale.mode", "none")
        if mode == "none" or "fp16" not in {r.dtype for r in rules}:
            loss_scale = LossScale()
        else:

            def value(key: str) -> Any:
                if key in self.loss_scale.choices:
                    return float(params.get(f"loss_scale.{key}", self.loss_scale.choices[key][0]))
                return int(params.get(f"loss_scale.{key}", self.loss_scale.ranges[key][0]))

            if mode == "static":
                loss_scale = LossScale("static", init_scale=2.0 ** value("static_scale_log2"))
            else:
                init_scale = 2.0 ** value("init_scale_log2")
                loss_scale = LossScale(
                    "dynamic",
                    init_scale=init_scale,
                    growth_interval=value("growth_interval"),
                    hysteresis=value("hysteresis"),
                    growth_factor=value("growth_factor"),
                    backoff_factor=value("backoff_factor"),
                    min_scale=min(value("min_scale"), init_scale),
                )
        switches = {k: params.get(f"switch.{k}") for k in ("tf32", "hf32")}
        int8 = self.int8_method if any(r.dtype == "int8" for r in rules) else None
        fp8 = None
        if any(r.dtype == FP8 for r in rules):
            fp8 = params.get("fp8.recipe", self.fp8_recipes[0])
            if self.inference:
                fp8 = self.fp8_method
        return Policy(
            rules=rules,
            default="fp32",
            loss_scale=loss_scale,
            tf32=switches["tf32"],
            hf32=switches["hf32"],
            writes_loss_scale=not self.inference,
            quantization=Quantization(int8=int8, fp8=fp8),
            reduce_dtype=params.get(
                self.reduce_param, self.reduce_dtypes[0] if self.reduce_dtypes else None
            ),
            optimizer_states=(
                self.optimizer_states.states(params)
                if self.optimizer_states is not None and not self.inference
                else OptimizerStates()
            ),
        )

    def uniform_params(self, dtype: str) -> dict[str, Any]:
        """Parameters that put every group in ``dtype``; fp16 gets dynamic scaling with
        torch's defaults where the space allows it (as Apex O1/O2 or GradScaler would).
        For serving, int8 goes to the groups that can take it, fp32 to the others (as
        dynamic quantization leaves what it cannot quantize), and no loss is scaled."""
        params: dict[str, Any] = {f"dtype.{g.name}": dtype for g in self.groups}
        if dtype == "int8":
            params = {
                f"dtype.{g.name}": "int8" if "int8" in g.dtypes else "fp32" for g in self.groups
            }
        if dtype == FP8 and self.inference:  # as int8: what fp8 cannot take stays fp32
            params = {f"dtype.{g.name}": FP8 if FP8 in g.dtypes else "fp32" for g in self.groups}
        elif dtype == FP8:
            params = {f"dtype.{g.name}": dtype_beside(g, FP8) for g in self.groups}
            if len(self.fp8_recipes) > 1:
                params["fp8.recipe"] = self.anchor_recipe
        if "fp16" in params.values() and not self.inference:
            enabled = [m for m in self.loss_scale.modes if m != "none"]
            mode = "dynamic" if "dynamic" in enabled else (enabled[0] if enabled else "none")
            params["loss_scale.mode"] = mode
            for key in _mode_fields(mode):
                default = _TORCH_DEFAULTS[key]
                if key in self.loss_scale.choices:
                    options = self.loss_scale.choices[key]
                    if len(options) > 1:
                        params[f"loss_scale.{key}"] = default if default in options else options[0]
                    continue
                low, high = self.loss_scale.ranges[key]
                if low != high:
                    params[f"loss_scale.{key}"] = min(max(default, low), high)
        return params

    @property
    def anchor_recipe(self) -> str:
        """The fp8 recipe of the uniform-fp8 anchor and the guided search's fp8 probes:
        torchao's default (tensorwise) where the space searches it, else its first."""
        recipes = self.fp8_recipes
        return DEFAULT_FP8_RECIPE if DEFAULT_FP8_RECIPE in recipes else recipes[0]

    def anchors(self) -> dict[str, dict[str, Any]]:
        """Uniform policies every search measures: fp16 as ``model.half()`` gives it (no
        loss scaling) and as Apex O1/O2 or GradScaler give it (dynamic scaling), and bf16;
        where the space offers fp8, every group that can take it in fp8 and the rest in
        bf16 where they may (torchao's float8 inside bf16 autocast), as `fp8_rest` says;
        for serving, fp16, bf16, int8 where the layers take it, and the classic fp16 body
        with an fp32 head (the group of the model's last layer, whatever its name). Only
        those the space can express."""
        if self.inference:
            return self._serving_anchors()
        anchors = {}
        for dtype in LOW_PRECISION:
            if not all(dtype in g.dtypes for g in self.groups):
                continue
            params = self.uniform_params(dtype)
            anchors[f"uniform-{dtype}"] = params
            scaled = params.get("loss_scale.mode", "none") != "none"
            if dtype == "fp16" and scaled and "none" in self.loss_scale.modes:
                dtypes_only = {k: v for k, v in params.items() if k.startswith("dtype.")}
                anchors["uniform-fp16-noscale"] = {**dtypes_only, "loss_scale.mode": "none"}
        if any(FP8 in g.dtypes for g in self.groups):
            anchors["uniform-fp8"] = self.uniform_params(FP8)
        if self.optimizer_states is not None:
            anchors.update(self.optimizer_states.anchors(self.uniform_params("fp32")))
        return anchors

    def _serving_anchors(self) -> dict[str, dict[str, Any]]:
        anchors = {}
        for dtype in LOW_PRECISION:
            if all(dtype in g.dtypes for g in self.groups):
                anchors[f"uniform-{dtype}"] = self.uniform_params(dtype)
        if any("int8" in g.dtypes for g in self.groups):
            anchors["uniform-int8"] = self.uniform_params("int8")
        if any(FP8 in g.dtypes for g in self.groups):
            anchors["uniform-fp8"] = self.uniform_params(FP8)
        body = [g for g in self.groups if g.name != self.head]
        if self.head is not None and all("fp16" in g.dtypes for g in body):
            head = {f"dtype.{self.head}": "fp32"}
            anchors["fp16-body-fp32-head"] = {**self.uniform_params("fp16"), **head}
        return anchors

    def flat_params(self, policy: Policy) -> dict[str, str]:
        """The same keys for every policy of this space (for MLflow's compare view); a
        serving space's have no loss scaling."""
        flat = {f"dtype.{g.name}": r.dtype for g, r in zip(self.groups, policy.rules, strict=False)}
        if self.inference:
            if self.switch is not None:
                flat[f"switch.{self.switch}"] = str(getattr(policy, self.switch))
            return flat
        scale = policy.loss_scale
        flat["loss_scale.mode"] = scale.mode
        flat["loss_scale.init_scale"] = "-" if scale.mode == "none" else f"{scale.init_scale:g}"
        dynamic = scale.mode == "dynamic"
        flat["loss_scale.growth_interval"] = str(scale.growth_interval) if dynamic else "-"
        flat["loss_scale.hysteresis"] = str(scale.hysteresis) if dynamic else "-"
        for key in ("growth_factor", "backoff_factor", "min_scale"):
            flat[f"loss_scale.{key}"] = f"{getattr(scale, key):g}" if dynamic else "-"
        if self.offers_fp8:
            flat["fp8.recipe"] = policy.fp8_recipe if FP8 in flat.values() else "-"
        if self.reduce_dtypes:
            flat[self.reduce_param] = policy.reduce_dtype or "fp32"
        if self.optimizer_states is not None:
            flat.update(self.optimizer_states.flat_params(policy.optimizer_states))
        return flat


def policy_label(params: dict[str, str]) -> str:
    """A short label of a policy, e.g. ``fc1=fp16 fc2=bf16 head=fp32 scale=dynamic`` or, for
    serving on CUDA with TF32 on, ``fc1=fp32 fc2=fp16 head=fp32 tf32``."""
    parts = [f"{k.removeprefix('dtype.')}={v}" for k, v in params.items() if k.startswith("dtype.")]
    # A serving switch (TF32 on CUDA, HF32 on Ascend) for the fp32 layers, where it is on.
    parts += [
        k.removeprefix("switch.")
        for k, v in params.items()
        if k.startswith("switch.") and v == "True"
    ]
    parts += [
        f"{k}={v}" for k, v in params.items() if k.startswith(("state.", "master.")) and v != "fp32"
    ]
    if params.get("fp8.recipe", "-") != "-":
        parts.append(f"fp8={params['fp8.recipe']}")
    mode = params.get("loss_scale.mode", "none")
    if mode != "none":
        parts.append(f"scale={mode}:{params.get('loss_scale.init_scale', '-')}")
    elif "fp16" in params.values() and "loss_scale.mode" in params:  # training, unscaled
        parts.append("scale=none")
    return " ".join(parts)


# What a group that cannot take the low dtype runs in beside it: for fp8, the autocast
# region torchao's float8 layers usually sit in (bf16), else the widest the group offers.
_REST_FIRST = {FP8: ("bf16", "fp32", "fp16")}
_WIDEST_FIRST = ("fp32", "bf16", "fp16", FP8, "int8")


def dtype_beside(group: Group, low: str) -> str:
    """``low`` where ``group`` offers it; otherwise, beside fp8, bf16 where the group
    offers it (the region around torchao's float8 layers), else its widest dtype."""
    if low in group.dtypes:
        return low
    order = _REST_FIRST.get(low, _WIDEST_FIRST)
    return next((d for d in (*order, *_WIDEST_FIRST) if d in group.dtypes), group.dtypes[0])


def searched_leaves(
    model: nn.Module, kind: str = "cpu", inference: bool = False
) -> list[tuple[str, nn.Module]]:
    """Leaves with parameters that a space searches on a device kind: in training, all but
    those that autocast runs in fp32 there whatever a policy says (embeddings everywhere,
    LayerNorm and GroupNorm on CUDA and Ascend), which have nothing to search; for
    serving, all of them (their weights are converted)."""
    leaves = parameterised_leaves(model)
    if inference:
        return leaves
    return [(n, m) for n, m in leaves if autocast_behaviour(kind, m) != "fp32"]


def _group_rules(group: Group, params: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The rules a group's chosen dtype gives: one, or for int8 in a group only some of
    whose layers can take it, int8 for those and fp32 for the rest of the group."""
    dtype = params[f"dtype.{group.name}"]
    if dtype == FP8 and group.fp8_kept:
        return (
            Rule(FP8, patterns=group.fp8_leaves, name=group.name),
            replace(group.rule, dtype="fp32", name=f"{group.name}.kept"),
        )
    if dtype == FP8:
        return (Rule(FP8, patterns=group.fp8_leaves, name=group.name),)
    if dtype == "int8" and group.int8_leaves:
        return (
            Rule("int8", patterns=group.int8_leaves, name=group.name),
            replace(group.rule, dtype="fp32", name=f"{group.name}.kept"),
        )
    return (replace(group.rule, dtype=dtype),)


def _tie_followers(model: nn.Module) -> dict[str, str]:
    """Each leaf that shares a parameter with an earlier leaf, mapped to the first one."""
    return {name: group[0] for group in tied_leaves(model) for name in group[1:]}


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


def _with_int8_where_it_fits(
    groups: list[Group], assignment: dict[str, str], model: nn.Module
) -> list[Group]:
    """int8 offered to the groups with a layer that can be int8 (Linear, Conv1D); in a
    group where only some can (a decoder block with its norms), int8 takes those and
    the others stay fp32."""
    modules = dict(model.named_modules())
    capable: dict[str, list[str]] = {g.name: [] for g in groups}
    others: dict[str, int] = {g.name: 0 for g in groups}
    for leaf, group_name in assignment.items():
        if int8_capable(modules[leaf]):
            capable[group_name].append(leaf)
        else:
            others[group_name] += 1
    fitted = []
    for group in groups:
        dtypes = tuple(d for d in group.dtypes if d != "int8")
        leaves = tuple(capable[group.name]) if others[group.name] else ()
        if capable[group.name]:
            dtypes = (*dtypes, "int8")
        fitted.append(replace(group, dtypes=dtypes, int8_leaves=leaves))
    return fitted


def _with_fp8_serving_where_it_fits(
    groups: list[Group], assignment: dict[str, str], model: nn.Module, method: str | None
) -> list[Group]:
    """For serving: fp8 offered (by ``method``; None: not at all) to the groups with a
    Linear layer the method takes (`autoprec.serving.fp8.fp8_layer_refusal`); in a group
    where only some can, fp8 takes those and the others stay fp32, as int8 does."""
    modules = dict(model.named_modules())
    capable: dict[str, list[str]] = {g.name: [] for g in groups}
    others: dict[str, int] = {g.name: 0 for g in groups}
    for leaf, group_name in assignment.items():
        if method is not None and fp8_layer_refusal(modules[leaf], method) is None:
            capable[group_name].append(leaf)
        else:
            others[group_name] += 1
    fitted = []
    for group in groups:
        dtypes = tuple(d for d in group.dtypes if d != FP8)
        if capable[group.name]:
            dtypes = (*dtypes, FP8)
        fitted.append(
            replace(
                group,
                dtypes=dtypes,
                fp8_leaves=tuple(capable[group.name]),
                fp8_kept=bool(capable[group.name] and others[group.name]),
            )
        )
    return fitted


def _with_fp8_where_it_fits(
    groups: list[Group], assignment: dict[str, str], model: nn.Module, source: str
) -> list[Group]:
    """fp8 offered to the groups whose layers torchao can all convert (plain Linear layers
    with dimensions that are multiples of 16), and to no other: a group offered only fp8
    with a layer it cannot take is refused, naming the layer."""
    modules = dict(model.named_modules())
    leaves: dict[str, list[str]] = {g.name: [] for g in groups}
    refused: dict[str, str] = {}
    for leaf, group_name in assignment.items():
        leaves[group_name].append(leaf)
        reason = fp8_refusal(modules[leaf])
        if reason is not None and group_name not in refused:
            refused[group_name] = f"{leaf} ({type(modules[leaf]).__name__}): {reason}"
    fitted = []
    for group in groups:
        if FP8 not in group.dtypes:
            fitted.append(group)
        elif group.name not in refused:
            fitted.append(replace(group, fp8_leaves=tuple(leaves[group.name])))
        elif group.dtypes == (FP8,):
            raise SpaceError(
                f"{source}: group {group.name!r}: offers only fp8, but {refused[group.name]}"
            )
        else:
            fitted.append(replace(group, dtypes=tuple(d for d in group.dtypes if d != FP8)))
    return fitted


def _mode_fields(mode: str) -> tuple[str, ...]:
    if mode == "static":
        return ("static_scale_log2",)
    if mode == "dynamic":
        return (
            "init_scale_log2",
            "growth_interval",
            "hysteresis",
            "growth_factor",
            "backoff_factor",
            "min_scale",
        )
    return ()


def _dtype_list(value: Any, where: str, fail: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise fail(f"{where}: expected a non-empty list of dtypes")
    for item in value:
        if item not in POLICY_DTYPES:
            raise fail(
                f"{where}: unknown dtype {item!r} "
                "(expected fp32, fp16, bf16, fp8 to train, or int8 to serve)"
            )
    return tuple(dict.fromkeys(value))


def _loss_scale_space(data: Any, fail: Any) -> LossScaleSpace:
    if data is None:
        return LossScaleSpace()
    if not isinstance(data, dict):
        raise fail("loss_scale: expected a mapping")
    known = ["modes", *_RANGE_FIELDS, *_CHOICE_FIELDS]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise fail(f"loss_scale.{unknown[0]}: unknown field (expected {', '.join(known)})")
    modes = data.get("modes", list(LOSS_SCALE_MODES))
    if not isinstance(modes, list) or not modes or any(m not in LOSS_SCALE_MODES for m in modes):
        raise fail(
            f"loss_scale.modes: expected a list drawn from none, static, dynamic; got {modes!r}"
        )
    ranges = dict(_RANGE_FIELDS)
    for key in _RANGE_FIELDS:
        if key not in data:
            continue
        value = data[key]
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value, value]
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or value[0] > value[1]
        ):
            raise fail(
                f"loss_scale.{key}: expected [low, high] integers with low <= high, got {value!r}"
            )
        minimum = 0 if key.endswith("log2") else 1
        if value[0] < minimum or (key.endswith("log2") and value[1] > 64):
            raise fail(f"loss_scale.{key}: out of range, got {value!r}")
        ranges[key] = (value[0], value[1])
    choices: dict[str, tuple[float, ...]] = dict(_CHOICE_FIELDS)
    for key in _CHOICE_FIELDS:
        if key not in data:
            continue
        value = data[key]
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = [value]
        if not (
            isinstance(value, list)
            and value
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        ):
            raise fail(f"loss_scale.{key}: expected a list of numbers, got {value!r}")
        try:  # the values must make valid settings on their own
            for v in value:
                setting: dict[str, Any] = {key: float(v)}
                LossScale("dynamic", **setting)
        except PolicyError as error:
            raise fail(str(error)) from None
        choices[key] = tuple(float(v) for v in dict.fromkeys(value))
    return LossScaleSpace(tuple(dict.fromkeys(modes)), ranges, choices)


def builtin_spaces() -> dict[str, Path]:
    """Shipped space files by name."""
    folder = resources.files("autoprec.search_spaces")
    return {
        Path(entry.name).stem: Path(str(entry))
        for entry in folder.iterdir()
        if entry.name.endswith(".yaml")
    }


def load_space(spec: str | Path) -> SearchSpace:
    """A space by shipped name (``default``, ``digits-cnn``, ...) or YAML file path."""
    shipped = builtin_spaces()
    path = shipped[str(spec)] if str(spec) in shipped else Path(spec)
    if not path.exists():
        names = ", ".join(sorted(shipped))
        raise SpaceError(f"space {str(spec)!r}: no such file, and not a shipped space ({names})")
    data = load_yaml(path, SpaceError)
    return SearchSpace.from_dict(data, str(path))
