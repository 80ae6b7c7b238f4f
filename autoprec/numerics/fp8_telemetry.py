"""fp8 telemetry: what torchao's float8 casts do to each fp8 layer's tensors.

torchao's float8 training (tensorwise and rowwise recipes) scales dynamically: every
forward computes ``scale = fp8_max / amax`` of the tensor it casts and keeps no scale
between steps (``Float8Linear`` holds none). So this module recomputes, on the steps
telemetry observes, what torchao's casts do, with torchao's own functions
(``float8_utils.tensor_to_scale`` and ``to_fp8_saturated``) and the layer's own cast
configs, for the three tensors of the output matmul and the grad-input matmul:

- ``input`` (cast as ``cast_config_input``, rows scaled along the last dimension),
- ``weight`` (``cast_config_weight``, on ``weight.t()`` along dimension 0, as torchao),
- ``grad_output`` (``cast_config_grad_output``; e5m2 under the tensorwise recipe).

Per layer and tensor, over the observed steps:

- ``amax``: the largest magnitude; ``scale``: the smallest scale torchao used (its
  coarsest: the step, or the row, with the largest amax);
- ``above_max``: values whose magnitude exceeds the fp8 format's largest value (448 for
  e4m3, 57344 for e5m2) before scaling: what an unscaled cast would saturate;
- ``saturated``: values clamped at the format's largest value after scaling, beyond
  half its last step (dynamic scaling keeps this at 0; a nonzero count says the scale
  did not cover the tensor: a delayed or rounded scale);
- ``flushed``: nonzero values that become zero once scaled and cast, and
  ``flushed_share`` of the nonzero ones: what one outlier does to a tensorwise scale.

The counts are computed on the device and go into the trial's `autoprec.numerics.watch.Watcher`,
so that they reach the host with the rest of the step's telemetry in its one transfer.
torchao is imported only when a model holds fp8 layers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from autoprec.formats.fp8 import is_converted
from autoprec.numerics.watch import Counts, Watcher

# The watcher's kinds for the three cast tensors of an fp8 layer.
ROLES = {"input": "fp8_input", "weight": "fp8_weight", "grad_output": "fp8_grad_output"}
ROLE_LABELS = {"input": "inputs", "weight": "weights", "grad_output": "output gradients"}
# Layout of one counts vector; the last two columns accumulate as maxima.
COLUMNS = ("elements", "nonzero", "above_max", "saturated", "flushed", "amax", "inverse_scale")
_MAXIMA = frozenset({5, 6})
# A layer whose cast flushes more than this share of a tensor's nonzero values is named.
FLUSH_WARNING = 0.01
_FIELDS = ("amax", "scale", "above_max", "saturated", "flushed", "flushed_share")


@dataclass(frozen=True)
class CastSpec:
    """How torchao casts one tensor of one layer: the fp8 dtype, the dimension scaled
    along (None: one scale for the tensor) and whether scales round down to powers of 2."""

    dtype: torch.dtype
    axiswise_dim: int | None = None
    round_scales_to_power_of_2: bool = False

    @property
    def format_max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    @property
    def saturation_bound(self) -> float:
        """The smallest scaled magnitude the cast clamps rather than rounds: the format's
        largest value plus half its last step (a scale's own rounding, which puts the
        amax a hair above the largest value, is not saturation)."""
        info = torch.finfo(self.dtype)
        top_step = 2.0 ** math.floor(math.log2(float(info.max))) * float(info.eps)
        return float(info.max) + top_step / 2

    @property
    def format_name(self) -> str:
        return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(
            self.dtype, str(self.dtype).removeprefix("torch.")
        )


def cast_counts(tensor: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """One tensor's counts (the `COLUMNS`) as a float64 vector on its device, computed
    with torchao's own scale and saturated cast, without a host sync."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    values = tensor.detach()
    granularity = (
        ScalingGranularity.TENSORWISE if spec.axiswise_dim is None else ScalingGranularity.AXISWISE
    )
    scale = tensor_to_scale(
        values,
        spec.dtype,
        scaling_granularity=granularity,
        axiswise_dim=spec.axiswise_dim,
        round_scales_to_power_of_2=spec.round_scales_to_power_of_2,
    )
    scaled = values.to(torch.float32) * scale  # as torchao's hp_tensor_and_scale_to_float8
    cast = to_fp8_saturated(scaled, spec.dtype)
    nonzero = values != 0
    largest = spec.format_max
    parts = [
        torch.full((), values.numel(), device=values.device),
        nonzero.sum(),
        (values.float().abs() > largest).sum(),
        (scaled.abs() >= spec.saturation_bound).sum(),
        (nonzero & (cast.float() == 0)).sum(),
        values.float().abs().amax(),
        (1.0 / scale.double()).amax(),
    ]
    return torch.stack([part.double() for part in parts])


