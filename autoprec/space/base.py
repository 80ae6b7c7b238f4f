"""`SearchSpace`: what a search may choose, as plain data (read from YAML, then fitted to
a model, a device and a mode), and its fingerprint. Its methods are thin: what they do
lives in the package's modules by concept (reading, fitting, policies)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autoprec.policy import Policy
from autoprec.space import fitting, policies
from autoprec.space.fields import FSDP_REDUCE_PARAM, SpaceFields
from autoprec.space.loss_scale import Suggester
from autoprec.space.reading import space_fields
from autoprec.space.rules import space_rules

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autoprec.devices import Backend
    from autoprec.modes import Mode
    from autoprec.profile.sensitivity import Profile


@dataclass(frozen=True)
class SearchSpace(SpaceFields):
    """A space as read (groups by hand, or ``auto`` until fitted), or fitted to a model, a
    device and a mode (`fit`): the groups and the dtypes each may take, and the rest of
    what a search chooses (its fields: `autoprec.space.fields.SpaceFields`)."""

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


def space_fingerprint(space: SpaceFields) -> str:
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
