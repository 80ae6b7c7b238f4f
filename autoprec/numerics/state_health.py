"""How much a parameter's quantised optimizer state loses, read from the state itself.

torchao's 8-bit (and 4-bit, fp8) states quantise each block of 256 (128) values against
the block's largest: a value below the smallest code (3.25e-7 of the block's maximum for
the unsigned 8-bit map of ``exp_avg_sq``) is stored as zero. Where a rarely updated entry
(an embedding row of a rare token beside frequent ones in its block) keeps a first moment
but loses its second, Adam's denominator falls to ``eps`` and the next updates are
``lr * exp_avg / eps``: the entry blows up. Three mechanisms are told apart:

- **underflow** (``collapsed_share``): ``exp_avg_sq`` stored as 0 where ``exp_avg`` is not;
  ``zero_second_moment_share`` counts every second moment stored as zero (an entry never
  updated is zero too: the state alone cannot tell an underflow from it);
- **saturation** (``saturated_share``): a moment stored as non-finite, or at the largest
  finite value of a plain low-precision dtype (a bf16 or fp16 buffer). A blockwise state
  scales each block by its largest value, so it saturates only when its scale does;
- **update blow-up** (``blown_up_share``): the step the stored moments give,
  ``|m_hat| / (sqrt(v_hat) + eps)`` in units of ``lr``, beyond ``BLOWUP_MARGIN`` times the
  largest exact Adam moments can give after the state's steps (`adam_step_bound`);
  ``update_weight_ratio`` is that step's norm over the weight's.

`state_loss` answers the question before a trial runs: given a real fp32 state (the
baseline trial's), what each kind's own quantiser (torchao's, through the buffers its
optimizer would store; bf16 by rounding to nearest) does to the second moment: its
relative error and the share of entries that become zero under a live first moment.

Only the functions import torch: the records are read by the summary without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autoprec.optim.state import OptimizerStates

UNDERFLOW = "underflow"
SATURATION = "saturation"
BLOWUP = "blow-up"
MECHANISMS = (UNDERFLOW, SATURATION, BLOWUP)
# A step counts as blown up beyond this many times the largest exact moments can give
# (quantised moments are off by a few percent near their block's largest value, by up to
# half a code near the smallest: never by 2x unless the second moment lost its value).
BLOWUP_MARGIN = 2.0
DEFAULT_GROUP = "default"  # parameters no group of the policy takes


@dataclass(frozen=True)
class StateHealth:
    """One parameter's optimizer state, as stored."""

    parameter: str
    module_type: str
    stored_as: str  # the state tensor's class name, or its dtype for a plain tensor
    elements: int
    zero_second_moment_share: float  # exp_avg_sq entries stored as exactly zero
    collapsed_share: float  # ... where exp_avg is not zero: updates of lr * exp_avg / eps
    saturated_share: float = 0.0  # entries of either moment non-finite or at the dtype's max
    blown_up_share: float = 0.0  # entries whose step exceeds Adam's bound x BLOWUP_MARGIN
    update_weight_ratio: float = 0.0  # ||the step the state gives|| / ||weight||

    @property
    def quantised(self) -> bool:
        return not self.stored_as.startswith("torch.")

    @property
    def mechanisms(self) -> tuple[str, ...]:
        """The mechanisms seen in this state, the cause before its effect."""
        shares = {
            UNDERFLOW: self.collapsed_share,
            SATURATION: self.saturated_share,
            BLOWUP: self.blown_up_share,
        }
        return tuple(m for m in MECHANISMS if shares[m] > 0.0)

    def reason(self, threshold: float = 0.0) -> str | None:
        """One line naming the parameter and each mechanism seen beyond ``threshold``."""
        parts = []
        if self.collapsed_share > threshold:
            parts.append(
                f"exp_avg_sq underflows to 0 in {self.collapsed_share:.2%} of entries whose "
                "exp_avg is not zero, so their updates are lr * exp_avg / eps and blow up"
            )
        if self.saturated_share > threshold:
            parts.append(
                f"a moment saturates (non-finite or at its dtype's largest value) in "
                f"{self.saturated_share:.2%} of entries"
            )
        if self.blown_up_share > threshold and self.blown_up_share > self.collapsed_share:
            parts.append(
                f"updates blow up past Adam's bound in {self.blown_up_share:.2%} of entries "
                f"(update/weight ratio {self.update_weight_ratio:.3g})"
            )
        if not parts:
            return None
        return f"{self.parameter} ({self.module_type}, {self.stored_as} states): " + "; ".join(
            parts
        )


