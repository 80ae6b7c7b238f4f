"""`SearchSpace`: what a search may choose, as plain data (read from YAML, then fitted to
a model, a device and a mode), and its fingerprint. Its methods are thin: what they do
lives in the package's modules by concept (reading, fitting, policies)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from autoprec.dtypes import AUTOCAST_DTYPES, FP8
from autoprec.formats.fp8 import DEFAULT_FP8_RECIPE
from autoprec.optim.space import StateSpace
from autoprec.policy import Policy
from autoprec.space import fitting, policies
from autoprec.space.groups import AutoGroups, Group
from autoprec.space.loss_scale import LossScaleSpace
from autoprec.space.reading import space_fields
from autoprec.space.rules import space_rules
from autoprec.trials import DEFAULT_MODE

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autoprec.devices import Backend
    from autoprec.profile.sensitivity import Profile
    from autoprec.trials.mode import Mode

FSDP_REDUCE_PARAM = "fsdp.reduce_dtype"  # the reduce dtype's parameter under FSDP2
DDP_REDUCE_PARAM = "ddp.reduce_dtype"  # and under DDP (its compression hook)


class Suggester(Protocol):
    """What a space needs from an Optuna trial (``optuna.Trial`` satisfies it)."""

    def suggest_categorical(self, name: str, choices: Any) -> Any: ...

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int: ...


@dataclass(frozen=True)
class SearchSpace:
    """A space as read (groups by hand, or ``auto`` until fitted), or fitted to a model, a
    device and a mode (`fit`): the groups and the dtypes each may take, and the rest of
    what a search chooses."""

    name: str
    groups: tuple[Group, ...]
    accuracy_tolerance: float = 0.01
    loss_scale: LossScaleSpace = field(default_factory=LossScaleSpace)
    description: str = ""
    source: str = "<space>"
    dtypes: tuple[str, ...] = AUTOCAST_DTYPES  # fp8 only where a space lists it
    auto: AutoGroups | None = None  # set until ``fit`` builds the groups of ``groups: auto``
    # the mode it was fitted for (`autoprec.trials.MODES`), whose `SpaceRules` it follows
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
        return any(FP8 in g.dtypes for g in self.groups) or (
            self.auto is not None and FP8 in self.dtypes
        )

    @property
    def anchor_recipe(self) -> str:
        """The fp8 recipe of the uniform-fp8 anchor and the guided search's fp8 probes:
        torchao's default (tensorwise) where the space searches it, else its first."""
        recipes = self.fp8_recipes
        return DEFAULT_FP8_RECIPE if DEFAULT_FP8_RECIPE in recipes else recipes[0]

    # The methods below are kept because many callers use them; each is one function of
    # the package (`autoprec.space.reading`, `.fitting`, `.policies`).

    @classmethod
    def from_dict(cls, data: Any, source: str) -> SearchSpace:
        """The space a YAML mapping describes (``source``: where it was read)."""
        return cls(**space_fields(data, source))

    def fit(
        self,
        model: nn.Module,
        profile: Profile | None = None,
        device: str | torch.device | Backend | None = None,
        mode: Mode | str | None = None,
        int8_method: str | None = None,
        fp8_method: str | None = None,
    ) -> SearchSpace:
        """The space for this model on the device kind of ``device`` (default: where the
        model's parameters are), fitted for ``mode`` (a `Mode` or its name; None: the
        default mode), whose `SpaceRules` say which leaves are searched and what they may
        run in. Each group must take (first match wins) at least one leaf module with
        parameters whose dtype a policy can change there (in training, embeddings, and on
        CUDA and Ascend LayerNorm and GroupNorm, compute in fp32 whatever it says; for
        serving every layer's weights convert); an optional group that takes none is
        dropped. For serving, ``int8_method`` is what int8 layers are measured with,
        recorded in the policies: a group whose layers can be int8 (Linear, Conv1D) may
        also take int8, and no other may; with ``fp8_method`` (a serving method the device
        runs, `autoprec.serving.fp8`), a group with a Linear layer that method takes may
        also take fp8.

        A ``groups: auto`` space builds its groups here (see `AutoGroups`), with the
        riskiest modules of ``profile`` as groups of their own; a space with groups
        written by hand ignores the profile."""
        return fitting.fit_space(self, model, profile, device, mode, int8_method, fp8_method)

    def restrict(self, supported: set[str]) -> SearchSpace:
        """The space without the dtypes a device cannot run."""
        return fitting.restrict_space(self, supported)

    def assignment(
        self, model: nn.Module, device: str | torch.device | Backend | None = None
    ) -> dict[str, str]:
        """Each searched leaf (a leaf with parameters whose dtype a policy can change on
        the device kind) mapped to the group that takes it, first match wins; leaves that
        no group takes are left out (they stay fp32)."""
        return fitting.leaf_groups(self, model, device)

    def group_risk(self, profile: Profile, model: nn.Module) -> list[tuple[str, float]]:
        """This (fitted) space's group names with their risk in ``profile``, riskiest first.

        A group's risk is the largest risk of the modules it assigns (first match wins,
        as in the space's policy): a module counts for every group its parameterised
        leaves belong to, so a block whose leaves all belong to one group counts for that
        group, and one whose leaves span several counts for each. Among groups of equal
        risk, the one whose riskiest module ranks first comes first (a module that only
        passes on what another put out of range ranks after it).
        """
        return fitting.group_risk(self, profile, model)

    def fingerprint(self) -> str:
        """A short hash of what the space searches (not its name or description)."""
        return space_fingerprint(self)

    def suggest(self, trial: Suggester) -> Policy:
        """Ask the trial for every parameter of this space and build the policy."""
        return policies.suggest_policy(self, trial)

    def policy(self, params: Mapping[str, Any]) -> Policy:
        """The policy for a set of parameter values (missing loss-scale values take the
        low end of their range, or none when no group is fp16)."""
        return policies.policy_of(self, params)

    def uniform_params(self, dtype: str) -> dict[str, Any]:
        """Parameters that put every group in ``dtype``; fp16 gets dynamic scaling with
        torch's defaults where the mode scales the loss and the space allows it (as Apex
        O1/O2 or GradScaler would); int8 goes to the groups that can take it, fp32 to the
        others (as dynamic quantization leaves what it cannot quantize); fp8 as the mode's
        rules put it (beside bf16 in training, beside fp32 for serving)."""
        return policies.uniform_params(self, dtype)

    def anchors(self) -> dict[str, dict[str, Any]]:
        """Uniform policies every search measures, as the mode's rules list them: for
        training, fp16 as ``model.half()`` gives it (no loss scaling) and as Apex O1/O2
        or GradScaler give it (dynamic scaling), and bf16; where the space offers fp8,
        every group that can take it in fp8 and the rest in bf16 where they may (torchao's
        float8 inside bf16 autocast), as `dtype_beside` says; for serving, fp16, bf16,
        int8 where the layers take it, and the classic fp16 body with an fp32 head (the
        group of the model's last layer, whatever its name). Only those the space can
        express."""
        return space_rules(self.mode).anchors(self)

    def flat_params(self, policy: Policy) -> dict[str, str]:
        """The same keys for every policy of this space (for MLflow's compare view); a
        serving space's have no loss scaling."""
        return policies.flat_params(self, policy)


