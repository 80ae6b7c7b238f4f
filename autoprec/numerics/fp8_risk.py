"""fp8 risk: how far each fp8-capable Linear's output moves in torchao's float8 against
bf16, from one cheap pass, so that the guided search keeps the riskiest out of fp8 first.

The profile's forward on its fixed batch (after its fp32 steps) hands each Linear that
torchao's float8 training can convert (`autoprec.formats.fp8.fp8_capable`) its input; each such
layer is then run twice on that same input, forward only:

- in bf16 (input, weight and bias in bf16, as a bf16 region runs it), the reference;
- as torchao's ``Float8Linear`` with the recipe (a converted copy; the model is left
  alone), which casts input and weight to e4m3 with dynamic scales.

A layer's fp8 risk is the relative L2 deviation of the fp8 output from the bf16 one, row
by row (a sample, a token) and averaged over the rows (`_row_deviation`): what float8
itself loses, beyond what the bf16 region around it already loses. An
outlier channel in a layer's input shows here at once: tensorwise scaling divides the
whole input by the outlier, and the ordinary values flush to zero (the share of nonzero
inputs that flush is reported beside it, from the same cast `autoprec.numerics.fp8_telemetry`
counts in trials). One layer at a time, on a copy: a few small matmuls per layer.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.errors import first_line
from autoprec.formats.fp8 import DEFAULT_FP8_RECIPE, check_recipe, fp8_capable
from autoprec.formats.methods import import_torchao
from autoprec.numerics.fp8_telemetry import COLUMNS, cast_counts, cast_specs


@dataclass(frozen=True)
class Fp8Risk:
    """One Linear's fp8 figures on the profile's batch: the relative output deviation
    from bf16 (its risk) and the share of its nonzero inputs the fp8 cast flushes."""

    name: str
    output_deviation: float | None
    input_flushed_share: float = 0.0
    error: str = ""  # the layer could not be run in fp8 here (not a risk)

    @property
    def reason(self) -> str:
        if self.error:
            return f"fp8 not measured: {self.error}"
        assert self.output_deviation is not None
        return (
            f"output off by {100 * self.output_deviation:.3g}% against bf16; "
            f"{100 * self.input_flushed_share:.3g}% of nonzero inputs flush to zero"
        )


def fp8_risks(
    model: nn.Module,
    run_forward: Callable[[], Any],
    names: Sequence[str],
    recipe: str = DEFAULT_FP8_RECIPE,
) -> dict[str, Fp8Risk]:
    """The fp8 risk of each fp8-capable Linear among ``names`` that runs in one call of
    ``run_forward`` (the model's forward on the profile's batch, in fp32)."""
    import_torchao()
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(check_recipe(recipe, "fp8 recipe"))
    modules = dict(model.named_modules())
    capable = [n for n in names if n in modules and fp8_capable(modules[n])]
    inputs: dict[str, torch.Tensor] = {}

    def keep(name: str, module: nn.Module, args: Any) -> None:
        if name not in inputs and args and isinstance(args[0], torch.Tensor):
            inputs[name] = args[0].detach().float()

    handles = [
        modules[n].register_forward_pre_hook(lambda m, a, n=n: keep(n, m, a)) for n in capable
    ]
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
    risks = {}
    for name in capable:
        if name not in inputs:
            continue  # not run in the forward
        layer, x = modules[name], inputs[name]
        assert isinstance(layer, nn.Linear)
        try:
            with torch.no_grad():
                bias = None if layer.bias is None else layer.bias.bfloat16()
                reference = nn.functional.linear(
                    x.bfloat16(), layer.weight.bfloat16(), bias
                ).float()
                converted = Float8Linear.from_float(copy.deepcopy(layer), config=config)
                output = converted(x).float()
                counts = cast_counts(x, cast_specs(converted)["input"]).tolist()
        except Exception as error:  # torchao or the device refusing: not a numerical risk
            risks[name] = Fp8Risk(name, None, error=f"{type(error).__name__}: {first_line(error)}")
            continue
        deviation = _row_deviation(output, reference)
        cast = dict(zip(COLUMNS, counts, strict=True))
        risks[name] = Fp8Risk(
            name,
            deviation if math.isfinite(deviation) else math.inf,
            cast["flushed"] / cast["nonzero"] if cast["nonzero"] else 0.0,
        )
    return risks


def _row_deviation(output: torch.Tensor, reference: torch.Tensor) -> float:
    """The relative L2 deviation of each output row (a sample, a token) from the
    reference's, averaged over the rows: a few rows with massive values (the outlier's
    own) would carry a deviation of the whole tensor, while the rows they crush count
    here as much as they do for the loss."""
    rows = reference.reshape(-1, reference.shape[-1])
    norms = torch.linalg.vector_norm(rows, dim=-1).clamp_min(1e-12)
    errors = torch.linalg.vector_norm(output.reshape(rows.shape) - rows, dim=-1)
    return float((errors / norms).mean())
