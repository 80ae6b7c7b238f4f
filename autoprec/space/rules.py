"""What a mode decides about its search spaces: the `SpaceRules` protocol, one
implementation per mode (in `autoprec.trials`), found through the mode object.

A space is read the same in every mode; fitting it to a model is where modes differ:
which layers are searched, which dtypes the groups may take there (int8 and fp8 where
weights are converted, fp8 recipes and optimizer states where the model trains), the
parameters beside the layers' dtypes (loss scaling), the uniform policies every search
measures, and what the space's policies and records say. The generic space code asks a
fitted space's rules (`space_rules`) and never names a mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from autoprec.modes import Mode, mode_of

if TYPE_CHECKING:
    from torch import nn

    from autoprec.optim.space import StateSpace
    from autoprec.policy import Policy
    from autoprec.space.fields import SpaceFields, SpaceT
    from autoprec.space.groups import Group


class SpaceRules(Protocol):
    """A mode's rules for its search spaces (``Mode.space_rules`` names them)."""

    # Whether the mode's policies convert the layers' weights (and run without autocast):
    # the space's fingerprint says so (its "inference"), and so does each policy.
    converts_weights: bool
    # Whether a policy with an fp16 layer brings loss-scale parameters.
    scales_loss: bool

    def searched_leaves(self, model: nn.Module, kind: str) -> list[tuple[str, nn.Module]]:
        """The leaves with parameters whose dtype a policy can change on the device kind."""
        ...

    def refuse(
        self,
        space: SpaceFields,
        model: nn.Module,
        device: Any,
        fp8_method: str | None,
    ) -> None:
        """Raise SpaceError for a dtype the space lists that this mode cannot search on
        the device."""
        ...

    def tie_followers(self, model: nn.Module) -> dict[str, str]:
        """Leaves that take the dtype of a leaf they share a parameter with, mapped to it
        (searched with its group, not on their own)."""
        ...

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
        """The space with the groups it keeps (``groups``, each leaf of ``assignment``
        taken by one), each offering the dtypes its layers can take in this mode on the
        device kind, and what else the mode fits (methods, recipes, switches, states)."""
        ...

    def searched_states(self, space: SpaceFields) -> StateSpace | None:
        """The optimizer states searched beside the layers' dtypes (None: none)."""
        ...

    def fp8_made_with(self, space: SpaceFields, params: Mapping[str, Any]) -> str | None:
        """What a policy's fp8 layers are made with (its ``quantization.fp8``)."""
        ...

    def fp8_fingerprint(self, space: SpaceFields) -> dict[str, Any]:
        """What the space's fingerprint holds about fp8, where some group offers it."""
        ...

    def uniform_fp8(self, space: SpaceFields, dtype: str) -> dict[str, Any]:
        """The parameters of the uniform policy of a converted format (``dtype``: fp8):
        that format where a group can take it."""
        ...

    def anchors(self, space: SpaceFields) -> dict[str, dict[str, Any]]:
        """The uniform policies every search of the space measures, by name."""
        ...

    def recorded(
        self, space: SpaceFields, policy: Policy, dtypes: Mapping[str, str]
    ) -> dict[str, str]:
        """What the records say of a policy beside its groups' dtypes (``dtypes``, as
        ``dtype.<group>``): the same keys for every policy of the space."""
        ...


def space_rules(mode: Mode | str | None = None) -> SpaceRules:
    """The space rules of a mode (a `Mode`, or its name; None: the default mode)."""
    return mode_of(mode).load_space_rules()  # type: ignore[no-any-return]


def searched_leaves(
    model: nn.Module, kind: str = "cpu", mode: Mode | str | None = None
) -> list[tuple[str, nn.Module]]:
    """Leaves with parameters that a space fitted for ``mode`` (default: training)
    searches on a device kind: in training, all but those that autocast runs in fp32
    there whatever a policy says (embeddings everywhere, LayerNorm and GroupNorm on CUDA
    and Ascend), which have nothing to search; for serving, all of them (their weights
    are converted)."""
    return space_rules(mode).searched_leaves(model, kind)
