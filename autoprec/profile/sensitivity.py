"""Sensitivity profiling: which modules fp16 or bf16 would break, from one cheap pass.

``profile_task`` builds the task's model as a trial does (the same torch seed, the same
batches, the loss in fp32) and runs a few fp32 training steps with every module but the
root watched (parents included: a parent's own arithmetic, such as ``h * h``, can
overflow where none of its children does). Per module and low dtype it records

- value ranges against the dtype's limits, for the outputs, the gradients of the
  outputs and (on leaves that hold parameters) the parameter gradients: the share of
  elements above the dtype's largest value (overflow), and the shares of nonzero
  elements below its smallest normal (precision lost) and below its smallest subnormal
  (flushed to zero);
- the deviation test: on one fixed batch (the first, at most ``DEVIATION_SAMPLES``
  samples of it), after the training steps, a forward pass and the fp32 loss with that
  module alone in the dtype, run as the plan of a policy that puts its layers in that
  dtype and leaves the rest in fp32 would run it (under the backend's autocast, its
  outputs cast back to fp32; the inputs of its layers cast to the dtype where the plan
  casts them, by the one rule both follow, `autoprec.numerics.observe.casts_inputs`), compared
  with the fp32 forward: the relative deviation of the loss and the relative L2
  deviation of the model's output. Forward only, without gradients; but a layer alone is
  first run as a training step runs it (`autoprec.numerics.observe.train_step`: train mode,
  gradients, backward) on the inputs it received, cast where the plan casts them, so
  that a kernel that runs for inference and not for training counts as failing. The
  slice keeps the test cheap (one forward per module and dtype); overflow that the slice
  misses still shows in the value ranges, which cover every training batch. How autocast
  treats each layer is watched first (`autoprec.numerics.observe.learn`), as a search does.

Gradients are measured unscaled (as with a loss scale of 1): their underflow shares say
what fp16 loses without loss scaling.

The risk of a module in dtype ``d``, where every share is measured against d's limits::

    inf                      the output or loss comes out non-finite with the module
                             alone in d
    1 + overflow             else, when overflow > 0: the largest share of outputs,
                             output gradients or parameter gradients above d's maximum
    x / (1 + x)              otherwise, in [0, 1), with
                             x = deviation + flushed + 0.1 * subnormal

where ``deviation`` is the larger of the relative loss and output deviations,
``flushed`` the largest share of nonzero values below d's smallest subnormal and
``subnormal`` the largest share below its smallest normal. A module's risk is its worst
over the dtypes.

The modules that break (risk >= 1: non-finite or overflow) rank first, where the problem
starts before what it reaches: those whose inputs were in the dtype's range, then the
parents that hold one of them that breaks (they only contain it), then those whose
inputs were already out of range (they only pass the problem on); each part riskiest
first. Risk alone would not find the origin: run as a plan runs it, a module alone in
fp16 takes its inputs as the fp32 layers around it hand them, so a block whose outputs
pass 65504 only once its inputs arrive in fp16 (a residual sum promotes an fp32 shortcut)
overflows in its value ranges (risk 1 + overflow) while its parent, which hands it fp16,
and every layer after it, which receives its fp32 outputs past fp16's range, come out
non-finite. The others follow by risk; among equal risks, those that pass a problem on
or contain a riskier descendant rank after the rest.

A forward that fails with a module alone in a dtype (an op without a kernel for it, a
model that cannot take its own outputs back) is not a numerical risk: it is recorded as
the module's ``error``, left out of its risk (shown as "error" in the table when no
dtype could be measured). On a layer with parameters it is also recorded as a dtype
that layer's class cannot run in on the device kind (`autoprec.devices.record_failure`),
so that the space does not offer it and a policy that names it is refused before it
runs; a module holding such a layer is not run in that dtype at all.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.files import write_atomic
from autoprec.devices import DTYPES, Backend, failing_dtypes, get_backend, record_failure
from autoprec.dtypes import LOW_PRECISION
from autoprec.errors import AutoprecError, DeviceError, TaskError, first_line
from autoprec.numerics.observe import casts_inputs, lands_by_cast, layer_inputs, learn, train_step
from autoprec.numerics.watch import INPUT, OUTPUT, OUTPUT_GRAD, PARAM_GRAD, Counts, Watcher
from autoprec.precision.hooks import Installed
from autoprec.precision.plan import Plan, RegionSpec, parameterised_leaves
from autoprec.tasks import Task, check_task, load_task
from autoprec.tasks.base import Batch, logits_of

# The deviation test runs at most this many samples of the fixed batch: fp16 convolutions
# and matmuls are many times slower than fp32 on CPUs without fp16 kernels.
DEVIATION_SAMPLES = 16
SUBNORMAL_WEIGHT = 0.1
# Value kinds watched per module: outputs, gradients of the outputs, parameter gradients.
KINDS = {"act": "outputs", "grad": "output gradients", "param_grad": "parameter gradients"}


def dtype_limits(dtype: str) -> tuple[float, float, float]:
    """(largest value, smallest normal, smallest subnormal) of a dtype."""
    info = torch.finfo(DTYPES[dtype])
    return float(info.max), float(info.tiny), float(info.tiny * info.eps)


@dataclass
class ModuleRisk:
    """One module's figures. ``stats`` maps each profiled dtype to its shares
    (``<kind>_above_max`` of all elements, ``<kind>_below_normal`` and
    ``<kind>_below_subnormal`` of the nonzero ones, for kinds act, grad and param_grad),
    ``loss_deviation``, ``output_deviation``, ``nonfinite`` (1.0 when the module alone
    in that dtype gives a non-finite output or loss) and its ``risk``. ``max_abs`` holds
    the largest magnitudes seen: input (on the deviation batch), act, grad, param_grad;
    ``headroom_bits`` how much of each profiled dtype's range its largest output leaves,
    in bits (log2 of the dtype's largest value over it; negative: past it).
    ``parameters`` counts the module's parameters, its children's included."""

    name: str
    type: str
    parameters: int
    leaf: bool
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    max_abs: dict[str, float] = field(default_factory=dict)
    risk: float = 0.0
    rank: int = 0
    reason: str = ""
    error: str = ""  # the profile could not run the module in some dtype (not a risk)
    # fp8: the output deviation of the Linear in torchao's float8 against bf16 (None: not
    # an fp8-capable Linear, or fp8 not profiled); see autoprec.numerics.fp8_risk.
    fp8_risk: float | None = None
    fp8_reason: str = ""
    headroom_bits: dict[str, float] = field(default_factory=dict)


@dataclass
class Profile:
    """Every module of a task's model (the root excepted), riskiest first."""

    task: str
    device: str
    steps: int
    seed: int
    dtypes: tuple[str, ...]
    modules: list[ModuleRisk]
    time_s: float
    fp8_recipe: str = ""  # the recipe of the fp8 risks ("": fp8 not profiled)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: non-finite floats become the strings "inf", "-inf" and "nan"."""
        return _encode(asdict(self))

    def max_gradient(self) -> float | None:
        """The largest finite parameter or output gradient magnitude any module saw in
        the fp32 steps (None where the profile recorded none): what a loss scale
        multiplies."""
        values = [
            value
            for module in self.modules
            for kind, value in module.max_abs.items()
            if kind in ("grad", "param_grad") and math.isfinite(value) and value > 0
        ]
        return max(values) if values else None

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        try:
            modules = [
                ModuleRisk(
                    name=str(item["name"]),
                    type=str(item["type"]),
                    parameters=int(item["parameters"]),
                    leaf=bool(item["leaf"]),
                    stats={
                        str(d): {str(k): _decode(v) for k, v in values.items()}
                        for d, values in item["stats"].items()
                    },
                    max_abs={str(k): _decode(v) for k, v in item["max_abs"].items()},
                    risk=_decode(item["risk"]),
                    rank=int(item["rank"]),
                    reason=str(item["reason"]),
                    error=str(item.get("error", "")),
                    fp8_risk=None if item.get("fp8_risk") is None else _decode(item["fp8_risk"]),
                    fp8_reason=str(item.get("fp8_reason", "")),
                    headroom_bits={
                        str(d): _decode(v) for d, v in item.get("headroom_bits", {}).items()
                    },
                )
                for item in data["modules"]
            ]
            return cls(
                task=str(data["task"]),
                device=str(data["device"]),
                steps=int(data["steps"]),
                seed=int(data["seed"]),
                dtypes=tuple(str(d) for d in data["dtypes"]),
                modules=modules,
                time_s=float(data["time_s"]),
                fp8_recipe=str(data.get("fp8_recipe", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise AutoprecError(
                f"profile: malformed ({type(error).__name__}: {error}); "
                "expected what Profile.to_dict writes"
            ) from None

    def brief(self) -> dict[str, Any]:
        """`to_dict` without the per-dtype figures: the ranking, which is all a search
        needs (kept in the Optuna study, so that every worker fits the same groups)."""
        data = self.to_dict()
        for module in data["modules"]:
            module["stats"], module["max_abs"] = {}, {}
        return data

    def save(self, path: str | Path) -> Path:
        """The profile as JSON at ``path``, replaced whole (never half written)."""
        return write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile written by ``save``."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as error:
            raise AutoprecError(f"{path}: cannot read ({error.strerror or error})") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise AutoprecError(f"{path}: not a JSON profile") from None
        try:
            return cls.from_dict(data)
        except AutoprecError as error:
            raise AutoprecError(f"{path}: {error}") from None

    def table(self, top: int = 20) -> str:
        """The ``top`` riskiest modules as a ranked plain-text table."""
        header = (
            "rank",
            "module",
            "type",
            "params",
            "risk",
            "max|out|",
            "max|grad|",
            "room bits",
            "reason",
        )
        rows = [
            (
                str(m.rank),
                m.name,
                m.type,
                str(m.parameters),
                "error" if m.error and not m.risk else _number(m.risk),
                _number(m.max_abs.get("act", 0.0)),
                _number(m.max_abs.get("grad", 0.0)),
                _number(min(m.headroom_bits.values())) if m.headroom_bits else "-",
                m.reason,
            )
            for m in self.modules[:top]
        ]
        widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
        right = {0, 3, 4, 5, 6, 7}
        lines = []
        for row in (header, *rows):
            cells = [
                cell.rjust(width) if i in right else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=False))
            ]
            lines.append("  ".join([*cells, row[-1]]).rstrip())
        title = (
            f"profile of {self.task} on {self.device}: {len(self.modules)} modules, "
            f"{self.steps} fp32 steps, {', '.join(self.dtypes)} tested, {self.time_s:.1f} s"
        )
        return "\n".join([title, *lines])

    def fp8_order(self) -> list[ModuleRisk]:
        """The fp8-capable Linear layers with an fp8 risk, riskiest in fp8 first."""
        found = [m for m in self.modules if m.fp8_risk is not None]
        return sorted(found, key=lambda m: -(m.fp8_risk or 0.0))

    def fp8_table(self, top: int = 20) -> str:
        """The ``top`` riskiest layers in fp8 as a ranked plain-text table ("" when fp8
        was not profiled)."""
        ranked = self.fp8_order()[:top]
        if not ranked:
            return ""
        width = max(len("layer"), *(len(m.name) for m in ranked))
        lines = [
            f"fp8 risk ({self.fp8_recipe} against bf16, {len(self.fp8_order())} Linear layers):",
            f"{'rank':>4}  {'layer':<{width}}  {'risk':>8}  reason",
        ]
        for rank, m in enumerate(ranked, start=1):
            risk = _number(m.fp8_risk if m.fp8_risk is not None else 0.0)
            lines.append(f"{rank:>4}  {m.name:<{width}}  {risk:>8}  {m.fp8_reason}")
        return "\n".join(lines)

    def first_missing(self, model: nn.Module) -> str | None:
        """The first profiled module that ``model`` does not have, if any (a profile of
        another model)."""
        names = {name for name, _ in model.named_modules()}
        return next((m.name for m in self.modules if m.name not in names), None)


def profile_task(
    task: Task | str,
    backend: Backend | str = "cpu",
    *,
    steps: int = 3,
    seed: int = 0,
    dtypes: Sequence[str] | None = None,
    model: nn.Module | None = None,
    fp8_recipe: str | None = None,
) -> Profile:
    """Rank every module of ``task``'s model by numerical risk in low precision.

    ``steps`` fp32 training steps are watched, then each module is run alone in each of
    ``dtypes`` (default: the low-precision dtypes the backend runs) on one fixed batch.
    See the module docstring for what is measured and the risk formula. Given a trained
    ``model`` (the serving search's fp32 model), a copy of it is profiled instead of a
    fresh one, in eval mode, and ``steps`` may be 0: its forward on one batch is
    watched (no gradients), without training it. Where the backend runs fp8 (or
    emulates it), each fp8-capable Linear's fp8 risk with ``fp8_recipe`` (default:
    torchao's tensorwise) is measured on the same batch (`autoprec.numerics.fp8_risk`).
    """
    started_s = time.perf_counter()
    task = _checked(task, steps, seed, trained=model is not None)
    backend = get_backend(backend)
    tested = _check_dtypes(dtypes, backend)
    limits = [dtype_limits(d) for d in tested]

    torch.manual_seed(seed)
    if model is None:
        model = check_task(task).to(backend.device).train()
    else:
        model = copy.deepcopy(model).to(backend.device).eval()
    watcher = Watcher(model)
    ranges = Counts(partial(_range_counts, limits=limits), maxima=frozenset({_MAX_ABS}))
    with _task_errors(task), backend.selected():
        first_batch = _watched_steps(task, model, watcher, ranges, backend, steps, seed)
        ran = [name for name, _ in watcher.modules if name in watcher.ran]
        batch = first_batch.head(DEVIATION_SAMPLES)
        with watcher.forward(inputs=ranges):  # to tell where a range problem starts
            reference = _forward(task, model, batch, seed)
        watcher.collect()
    if not math.isfinite(reference[1]):
        raise TaskError(
            f"task {task.name!r}: the fp32 loss is {reference[1]} after {steps} steps; "
            "nothing to compare low precision with"
        )
    with _task_errors(task), backend.selected():
        learn(model, batch.run, backend)  # how the plan will run each layer here
        inputs = layer_inputs(model, batch.run)
    with backend.selected():
        deviations = {
            name: {
                d: _deviation(task, model, name, backend, d, batch, seed, reference, inputs)
                for d in tested
            }
            for name in ran
        }
    modules = _rank(watcher, tested, deviations)
    recipe = ""
    if any(backend.supports(f.name) for f in formats.all_formats() if f.records_conversion):
        from autoprec.formats.fp8 import DEFAULT_FP8_RECIPE
        from autoprec.numerics.fp8_risk import fp8_risks

        recipe = fp8_recipe or DEFAULT_FP8_RECIPE
        with _task_errors(task), backend.selected():
            risks = fp8_risks(model, lambda: _forward(task, model, batch, seed), ran, recipe)
        for entry in modules:
            if entry.name in risks:
                entry.fp8_risk = risks[entry.name].output_deviation
                entry.fp8_reason = risks[entry.name].reason
    return Profile(
        task=task.name,
        device=backend.name,
        steps=steps,
        seed=seed,
        dtypes=tested,
        modules=modules,
        time_s=time.perf_counter() - started_s,
        fp8_recipe=recipe,
    )


def _checked(task: Task | str, steps: int, seed: int, trained: bool) -> Task:
    """The task, loaded by name if need be, after checking the arguments (a trained
    model may be profiled with no training steps)."""
    task = load_task(task) if isinstance(task, str) else task
    if not isinstance(task, Task):
        raise TaskError(
            f"task: expected an autoprec.Task or a task name, got {type(task).__name__}"
        )
    least = 0 if trained else 1
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < least:
        expected = "an integer >= 0" if least == 0 else "a positive integer"
        raise AutoprecError(f"steps: expected {expected}, got {steps!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise AutoprecError(f"seed: expected an integer, got {seed!r}")
    return task


def _watched_steps(
    task: Task,
    model: nn.Module,
    watcher: Watcher,
    ranges: Counts,
    backend: Backend,
    steps: int,
    seed: int,
) -> Batch:
    """``steps`` fp32 training steps under the watcher (values and gradients counted);
    with none, one watched forward of the trained model. Returns the first batch."""
    if steps == 0:  # a trained model's forward only
        batch = task.batch(next(iter(task.train_data(seed)))).to(backend.device)
        with torch.no_grad(), watcher.forward(outputs=ranges):
            batch.run(model)
        watcher.collect()
        return batch
    optimizer = task.make_optimizer(model.parameters())
    batches = iter(task.train_data(seed))
    first_batch = None
    for step in range(steps):
        raw = next(batches, None)
        if raw is None:
            raise TaskError(
                f"task {task.name!r}: train_data ran out after {step} batches "
                f"(the profile needs {steps})"
            )
        batch = task.batch(raw).to(backend.device)
        first_batch = first_batch or batch
        optimizer.zero_grad(set_to_none=True)
        with watcher.forward(outputs=ranges, output_grads=ranges):
            loss = task.compute_loss(batch.run(model), batch.targets)
            loss.backward()
        watcher.parameter_gradients(ranges)
        watcher.collect()
        optimizer.step()
    assert first_batch is not None
    return first_batch


@contextlib.contextmanager
def _task_errors(task: Task) -> Iterator[None]:
    """A failure in the task's own code (model, data, loss, optimizer) as a TaskError."""
    try:
        yield
    except AutoprecError:
        raise
    except Exception as error:  # the task's own code: any error is its
        raise TaskError(
            f"task {task.name!r}: the fp32 pass failed ({type(error).__name__}: "
            f"{first_line(error)})"
        ) from None


def _check_dtypes(dtypes: Sequence[str] | None, backend: Backend) -> tuple[str, ...]:
    if dtypes is None:
        tested = tuple(d for d in LOW_PRECISION if backend.supports(d))
        if not tested:
            raise DeviceError(f"device {backend.name}: runs neither fp16 nor bf16")
        return tested
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    if not dtypes:
        raise AutoprecError("dtypes: expected fp16 and/or bf16, got none")
    for dtype in dtypes:
        if dtype not in LOW_PRECISION:
            raise AutoprecError(f"dtypes: expected fp16 and/or bf16, got {dtype!r}")
        if not backend.supports(dtype):
            raise DeviceError(f"dtype {dtype}: not supported by device {backend.name}")
    return tuple(dict.fromkeys(dtypes))


# -- watching the fp32 steps ---------------------------------------------------------------

# Layout of one counts vector: elements, nonzero elements, largest magnitude, then per
# dtype: above its maximum, nonzero below its smallest normal, below its smallest subnormal.
_ELEMENTS, _NONZERO, _MAX_ABS, _PER_DTYPE = 0, 1, 2, 3
# The watcher's kind for each kind this module reports.
_WATCHED = {"input": INPUT, "act": OUTPUT, "grad": OUTPUT_GRAD, "param_grad": PARAM_GRAD}


def _range_counts(tensor: torch.Tensor, limits: list[tuple[float, float, float]]) -> torch.Tensor:
    """One tensor's counts as a float64 vector, computed on its device without a sync."""
    magnitude = tensor.detach().float().abs()
    magnitude = torch.where(torch.isnan(magnitude), torch.inf, magnitude)  # NaN overflows too
    nonzero = magnitude != 0
    parts = [
        torch.full((), magnitude.numel(), device=magnitude.device),
        nonzero.sum(),
        magnitude.amax(),
    ]
    for largest, normal, subnormal in limits:
        parts += [
            (magnitude > largest).sum(),
            (nonzero & (magnitude < normal)).sum(),
            (nonzero & (magnitude < subnormal)).sum(),
        ]
    return torch.stack([part.double() for part in parts])


def _shares(watcher: Watcher, name: str, kind: str, index: int) -> dict[str, float]:
    """The dtype's overflow and underflow shares for one module and kind."""
    total = watcher.totals.get((name, _WATCHED[kind]))
    if total is None:
        return {
            f"{kind}_above_max": 0.0,
            f"{kind}_below_normal": 0.0,
            f"{kind}_below_subnormal": 0.0,
        }
    base = _PER_DTYPE + 3 * index
    elements, nonzero = max(total[_ELEMENTS], 1.0), max(total[_NONZERO], 1.0)
    return {
        f"{kind}_above_max": total[base] / elements,
        f"{kind}_below_normal": total[base + 1] / nonzero,
        f"{kind}_below_subnormal": total[base + 2] / nonzero,
    }


def _max_abs(watcher: Watcher, name: str, kind: str) -> float:
    total = watcher.totals.get((name, _WATCHED[kind]))
    return total[_MAX_ABS] if total is not None else 0.0


# -- the deviation test --------------------------------------------------------------------


def _forward(task: Task, model: nn.Module, batch: Batch, seed: int) -> tuple[torch.Tensor, float]:
    """The model's output (its logits, in fp32) and loss, with the same random draws
    (dropout) each time."""
    torch.manual_seed(seed)
    with torch.no_grad():
        outputs = batch.run(model)
        loss = float(task.compute_loss(outputs, batch.targets))
    logits = logits_of(outputs)
    if logits is None:
        raise TaskError(f"task {task.name!r}: the model's outputs hold no tensor to compare")
    return logits.float(), loss


def _deviation(
    task: Task,
    model: nn.Module,
    name: str,
    backend: Backend,
    dtype: str,
    batch: Batch,
    seed: int,
    reference: tuple[torch.Tensor, float],
    inputs: dict[str, Any],
) -> dict[str, Any]:
    """Loss and output deviation from fp32 with module ``name`` alone in ``dtype``, run
    through the regions a policy's plan installs (`_alone`). A layer of it that cannot
    run in the dtype there (a training step of it alone on ``inputs[name]``, or the
    forward) is an error, recorded for the space (module docstring)."""
    kind = backend.kind
    layers = _layers_within(model, name)
    known = next(
        ((n, r) for n, m in layers if (r := failing_dtypes(kind, m).get(dtype)) is not None),
        None,
    )
    if known is not None:
        layer, reason = known
        where = "" if layer == name else f"{layer} "
        return {"error": f"{where}cannot run in {dtype} on {kind} ({reason})"}
    alone = len(layers) == 1 and layers[0][0] == name  # a layer, not a module holding some
    if alone and name in inputs:
        module = layers[0][1]
        try:
            by_cast = lands_by_cast(kind, module, dtype)
            train_step(module, inputs[name], kind, dtype, _casts(kind, module, dtype), by_cast)
        except Exception as error:  # no training kernel for this dtype, as the plan runs it
            reason = f"{type(error).__name__}: {first_line(error, 200)}"
            record_failure(kind, type(module), dtype, reason)
            return {"error": reason}
    installed = Installed(model, _alone(model, name, dtype, kind), kind)
    try:
        outputs, loss = _forward(task, model, batch, seed)
    except Exception as error:  # an op without a kernel for this dtype, say
        reason = f"{type(error).__name__}: {first_line(error, 200)}"
        if alone:  # a layer's own failure
            record_failure(kind, type(layers[0][1]), dtype, reason)
        return {"error": reason}
    finally:
        installed.remove()
    reference_outputs, reference_loss = reference
    output_finite = bool(torch.isfinite(outputs).all())
    if not output_finite or not math.isfinite(loss):
        return {"nonfinite": "output" if not output_finite else "loss"}
    norm = float(torch.linalg.vector_norm(reference_outputs))
    return {
        "loss_deviation": abs(loss - reference_loss) / max(abs(reference_loss), 1e-12),
        "output_deviation": float(torch.linalg.vector_norm(outputs - reference_outputs))
        / max(norm, 1e-12),
    }


def _layers_within(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """The leaves with parameters at or below module ``name``: the layers a policy names."""
    within = parameterised_leaves(model.get_submodule(name))
    return [(f"{name}.{leaf}" if leaf else name, module) for leaf, module in within]


def _alone(model: nn.Module, name: str, dtype: str, kind: str) -> Plan:
    """The regions the plan of a policy would install that puts every layer of module
    ``name`` in ``dtype`` (by rules) and leaves the rest of the model in fp32: one region
    in ``dtype`` on the module, and on each of its layers whose inputs the plan casts
    (`casts_inputs`, the plan's own rule) a region that casts them, and their parameters
    too where the plan lands them by cast (`lands_by_cast`)."""
    module = model.get_submodule(name)
    layers = dict(_layers_within(model, name))
    by_cast = name in layers and lands_by_cast(kind, module, dtype)
    cast = name in layers and (by_cast or _casts(kind, module, dtype))
    regions = [RegionSpec(name, dtype, "fp32", cast, by_cast)]
    regions += [
        RegionSpec(layer, dtype, dtype, True, lands_by_cast(kind, leaf, dtype))
        for layer, leaf in layers.items()
        if layer != name and (_casts(kind, leaf, dtype) or lands_by_cast(kind, leaf, dtype))
    ]
    return Plan(kind, "fp32", tuple(regions), {})


def _casts(kind: str, module: nn.Module, dtype: str) -> bool:
    return casts_inputs(kind, module, dtype, uniform=False)  # a policy with rules


# -- combining -----------------------------------------------------------------------------


def _rank(
    watcher: Watcher, dtypes: tuple[str, ...], deviations: dict[str, dict[str, dict[str, Any]]]
) -> list[ModuleRisk]:
    """Every watched module's figures, riskiest first (ties as the module docstring says).
    ``deviations`` holds the modules that ran in the training steps."""
    entries = [
        _module_risk(name, module, watcher, dtypes, deviations.get(name, {}), name in deviations)
        for name, module in watcher.modules
    ]
    keys = []
    for order, (entry, passed_on) in enumerate(entries):
        below = [m for m, _ in entries if m.name.startswith(f"{entry.name}.")]
        riskiest = max(below, key=lambda m: m.risk, default=None)
        breaks = entry.risk >= 1  # non-finite or overflow
        contains = (
            riskiest is not None
            and entry.risk > 0
            and (riskiest.risk >= entry.risk or (breaks and riskiest.risk >= 1))
        )
        if contains and breaks and riskiest is not None:
            entry.reason += f" (contains {riskiest.name})"
        # What breaks ranks first, where it starts before what passes it on or holds it.
        first = (not breaks, breaks and passed_on, breaks and contains, -entry.risk)
        keys.append((*first, passed_on, contains, order))
    ranked = [entry for _, (entry, _) in sorted(zip(keys, entries, strict=True))]
    for rank, entry in enumerate(ranked, start=1):
        entry.rank = rank
    return ranked


def _module_risk(
    name: str,
    module: nn.Module,
    watcher: Watcher,
    dtypes: tuple[str, ...],
    deviations: dict[str, dict[str, Any]],
    ran: bool,
) -> tuple[ModuleRisk, bool]:
    """One module's figures, and whether its worst dtype's problem came in through its
    inputs (already past that dtype's maximum in fp32)."""
    stats: dict[str, dict[str, float]] = {}
    reasons: dict[str, str] = {}
    input_max_abs = _max_abs(watcher, name, "input")
    for index, dtype in enumerate(dtypes):
        shares = {}
        for kind in KINDS:
            shares.update(_shares(watcher, name, kind, index))
        stats[dtype], reasons[dtype] = _dtype_risk(dtype, shares, deviations.get(dtype, {}))
        if input_max_abs > dtype_limits(dtype)[0]:
            reasons[dtype] += f"; inputs already reach {_number(input_max_abs)}"
    errors = [reasons[d] for d in dtypes if "error" in deviations.get(d, {})]
    # A dtype the profile could not run the module in says nothing of its numerics.
    measured = [d for d in dtypes if "error" not in deviations.get(d, {})] or list(dtypes)
    worst = max(measured, key=lambda d: stats[d]["risk"])  # the first on ties
    risk = stats[worst]["risk"]
    reason = reasons[worst]
    if errors and len(errors) == len(dtypes):
        reason = "; ".join(errors)
    elif errors:
        reason += "; " + "; ".join(errors)
    entry = ModuleRisk(
        name=name,
        type=type(module).__name__,
        parameters=sum(p.numel() for p in module.parameters()),
        leaf=next(module.children(), None) is None,
        stats=stats,
        max_abs={kind: _max_abs(watcher, name, kind) for kind in ("input", *KINDS)},
        risk=risk,
        reason=reason if ran else "not run in the forward",
        error="; ".join(errors),
        headroom_bits=_headroom_bits(_max_abs(watcher, name, "act"), dtypes),
    )
    return entry, risk > 0 and input_max_abs > dtype_limits(worst)[0]


def _headroom_bits(max_abs: float, dtypes: tuple[str, ...] | list[str]) -> dict[str, float]:
    """Bits of each dtype's range left above ``max_abs`` (`autoprec.numerics.forecast`'s
    headroom now, for the fp32 steps the profile watched)."""
    if not (max_abs > 0 and math.isfinite(max_abs)):
        return {}
    return {d: math.log2(dtype_limits(d)[0] / max_abs) for d in dtypes}


def _dtype_risk(
    dtype: str, shares: dict[str, float], result: dict[str, Any]
) -> tuple[dict[str, float], str]:
    """One dtype's stats with its risk (formula in the module docstring), and the reason."""
    largest, normal, subnormal = dtype_limits(dtype)
    stats = dict(shares)
    stats["loss_deviation"] = result.get("loss_deviation", 0.0)
    stats["output_deviation"] = result.get("output_deviation", 0.0)
    if "error" in result:  # the profile's failure, not the module's numerics
        stats.update(nonfinite=0.0, risk=0.0)
        return stats, f"{dtype}: profile error, the forward failed ({result['error']})"
    failed = "nonfinite" in result
    stats["nonfinite"] = 1.0 if failed else 0.0
    parts = []
    if failed:
        parts.append(f"{result['nonfinite']} non-finite")
    overflow = 0.0
    for kind, label in KINDS.items():
        share = shares[f"{kind}_above_max"]
        overflow = max(overflow, share)
        if share > 0:
            parts.append(f"{_percent(share)} of {label} above {largest:.5g}")
    deviation = max(stats["loss_deviation"], stats["output_deviation"])
    flushed = max(shares[f"{kind}_below_subnormal"] for kind in KINDS)
    below_normal = max(shares[f"{kind}_below_normal"] for kind in KINDS)
    if failed:
        risk = math.inf
    elif overflow > 0:
        risk = 1.0 + overflow
    else:
        x = deviation + flushed + SUBNORMAL_WEIGHT * below_normal
        risk = x / (1.0 + x)
        if deviation > 0:
            parts.append(
                f"loss off by {_percent(stats['loss_deviation'])}, output by "
                f"{_percent(stats['output_deviation'])}"
            )
    if not failed and flushed > 0:
        kind = max(KINDS, key=lambda k: shares[f"{k}_below_subnormal"])
        parts.append(f"{_percent(flushed)} of nonzero {KINDS[kind]} below {subnormal:.3g} (flush)")
    elif not failed and below_normal >= 0.01:
        kind = max(KINDS, key=lambda k: shares[f"{k}_below_normal"])
        parts.append(f"{_percent(below_normal)} of nonzero {KINDS[kind]} below {normal:.3g}")
    stats["risk"] = risk
    return stats, f"{dtype}: " + "; ".join(parts) if parts else f"{dtype}: no deviation"


def _percent(share: float) -> str:
    return f"{100 * share:.3g}%"


def _number(value: float) -> str:
    return str(value) if not math.isfinite(value) else f"{value:.3g}"


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan"
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> float:
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)