def cast_specs(module: nn.Module) -> dict[str, CastSpec]:
    """The casts torchao's ``Float8Linear`` ``module`` makes in its output and grad-input
    matmuls, by role (a role whose scaling is disabled is left out)."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    config: Any = module.config  # torchao's Float8LinearConfig
    configs = {
        "input": (config.cast_config_input, -1),
        "weight": (config.cast_config_weight, 0),  # on weight.t(), as torchao casts it
        "grad_output": (config.cast_config_grad_output, -1),
    }
    specs = {}
    for role, (cast, dim) in configs.items():
        if cast.scaling_type is ScalingType.DISABLED:
            continue
        axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        specs[role] = CastSpec(
            cast.target_dtype, dim if axiswise else None, bool(config.round_scales_to_power_of_2)
        )
    return specs


@dataclass
class Fp8Cast:
    """One cast tensor's totals over the observed steps (see the module docstring)."""

    format: str
    elements: int = 0
    nonzero: int = 0
    above_max: int = 0
    saturated: int = 0
    flushed: int = 0
    amax: float = 0.0
    scale: float = 0.0

    @property
    def flushed_share(self) -> float:
        return self.flushed / self.nonzero if self.nonzero else 0.0


@dataclass
class Fp8LayerStats:
    """One fp8 layer's casts by role ("input", "weight", "grad_output")."""

    name: str
    casts: dict[str, Fp8Cast] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """Flat ``fp8_<role>_<figure>`` fields, for the per-layer telemetry table."""
        data: dict[str, Any] = {}
        for role in ROLES:
            cast = self.casts.get(role)
            for name in _FIELDS:
                data[f"fp8_{role}_{name}"] = None if cast is None else getattr(cast, name)
        return data

    def worst(self) -> tuple[str, Fp8Cast] | None:
        """The role whose cast flushes the largest share of its nonzero values."""
        if not self.casts:
            return None
        return max(self.casts.items(), key=lambda item: item[1].flushed_share)


