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
from typing import Any

import torch
from torch import nn

from autoprec.policy import parameterised_leaves
from autoprec.structures import tensors

FP16_MAX = 65504.0
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


def _flush_counts(grad: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """(elements, nonzero, zero, flushed, nonfinite) as 0-d tensors, without a host sync."""
    scaled = grad.detach().float() * scale
    finite = torch.isfinite(scaled)
    nonzero = (scaled != 0) & finite
    flushed = nonzero & (scaled.to(torch.float16) == 0)
    return (
        torch.tensor(scaled.numel()),
        nonzero.sum(),
        (scaled == 0).sum(),
        flushed.sum(),
        (~finite).sum(),
    )


class GradientMonitor:
    """Collects per-layer telemetry on the steps you ask it to observe."""

    def __init__(self, model: nn.Module, warn_underflow: float = UNDERFLOW_WARNING) -> None:
        self.model = model
        self.warn_underflow = warn_underflow
        self.layers = parameterised_leaves(model)
        self.stats = {name: LayerStats(name) for name, _ in self.layers}
        self.watched = [(n, m) for n, m in model.named_modules() if m is not model]
        self.observed_steps = 0  # forward passes watched
        self.gradient_steps = 0  # optimizer steps whose gradients were counted
        self._pending: list[tuple[str, str, torch.Tensor]] = []

    @contextlib.contextmanager
    def activations(self) -> Iterator[None]:
        """Count non-finite and fp16-range outputs of every layer during this block."""
        handles = [module.register_forward_hook(self._hook(name)) for name, module in self.watched]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.observed_steps += 1
            self._collect()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            with torch.no_grad():
                clean = torch.tensor(True)
                for tensor in tensors(args):
                    if tensor.is_floating_point() and tensor.numel():
                        in_range = torch.isfinite(tensor) & (tensor.detach().abs() < FP16_MAX)
                        clean = clean & in_range.all().cpu()
                broken = torch.tensor(False)
                for tensor in tensors(output):
                    if not tensor.is_floating_point() or tensor.numel() == 0:
                        continue
                    values = tensor.detach()
                    finite = torch.isfinite(values)
                    magnitude = torch.where(finite, values.abs(), 0).float()
                    at_max = magnitude >= FP16_MAX
                    self._pending.append((name, "act_elements", torch.tensor(values.numel())))
                    self._pending.append((name, "act_nonfinite", (~finite).sum()))
                    self._pending.append((name, "act_at_fp16_max", at_max.sum()))
                    self._pending.append((name, "act_max_abs", magnitude.amax()))
                    broken = broken | ((~finite).any() | at_max.any()).cpu()
                self._pending.append((name, "act_overflow_origin", (clean & broken).int()))

        return hook

    def observe_gradients(self, scale: float = 1.0) -> None:
        """Count this step's gradients (unscaled, as after ``prec.step``) per layer."""
        fields = ("grad_elements", "grad_nonzero", "grad_zero", "grad_flushed", "grad_nonfinite")
        seen: set[int] = set()  # a parameter shared by two modules counts once
        for name, module in self.layers:
            for param in module.parameters(recurse=False):
                if param.grad is None or id(param) in seen:
                    continue
                seen.add(id(param))
                for field_name, count in zip(fields, _flush_counts(param.grad, scale), strict=True):
                    self._pending.append((name, field_name, count))
        self.gradient_steps += 1
        self._collect()

    def _collect(self) -> None:
        """Move the pending device counters to the host in one transfer."""
        if not self._pending:
            return
        values = torch.stack([v.double().cpu() for _, _, v in self._pending]).tolist()
        for (name, field_name, _), value in zip(self._pending, values, strict=True):
            stats = self.stats.setdefault(name, LayerStats(name))
            if field_name == "act_max_abs":
                stats.act_max_abs = max(stats.act_max_abs, float(value))
            else:
                setattr(stats, field_name, getattr(stats, field_name) + int(value))
        self._pending.clear()

    @property
    def grad_underflow_ratio(self) -> float:
        """Over all layers: flushed / nonzero gradient elements."""
        nonzero = sum(s.grad_nonzero for s in self.stats.values())
        flushed = sum(s.grad_flushed for s in self.stats.values())
        return flushed / nonzero if nonzero else 0.0

    def warnings(self) -> list[str]:
        """What the figures imply, one line each, worst first."""
        self._collect()
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
        return lines

    def report(self, top: int | None = None) -> dict[str, Any]:
        """Per-layer figures (all, or the ``top`` worst), the overall ratio and warnings."""
        self._collect()
        layers = sorted(
            self.stats.values(),
            key=lambda s: (
                s.act_overflow_origin,
                s.act_nonfinite + s.act_at_fp16_max,
                s.grad_underflow_ratio,
            ),
            reverse=True,
        )
        return {
            "observed_steps": self.observed_steps,
            "gradient_steps": self.gradient_steps,
            "grad_underflow_ratio": self.grad_underflow_ratio,
            "layers": [s.to_dict() for s in (layers if top is None else layers[:top])],
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
