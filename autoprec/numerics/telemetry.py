"""Numerics telemetry: what low precision loses or breaks, layer by layer.

Usable in any training loop::

    monitor = GradientMonitor(model)
    with monitor.activations():          # forward hooks for this step only
        with prec.autocast():
            out = model(x)
    loss = loss_fn(out.float(), y)
    prec.backward(loss)
    stepped = prec.step(optimizer)       # gradients are unscaled in place
    monitor.observe_gradients(scale=scale_used)
    report = monitor.report()            # per-layer figures, warnings with advice

Per layer (leaf modules with parameters):
- ``grad_underflow_ratio``: the share of *nonzero* fp32 gradient elements that would
  flush to zero if held in fp16 at the loss scale in use. True zeros (a dead ReLU, an
  unused row) are not counted as lost, unlike a plain count of zeros. Gradients that
  were computed in fp16 are already quantised and show 0 here: for them compare
  ``grad_zero_share`` with the same layer's share in an fp32 run.
- ``grad_nonfinite``: inf/NaN gradient elements.
- ``act_nonfinite``: inf/NaN output elements (forward overflow).
- ``act_at_fp16_max``: finite outputs with ``|x| >= 65504``: saturated values on an
  fp16 layer (Ascend 910A saturates instead of producing inf), or, on an fp32/bf16
  layer, values that would overflow if the layer ran in fp16.
- ``act_overflow_origin``: observed steps on which the module turned inputs that were
  finite and within fp16's range into outputs that are not: where overflow starts, as
  opposed to the modules that only pass it on.
Activations are watched on every module (a parent's own arithmetic can overflow, as in
``h * h``); gradients on the leaf modules that hold parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.structures import tensors
from autoprec.numerics.first_events import FirstEvents
from autoprec.numerics.forecast import RangeSeries, dtype_code, dtype_of_code
from autoprec.numerics.fp8_telemetry import Fp8Telemetry
from autoprec.numerics.watch import CALL, PARAM_GRAD, Counts, Watcher

FP16_MAX = formats.get("fp16").limits.largest  # ``act_at_fp16_max`` counts up to it
RANGE_SAMPLE = 4096  # gradient elements sampled per tensor for the low quantile
UNDERFLOW_WARNING = 0.01  # warn when more than 1% of nonzero gradients would flush


@dataclass
class LayerStats:
    """Totals for one layer over the observed steps."""

    name: str
    grad_elements: int = 0
    grad_nonzero: int = 0
    grad_zero: int = 0
    grad_flushed: int = 0
    grad_nonfinite: int = 0
    act_elements: int = 0
    act_nonfinite: int = 0
    act_at_fp16_max: int = 0
    act_overflow_origin: int = 0
    act_max_abs: float = 0.0

    @property
    def grad_underflow_ratio(self) -> float:
        return self.grad_flushed / self.grad_nonzero if self.grad_nonzero else 0.0

    @property
    def grad_zero_share(self) -> float:
        return self.grad_zero / self.grad_elements if self.grad_elements else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["grad_underflow_ratio"] = self.grad_underflow_ratio
        data["grad_zero_share"] = self.grad_zero_share
        return data


def _flush_counts(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """(elements, nonzero, zero, flushed, nonfinite) of one gradient held in fp16 at the
    loss scale ``scale``."""
    scaled = grad.detach().float() * scale
    finite = torch.isfinite(scaled)
    nonzero = (scaled != 0) & finite
    flushed = nonzero & (scaled.to(torch.float16) == 0)
    parts = [
        torch.full((), scaled.numel(), device=scaled.device),
        nonzero.sum(),
        (scaled == 0).sum(),
        flushed.sum(),
        (~finite).sum(),
    ]
    return torch.stack([part.double() for part in parts])


def _output_counts(tensor: torch.Tensor) -> torch.Tensor:
    """(elements, nonfinite, finite at or above fp16's maximum, largest finite magnitude)."""
    values = tensor.detach()
    finite = torch.isfinite(values)
    magnitude = torch.where(finite, values.abs(), 0).float()
    parts = [
        torch.full((), values.numel(), device=values.device),
        (~finite).sum(),
        (magnitude >= FP16_MAX).sum(),
        magnitude.amax(),
    ]
    return torch.stack([part.double() for part in parts])


def _activation_counts(args: Any, kwargs: Any, output: Any) -> torch.Tensor:
    """One call's `_output_counts` over its floating outputs (summed, the magnitude as a
    maximum), then 1 if the call is where overflow starts: its floating positional
    inputs were all finite and below 65504, and some output is not."""
    per_output = [_output_counts(t) for t in tensors(output) if t.is_floating_point() and t.numel()]
    if not per_output:
        return torch.zeros(len(_ACTIVATION_FIELDS), dtype=torch.float64)
    device = per_output[0].device
    rows = torch.stack([row.to(device) for row in per_output])
    clean = torch.ones((), dtype=torch.bool, device=device)
    for tensor in tensors(args):
        if tensor.is_floating_point() and tensor.numel():
            in_range = torch.isfinite(tensor) & (tensor.detach().abs() < FP16_MAX)
            clean = clean & in_range.all().to(device)
    broken = (rows[:, 1] + rows[:, 2] > 0).any()
    origin = (clean & broken).double().reshape(1)
    return torch.cat([rows[:, :3].sum(dim=0), rows[:, 3].amax().reshape(1), origin])


def _grad_range(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """`_flush_counts`, then the largest |gradient| and a low quantile (the 1st
    percentile, of up to ``RANGE_SAMPLE`` elements taken at a stride) of the nonzero
    ones, as held at the loss scale, for the range series (`autoprec.numerics.forecast`)."""
    scaled = grad.detach().float().flatten() * scale
    magnitude = scaled.abs()
    sample = magnitude[:: max(1, magnitude.numel() // RANGE_SAMPLE)]
    sample = torch.where((sample > 0) & torch.isfinite(sample), sample, torch.inf)
    k = max(1, sample.numel() // 100)
    low = torch.kthvalue(sample, k).values
    largest = torch.where(torch.isfinite(magnitude), magnitude, 0).amax()
    # The quantile is kept negated, so that a maximum over a layer's parameters keeps the
    # smallest.
    return torch.cat([_flush_counts(grad, scale), torch.stack([largest, -low]).double()])


def _activation_range_counts(args: Any, kwargs: Any, output: Any) -> torch.Tensor:
    """`_activation_counts`, then the output dtype's code (`autoprec.numerics.forecast.dtype_code`),
    the count of outputs that are exactly zero (for `autoprec.numerics.first_events`) and the count
    of subnormal ones (nonzero, below their dtype's smallest normal: values shrinking into
    the band where they flush to zero, for `autoprec.numerics.forecast`)."""
    counts = _activation_counts(args, kwargs, output)
    floating = [t for t in tensors(output) if t.is_floating_point() and t.numel()]
    code = max((dtype_code(str(t.dtype).removeprefix("torch.")) for t in floating), default=0)
    zeros = torch.zeros(1, dtype=counts.dtype, device=counts.device)
    subnormal = torch.zeros(1, dtype=counts.dtype, device=counts.device)
    for tensor in floating:
        values = tensor.detach()
        zeros = zeros + (values == 0).sum().to(counts.device)
        tiny = torch.finfo(values.dtype).tiny
        subnormal = subnormal + ((values != 0) & (values.abs() < tiny)).sum().to(counts.device)
    code_column = torch.full((1,), float(code), dtype=counts.dtype, device=counts.device)
    return torch.cat([counts, code_column, zeros, subnormal])


# The watcher's totals by kind, in LayerStats' terms: calls hold the activation counts.
_ACTIVATION_FIELDS = (
    "act_elements",
    "act_nonfinite",
    "act_at_fp16_max",
    "act_max_abs",
    "act_overflow_origin",
)
_GRADIENT_FIELDS = ("grad_elements", "grad_nonzero", "grad_zero", "grad_flushed", "grad_nonfinite")
_FIELDS = {CALL: _ACTIVATION_FIELDS, PARAM_GRAD: _GRADIENT_FIELDS}
_ACTIVATIONS = Counts(_activation_counts, maxima=frozenset({3}))
# With the range series: the dtype code (a maximum) and the gradients' largest and low
# quantile (maxima; the quantile negated).
_ACTIVATION_RANGES = Counts(_activation_range_counts, maxima=frozenset({3, 5}))
_GRAD_RANGE_MAXIMA = frozenset({5, 6})


class GradientMonitor:
    """Collects per-layer telemetry on the steps you ask it to observe. The counts stay
    on the device until the step's gradients are observed or the figures are read: one
    host transfer per observed step."""

    def __init__(
        self, model: nn.Module, warn_underflow: float = UNDERFLOW_WARNING, ranges: bool = True
    ) -> None:
        self.model = model
        self.warn_underflow = warn_underflow
        # Per observed step, each layer's range (`autoprec.numerics.forecast.RangeSeries`).
        self.ranges: RangeSeries | None = RangeSeries() if ranges else None
        self._step = 0
        self._watcher = Watcher(model)
        self.layers = self._watcher.leaves
        self.watched = self._watcher.modules
        self._stats = {name: LayerStats(name) for name, _ in self.layers}
        self.fp8 = Fp8Telemetry(model, self._watcher)  # torchao float8 layers' casts
        self.observed_steps = 0  # forward passes watched
        # What each observed step showed first (`autoprec.numerics.first_events`), and the dtype
        # each layer's outputs were last seen in.
        self.first_events = FirstEvents()
        self.computes: dict[str, str | None] = {}
        self.gradient_steps = 0  # optimizer steps whose gradients were counted

    @property
    def stats(self) -> dict[str, LayerStats]:
        """Totals per layer name, up to date with every step observed so far."""
        self._collect()
        return self._stats

    @contextlib.contextmanager
    def activations(self, step: int | None = None) -> Iterator[None]:
        """Count non-finite and fp16-range outputs of every layer during this block, as
        training step ``step`` (default: the count of observed steps) in the series."""
        self._collect()  # an earlier step's counts, if its gradients were not observed
        self._step = self.observed_steps if step is None else step
        calls = _ACTIVATIONS if self.ranges is None else _ACTIVATION_RANGES
        try:
            with self._watcher.forward(calls=calls), self.fp8.forward():
                yield
        finally:
            self.observed_steps += 1

    def observe_gradients(self, scale: float = 1.0) -> None:
        """Count this step's gradients (unscaled, as after ``prec.step``) per layer."""
        if self.ranges is None:
            counts = Counts(partial(_flush_counts, scale=scale))
        else:
            counts = Counts(partial(_grad_range, scale=scale), maxima=_GRAD_RANGE_MAXIMA)
        self._watcher.parameter_gradients(counts)
        self.gradient_steps += 1
        self._collect()

    def collect(self) -> None:
        """Bring what the observed steps counted to the host now (one transfer), into the
        per-layer stats and the range series."""
        self._collect()

    def _collect(self) -> None:
        """Bring the watcher's changed totals into the per-layer stats."""
        for order, (name, kind) in enumerate(self._watcher.collect()):
            if kind not in _FIELDS:
                continue  # fp8 casts: self.fp8 reads them from the watcher's totals
            stats = self._stats.setdefault(name, LayerStats(name))
            total = self._watcher.totals[(name, kind)]
            for field_name, value in zip(_FIELDS[kind], total, strict=False):
                setattr(stats, field_name, value if field_name == "act_max_abs" else int(value))
            if self.ranges is not None:
                self._add_range(name, kind, self._watcher.latest[(name, kind)])
                self._add_first_events(name, kind, self._watcher.latest[(name, kind)], order)

    def _add_first_events(self, name: str, kind: str, row: list[float], order: int) -> None:
        """One observed step of one layer, for what the telemetry saw first."""
        if kind == CALL:
            dtype = dtype_of_code(row[5])
            self.computes[name] = dtype
            self.first_events.activation(name, self._step, row[0], row[1], row[6], dtype, order)
        elif kind == PARAM_GRAD:
            dtype = self.computes.get(name)
            self.first_events.gradient(name, self._step, row[0], row[2], dtype, order)

    def _add_range(self, name: str, kind: str, row: list[float]) -> None:
        """One observed step's range of one layer, into the series."""
        assert self.ranges is not None
        if kind == CALL:
            share = row[7] / row[0] if row[0] else 0.0
            self.ranges.add_activation(name, self._step, row[3], dtype_of_code(row[5]), share)
        elif kind == PARAM_GRAD:
            self.ranges.add_gradient(name, self._step, row[5], -row[6])

    @property
    def grad_underflow_ratio(self) -> float:
        """Over all layers: flushed / nonzero gradient elements."""
        nonzero = sum(s.grad_nonzero for s in self.stats.values())
        flushed = sum(s.grad_flushed for s in self.stats.values())
        return flushed / nonzero if nonzero else 0.0

    def warnings(self) -> list[str]:
        """What the figures imply, one line each, worst first."""
        lines = []
        for stats in sorted(self.stats.values(), key=lambda s: -s.grad_underflow_ratio):
            if stats.grad_underflow_ratio > self.warn_underflow:
                lines.append(
                    f"underflow: {stats.grad_underflow_ratio:.1%} of {stats.name}'s nonzero "
                    "gradients flush to zero in fp16 at this loss scale; use a larger loss "
                    "scale (dynamic scaling) or keep the layer in fp32/bf16"
                )
        for stats in self.stats.values():
            if not stats.act_overflow_origin:
                continue  # it only passed on what an earlier module produced
            if stats.act_nonfinite:
                lines.append(
                    f"overflow: {stats.name} turned finite inputs into {stats.act_nonfinite} "
                    "non-finite outputs; keep it in fp32 or bf16 (fp16's largest value is 65504)"
                )
            else:
                lines.append(
                    f"overflow risk: {stats.act_at_fp16_max} outputs of {stats.name} reach "
                    f"|x| >= 65504 (max {stats.act_max_abs:.3g}) from inputs below it; in fp16 "
                    "they overflow or saturate: keep it in fp32 or bf16"
                )
        return lines + self.fp8.warnings()

    def report(self, top: int | None = None) -> dict[str, Any]:
        """Per-layer figures (all, or the ``top`` worst), the overall ratio and warnings."""
        self._collect()
        fp8 = self.fp8.stats  # per fp8 layer; every row gets its fields when there are any
        blank = next(iter(fp8.values())).fields() if fp8 else {}

        def flushed(name: str) -> float:
            worst = fp8[name].worst() if name in fp8 else None
            return worst[1].flushed_share if worst else 0.0

        layers = sorted(
            self.stats.values(),
            key=lambda s: (
                s.act_overflow_origin,
                s.act_nonfinite + s.act_at_fp16_max,
                s.grad_underflow_ratio,
                flushed(s.name),
            ),
            reverse=True,
        )
        rows = [
            {**s.to_dict(), **(fp8[s.name].fields() if s.name in fp8 else dict.fromkeys(blank))}
            for s in (layers if top is None else layers[:top])
        ]
        return {
            "observed_steps": self.observed_steps,
            "gradient_steps": self.gradient_steps,
            "grad_underflow_ratio": self.grad_underflow_ratio,
            "layers": rows,
            "warnings": self.warnings(),
        }


def first_nonfinite_layer(model: nn.Module, run_forward: Any) -> str | None:
    """The first module, in order of completion, whose output is not finite in one
    forward: the leaf that overflowed, or the parent whose own arithmetic did."""
    found: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if module is model:
            continue

        def hook(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
            if not found and any(
                t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors(output)
            ):
                found.append(name)

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None