@dataclass(frozen=True)
class GroupStateHealth:
    """One parameter group's optimizer state at the end of a trial: the shares over its
    elements (see the module docstring), its step's norm over its weights', its worst
    parameter, the mechanisms seen and the reason naming them (None: healthy)."""

    group: str
    state: str  # the group's state kind (fp32, bf16, 8bit, 4bit, fp8, fp8-bf16)
    parameters: int
    elements: int
    zero_second_moment_share: float
    collapsed_share: float
    saturated_share: float
    blown_up_share: float
    update_weight_ratio: float  # the largest of its parameters'
    worst_parameter: str | None = None
    mechanisms: tuple[str, ...] = ()
    reason: str | None = None

    METRICS = (
        "zero_second_moment_share",
        "collapsed_share",
        "saturated_share",
        "blown_up_share",
        "update_weight_ratio",
    )

    def metrics(self) -> dict[str, float]:
        """The figures by metric name, ``state_health.<group>.<figure>`` (MLflow)."""
        prefix = f"state_health.{metric_safe(self.group)}"
        return {f"{prefix}.{name}": float(getattr(self, name)) for name in self.METRICS}

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mechanisms"] = list(self.mechanisms)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupStateHealth:
        names = cls.__dataclass_fields__
        values = {k: v for k, v in data.items() if k in names}
        values["mechanisms"] = tuple(values.get("mechanisms") or ())
        return cls(**values)