def space_fingerprint(space: SearchSpace) -> str:
    """A short hash of what the space searches (not its name or description); what was
    added since the first studies is hashed only where the space has it, so that older
    studies keep their fingerprint."""
    rules = space_rules(space.mode)
    content: dict[str, Any] = {
        "groups": [(g.name, g.rule.to_dict(), g.dtypes, g.optional) for g in space.groups],
        "auto": None if space.auto is None else [space.auto.max_groups, space.auto.own_groups],
        "dtypes": space.dtypes if space.auto is not None else None,
        "inference": rules.converts_weights,  # its first name, kept
        "switch": space.switch,
        "loss_scale": [
            space.loss_scale.modes,
            sorted(space.loss_scale.ranges.items()),
            sorted(space.loss_scale.choices.items()),
        ],
    }
    if space.ties:
        content["ties"] = space.ties
    if space.offers_fp8:
        content.update(rules.fp8_fingerprint(space))
    if space.reduce_dtypes:
        content["reduce_dtypes"] = space.reduce_dtypes
    if space.reduce_param != FSDP_REDUCE_PARAM:  # FSDP2 studies keep theirs
        content["reduce_param"] = space.reduce_param
    if space.optimizer_states is not None:
        content["optimizer_states"] = space.optimizer_states.fingerprint_content()
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:12]
