"""A policy as the code that acts on it reads it: `PolicyView`, and `RuleView` for its rules.

`autoprec.policy.Policy` is plain data at the bottom of the package, and its methods on a
model (``plan``, ``apply``, ``resolve``...) hand it to the modules that act on it
(`autoprec.precision.landing`, `autoprec.precision.resolution`, the guard, the watcher,
the modes). Those modules type the policy they are given by these protocols, never by
importing `autoprec.policy`: the dependency points one way, from the policy's methods
down to the code that carries them out. `Policy` is the one implementation; mypy checks
it against them wherever it is handed on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, Self

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autoprec.devices import Backend
    from autoprec.guard.settings import Guard
    from autoprec.optim.state import OptimizerStates
    from autoprec.precision.hooks import Precision
    from autoprec.precision.loss_scale import LossScale
    from autoprec.precision.plan import Plan

__all__ = ["PolicyView", "QuantizationView", "RuleView"]


class RuleView(Protocol):
    """One rule of a policy (`autoprec.policy.Rule`): the dtype of the leaves it takes."""

    @property
    def dtype(self) -> str: ...

    def matches(self, name: str, module: nn.Module) -> bool: ...

    def describe(self) -> str: ...


class QuantizationView(Protocol):
    """How a policy's quantized layers are made (`autoprec.policy.Quantization`)."""

    def method(self, name: str) -> str | None: ...


class PolicyView(Protocol):
    """A policy (`autoprec.policy.Policy`, whose docstrings say what each part means): what
    landing, resolution, the guard, the watcher and the modes read of it."""

    @property
    def rules(self) -> Sequence[RuleView]: ...

    @property
    def default(self) -> str: ...

    @property
    def name(self) -> str | None: ...

    @property
    def loss_scale(self) -> LossScale: ...

    @property
    def tf32(self) -> bool | None: ...

    @property
    def hf32(self) -> bool | None: ...

    @property
    def reduce_dtype(self) -> str | None: ...

    @property
    def optimizer_states(self) -> OptimizerStates: ...

    @property
    def guard(self) -> Guard | None: ...

    @property
    def quantization(self) -> QuantizationView: ...

    @property
    def fp8_recipe(self) -> str: ...

    @property
    def fp8_method(self) -> str | None: ...

    @property
    def names_fp8(self) -> bool: ...

    def with_leading_rules(self, rules: list[dict[str, Any]]) -> Self: ...

    def to_yaml(self) -> str: ...

    def plan(
        self,
        model: nn.Module,
        device: str | torch.device | Backend | None = None,
        module: str | None = None,
    ) -> Plan: ...

    def apply(
        self,
        model: nn.Module,
        device: str | torch.device | Backend | None = None,
        module: str | None = None,
        emulate: str | tuple[str, ...] = (),
        guard: Guard | bool | None = None,
    ) -> Precision: ...

    def resolve(
        self,
        model: nn.Module,
        device: str | torch.device | Backend | None = None,
        module: str | None = None,
        example: Any = None,
    ) -> dict[str, str]: ...

    def resolve_served(self, model: nn.Module) -> dict[str, str]: ...