@dataclass(frozen=True)
class GroupStateLoss:
    """What one state kind's quantiser does to a group's real (fp32) second moment:
    ``second_moment_rel_error`` (``||q(v) - v|| / ||v||`` over the group's elements) and
    ``collapsed_share`` (entries whose ``q(exp_avg_sq)`` is 0 while ``q(exp_avg)`` is
    not); ``quantised_elements`` are those the kind really quantises (torchao keeps small
    tensors in their own dtype)."""

    group: str
    kind: str
    elements: int
    quantised_elements: int
    second_moment_rel_error: float
    collapsed_share: float

    def metrics(self) -> dict[str, float]:
        """``state_loss.<group>.<kind>.<figure>`` (MLflow)."""
        prefix = f"state_loss.{metric_safe(self.group)}.{self.kind}"
        return {
            f"{prefix}.second_moment_rel_error": self.second_moment_rel_error,
            f"{prefix}.collapsed_share": self.collapsed_share,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupStateLoss:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class _Sums:
    """Running sums over a group's parameters."""

    parameters: int = 0
    elements: int = 0
    counts: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + value

    def share(self, name: str) -> float:
        return self.counts.get(name, 0.0) / self.elements if self.elements else 0.0


def metric_safe(name: str) -> str:
    """A group's name as an MLflow key may hold it (letters, digits, ``_ - . /``)."""
    return "".join(c if c.isalnum() or c in "_-./" else "_" for c in name)


def adam_step_bound(beta1: float, beta2: float, step: float) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` exact Adam moments can reach after ``step``
    steps, whatever the gradients (Cauchy-Schwarz on the two running sums, with
    ``r = beta1**2 / beta2``)::

        (1 - beta1) / sqrt(1 - beta2) * sqrt((1 - r**t) / (1 - r))
            * sqrt(1 - beta2**t) / (1 - beta1**t)

    Infinite where ``beta1**2 >= beta2`` (no such bound)."""
    ratio = beta1 * beta1 / beta2
    if ratio >= 1.0 or step < 1:
        return math.inf
    first = (1.0 - beta1) / math.sqrt(1.0 - beta2)
    sums = math.sqrt((1.0 - ratio**step) / (1.0 - ratio))
    return first * sums * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def state_health(model: nn.Module, optimizer: Any) -> list[StateHealth]:
    """Every trainable parameter with an Adam state (``exp_avg``, ``exp_avg_sq``), in
    ``named_parameters()`` order; of a sharded state (FSDP2), this rank's shard."""

    modules = dict(model.named_modules())
    groups = {id(p): g for g in getattr(optimizer, "param_groups", []) for p in g["params"]}
    found = []
    for name, parameter in model.named_parameters():
        state = optimizer.state.get(parameter) if hasattr(optimizer.state, "get") else None
        if not state or (moments := _moments(state)) is None:
            continue
        first, second, first_values, second_values, stored_as = moments
        zero = second_values == 0
        collapsed = zero & (first_values != 0)
        saturated = _saturated(first, first_values) | _saturated(second, second_values)
        count = second_values.numel()
        blown, ratio = _steps(
            parameter, state, groups.get(id(parameter)), first_values, second_values
        )
        found.append(
            StateHealth(
                name,
                type(modules[name.rpartition(".")[0]]).__name__,
                stored_as,
                count,
                float(zero.sum()) / count,
                float(collapsed.sum()) / count,
                float(saturated.sum()) / count,
                blown / count,
                ratio,
            )
        )
    return found


def group_health(
    model: nn.Module, states: OptimizerStates, health: list[StateHealth]
) -> list[GroupStateHealth]:
    """``health`` per group of ``states`` (``default``: parameters no group takes), in
    the order of the groups: shares over the group's elements, the largest update/weight
    ratio of its parameters, and its worst parameter's reason."""
    sums: dict[str, _Sums] = {}
    kinds: dict[str, str] = {}
    worst: dict[str, StateHealth] = {}
    ratios: dict[str, float] = {}
    assigned = states.assign(model)
    for item in health:
        group = states.group_of(model, item.parameter)
        name = DEFAULT_GROUP if group is None else group.describe()
        kinds[name] = assigned[item.parameter].state
        total = sums.setdefault(name, _Sums())
        total.parameters += 1
        total.elements += item.elements
        for share in GroupStateHealth.METRICS[:-1]:
            total.add(share, getattr(item, share) * item.elements)
        ratios[name] = max(ratios.get(name, 0.0), item.update_weight_ratio)
        if name not in worst or _severity(item) > _severity(worst[name]):
            worst[name] = item
    found = []
    for name, total in sums.items():
        bad = worst[name]
        reason = bad.reason()
        found.append(
            GroupStateHealth(
                name,
                kinds[name],
                total.parameters,
                total.elements,
                total.share("zero_second_moment_share"),
                total.share("collapsed_share"),
                total.share("saturated_share"),
                total.share("blown_up_share"),
                ratios[name],
                bad.parameter if reason else None,
                tuple(m for m in MECHANISMS if total.share(_SHARE_OF[m]) > 0.0),
                None if reason is None else f"optimizer state of group {name}: {reason}",
            )
        )
    return found


_SHARE_OF = {UNDERFLOW: "collapsed_share", SATURATION: "saturated_share", BLOWUP: "blown_up_share"}


def worst_group(groups: list[GroupStateHealth]) -> GroupStateHealth | None:
    """The group whose state hurts most (a reason, then the largest shares), if any."""
    hurting = [g for g in groups if g.reason is not None]
    return max(
        hurting,
        key=lambda g: (g.collapsed_share, g.saturated_share, g.blown_up_share),
        default=None,
    )


def state_loss(
    model: nn.Module, optimizer: Any, states: OptimizerStates, kinds: tuple[str, ...]
) -> list[GroupStateLoss]:
    """Per group of ``states`` and per kind of ``kinds``, what the kind's quantiser does
    to the real fp32 state ``optimizer`` holds (an Adam-family optimizer's; none for
    another's). Each moment is copied into the buffer the kind's optimizer would store it
    in (`autoprec.optim.optimizer.state_buffer`: torchao's blockwise codes, a bf16 tensor,
    or the parameter's dtype where torchao does not quantise it) and read back."""
    import torch

    from autoprec.optim.optimizer import state_buffer

    reference = _adam_reference(optimizer)
    if reference is None:
        return []
    sums: dict[tuple[str, str], _Sums] = {}
    for name, parameter in model.named_parameters():
        state = optimizer.state.get(parameter) if hasattr(optimizer.state, "get") else None
        if not state or "exp_avg_sq" not in state or "exp_avg" not in state:
            continue
        group = states.group_of(model, name)
        group_name = DEFAULT_GROUP if group is None else group.describe()
        exact_first, exact_second = _values(state["exp_avg"]), _values(state["exp_avg_sq"])
        for kind in kinds:
            first = state_buffer(kind, parameter, reference, signed=True)
            second = state_buffer(kind, parameter, reference, signed=False)
            first.copy_(exact_first.to(first.dtype))
            second.copy_(exact_second.to(second.dtype))
            got_first, got_second = _values(first), _values(second)
            total = sums.setdefault((group_name, kind), _Sums())
            total.parameters += 1
            total.elements += exact_second.numel()
            if type(second) is not torch.Tensor or second.dtype != torch.float32:
                total.add("quantised", exact_second.numel())
            total.add("error_sq", float((got_second - exact_second).pow(2).sum()))
            total.add("norm_sq", float(exact_second.pow(2).sum()))
            total.add("collapsed", float(((got_second == 0) & (got_first != 0)).sum()))
    return [
        GroupStateLoss(
            group,
            kind,
            total.elements,
            int(total.counts.get("quantised", 0)),
            math.sqrt(total.counts["error_sq"] / total.counts["norm_sq"])
            if total.counts.get("norm_sq")
            else 0.0,
            total.share("collapsed"),
        )
        for (group, kind), total in sums.items()
    ]


def rank_state_groups(
    losses: Sequence[GroupStateLoss], kind: str, names: Sequence[str]
) -> list[str]:
    """``names`` (state groups), those whose states ``kind`` loses most first: first the
    groups where second moments become zero under a live first moment, by that share
    (their next updates are ``lr * exp_avg / eps``: unbounded, however few), then by the
    second moment's relative error (bounded: a few percent of a step). Groups without
    figures (a baseline from before they were measured) come last, in ``names``' order."""
    figures = {loss.group: loss for loss in losses if loss.kind == kind}
    order = list(names)

    def key(name: str) -> tuple[bool, float, float, int]:
        loss = figures.get(name)
        if loss is None:
            return (True, 0.0, 0.0, order.index(name))
        return (False, -loss.collapsed_share, -loss.second_moment_rel_error, order.index(name))

    return sorted(order, key=key)


def _adam_reference(optimizer: Any) -> Any:
    """The Adam-family optimizer whose class and defaults the kinds' optimizers take: the
    optimizer itself, or a policy optimizer's fp32 part (None: not Adam)."""
    import torch

    parts = [part for _, part in getattr(optimizer, "parts", [])] or [optimizer]
    return next((p for p in parts if isinstance(p, torch.optim.Adam)), None)


def _severity(item: StateHealth) -> tuple[float, float, float]:
    return (item.collapsed_share, item.saturated_share, item.blown_up_share)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor's shard (under FSDP2: this rank's part of the state), else itself."""
    return getattr(tensor, "_local_tensor", tensor)


def _moments(
    state: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str] | None:
    """Adam's two moments as stored, their values in fp32 and how they are stored: torch's
    and torchao's ``exp_avg``/``exp_avg_sq`` (a shard under FSDP2), or bitsandbytes'
    ``state1``/``state2`` (8-bit codes read back through its own blockwise dequantisation,
    or 32-bit tensors); None for a state without both."""
    import torch

    if "exp_avg" in state and "exp_avg_sq" in state:
        first, second = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        stored_as = (
            f"torch.{second.dtype}".replace("torch.torch.", "torch.")
            if type(second) is torch.Tensor
            else type(second).__name__
        )
        return first, second, _values(first), _values(second), stored_as
    if "state1" in state and "state2" in state:  # bitsandbytes
        first, second = state["state1"], state["state2"]
        if first.dtype != torch.uint8:
            return first, second, _values(first), _values(second), str(second.dtype)
        from bitsandbytes.functional import dequantize_blockwise

        def read(index: int) -> torch.Tensor:
            codes, absmax, code = (state[f"{k}{index}"] for k in ("state", "absmax", "qmap"))
            # bitsandbytes' 8-bit optimizers quantise in blocks of 256 (one absmax each)
            return dequantize_blockwise(codes, absmax=absmax, code=code, blocksize=256).float()

        return first, second, read(1), read(2), "bitsandbytes 8-bit"
    return None


def _values(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    dequantize = getattr(tensor, "dequantize", None)
    if type(tensor) is not torch.Tensor and dequantize is not None:
        return dequantize().float()
    return tensor.detach().float()


def _saturated(stored: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Entries non-finite, or at the largest finite value of a plain narrow float dtype."""
    import torch

    found = ~torch.isfinite(values)
    if type(stored) is torch.Tensor and stored.dtype in (torch.bfloat16, torch.float16):
        found |= values.abs() >= torch.finfo(stored.dtype).max
    return found


def _steps(
    parameter: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any] | None,
    first: torch.Tensor,
    second: torch.Tensor,
) -> tuple[float, float]:
    """Entries whose step (``|m_hat| / (sqrt(v_hat) + eps)``, from the moments' values
    ``first`` and ``second``) exceeds Adam's bound by ``BLOWUP_MARGIN``, and the norm of
    the update the state gives over the weight's."""
    import torch

    if group is None or "step" not in state:
        return 0.0, 0.0
    step = float(state["step"])
    beta1, beta2 = (float(b) for b in group["betas"])
    eps, lr = float(group["eps"]), float(group["lr"])
    if step < 1:
        return 0.0, 0.0
    denominator = second.clamp(min=0).sqrt() / math.sqrt(1.0 - beta2**step) + eps
    ratio = (first / (1.0 - beta1**step)).abs() / denominator
    ratio = torch.where(torch.isfinite(ratio), ratio, torch.full_like(ratio, math.inf))
    blown = float((ratio > BLOWUP_MARGIN * adam_step_bound(beta1, beta2, step)).sum())
    weight = float(parameter.detach().float().norm())
    update = float((lr * ratio).norm())
    return blown, update / weight if weight > 0 else (math.inf if update > 0 else 0.0)