class Fp8Telemetry:
    """fp8 cast figures of the torchao float8 layers in ``model``, counted into
    ``watcher`` (shared with the rest of the step's telemetry: one host transfer)."""

    def __init__(self, model: nn.Module, watcher: Watcher) -> None:
        self.model = model
        self._watcher = watcher
        self._specs: dict[str, dict[str, CastSpec]] = {}

    def layers(self) -> list[tuple[str, nn.Module]]:
        """The model's fp8 layers now (a policy may have converted them after this was
        made)."""
        return [(n, m) for n, m in self.model.named_modules() if is_converted(m)]

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Count the casts of every fp8 layer that runs in this block, and of the output
        gradients that reach it when the backward pass runs."""
        handles = []
        for name, module in self.layers():
            specs = self._specs.setdefault(name, cast_specs(module))
            handles.append(module.register_forward_hook(partial(self._hook, name, specs)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(
        self, name: str, specs: dict[str, CastSpec], module: nn.Module, args: Any, output: Any
    ) -> None:
        with torch.no_grad():
            if "input" in specs and args and isinstance(args[0], torch.Tensor):
                tensor = args[0]
                if torch.is_autocast_enabled():  # Float8Linear.forward casts it so first
                    tensor = tensor.to(torch.get_autocast_gpu_dtype())
                self._count(name, "input", tensor, specs["input"])
            if "weight" in specs:
                weight: Any = module.weight
                self._count(name, "weight", weight.t(), specs["weight"])
        if "grad_output" in specs and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._grad_hook, name, specs["grad_output"]))

    def _grad_hook(self, name: str, spec: CastSpec, grad: torch.Tensor) -> None:
        """The output gradient as torchao reshapes it for the grad-input matmul."""
        self._count(name, "grad_output", grad.reshape(-1, grad.shape[-1]), spec)

    def _count(self, name: str, role: str, tensor: torch.Tensor, spec: CastSpec) -> None:
        counts = Counts(partial(cast_counts, spec=spec), _MAXIMA)
        self._watcher.count(name, ROLES[role], tensor, counts)

    @property
    def stats(self) -> dict[str, Fp8LayerStats]:
        """Totals per fp8 layer, from what the watcher has collected."""
        found: dict[str, Fp8LayerStats] = {}
        for (name, kind), total in self._watcher.totals.items():
            role = next((r for r, k in ROLES.items() if k == kind), None)
            specs = self._specs.get(name, {})
            if role is None or role not in specs:
                continue
            values = dict(zip(COLUMNS, total, strict=True))
            inverse = values["inverse_scale"]
            cast = Fp8Cast(
                format=specs[role].format_name,
                elements=int(values["elements"]),
                nonzero=int(values["nonzero"]),
                above_max=int(values["above_max"]),
                saturated=int(values["saturated"]),
                flushed=int(values["flushed"]),
                amax=float(values["amax"]),
                scale=1.0 / inverse if inverse > 0 else 0.0,
            )
            found.setdefault(name, Fp8LayerStats(name)).casts[role] = cast
        return found

    def worst(self) -> tuple[str, str, Fp8Cast] | None:
        """(layer, role, cast) that flushes the largest share of nonzero values, if above
        `FLUSH_WARNING`."""
        candidates = [(name, *w) for name, s in self.stats.items() if (w := s.worst())]
        if not candidates:
            return None
        name, role, cast = max(candidates, key=lambda c: c[2].flushed_share)
        return (name, role, cast) if cast.flushed_share > FLUSH_WARNING else None

    def evidence(self) -> str | None:
        """The fp8 layer to keep out of fp8, in one line (None: no cast flushes much)."""
        worst = self.worst()
        if worst is None:
            return None
        name, role, cast = worst
        return (
            f"fp8: {name} flushes {cast.flushed_share:.1%} of its nonzero {ROLE_LABELS[role]} "
            f"to zero in {cast.format} (amax {cast.amax:.3g}, scale {cast.scale:.3g}); "
            f"keep {name} out of fp8"
        )

    def warnings(self) -> list[str]:
        """One line per fp8 layer and tensor whose cast flushes or saturates, worst first."""
        lines = []
        rows = [(n, r, c) for n, s in self.stats.items() for r, c in s.casts.items()]
        for name, role, cast in sorted(rows, key=lambda row: -row[2].flushed_share):
            if cast.flushed_share > FLUSH_WARNING:
                lines.append(
                    f"fp8 flush: {cast.flushed_share:.1%} of {name}'s nonzero "
                    f"{ROLE_LABELS[role]} become 0 in {cast.format} (amax {cast.amax:.3g}, "
                    f"scale {cast.scale:.3g}); keep it in bf16 or use rowwise scaling"
                )
            if cast.saturated:
                lines.append(
                    f"fp8 saturation: {cast.saturated} of {name}'s {ROLE_LABELS[role]} clamp "
                    f"at {cast.format}'s largest value after scaling"
                )
        return lines
