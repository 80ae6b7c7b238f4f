"""Measuring a converted model against the fp32 model on the task's validation data.

The fp32 model's outputs are computed once (`Reference.of`); each converted model is then
scored on the same batches: the task's metric, top-1 agreement with fp32 and the relative
deviation of its outputs, latency and throughput at a batch size drawn from the
validation data, and peak memory. Pure, as a training trial is: a measurement never raises
for a problem of the policy (non-finite outputs, a missing kernel): it comes back
``failed`` with the reason. Bad input to autoprec raises AutoprecError.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from autoprec._util.structures import cast_floats, map_tensors, tensors
from autoprec.devices import Backend
from autoprec.errors import AutoprecError, TaskError, first_line
from autoprec.numerics.telemetry import first_nonfinite_layer
from autoprec.serving.conversion import convert, weight_bytes
from autoprec.tasks import Task
from autoprec.tasks.base import IGNORE_INDEX, Batch, logits_of
from autoprec.trials.base import Feasibility, Measured, TrialState

_MB = 2.0**20
TIMED_CALLS = 20
WARMUP_CALLS = 3


@dataclass
class ServingResult(Measured):
    """What one measurement of a converted model found.

    - ``accuracy``: the task's metric over the validation data, weighted by batch size;
      ``accuracy_drop``: the fp32 model's accuracy minus this one (positive: worse).
    - ``top1_agreement``: the share of top-1 predictions (one per sample, or one per scored
      position for per-token outputs) equal to the fp32 model's; 1.0 means it agrees with
      fp32 on every validation sample.
    - ``max_rel_deviation`` / ``mean_rel_deviation``: over validation samples, of
      ``||y - y_ref|| / ||y_ref||``, the L2 norms taken over each sample's logits (all
      positions and classes of it), ``y_ref`` the fp32 model's.
    - ``latency_p50_ms`` / ``latency_p90_ms``: per forward at ``batch_size`` samples;
      ``throughput_sps``: samples per second over the timed forwards.
    - ``peak_memory_mb``: weight bytes, inputs and the peak of activations over one
      forward: the allocator's on CUDA and NPU; on the CPU an estimate
      (``peak_memory_is_estimate``, see `LiveActivations`).
    - ``weight_mb``: parameters and buffers, quantized weights as what they hold.
    """

    state: TrialState  # complete or failed
    reason: str | None = None
    accuracy: float | None = None
    accuracy_drop: float | None = None
    top1_agreement: float | None = None
    max_rel_deviation: float | None = None
    mean_rel_deviation: float | None = None
    latency_p50_ms: float | None = None
    latency_p90_ms: float | None = None
    throughput_sps: float | None = None
    peak_memory_mb: float | None = None
    peak_memory_is_estimate: bool = False
    weight_mb: float | None = None
    low_precision_share: float = 0.0  # share of parameters served below fp32
    batch_size: int = 0
    samples: int = 0
    run_time_s: float = 0.0
    # Median latency at every batch size measured ("1", "8", "64"), the main one among them.
    latency_by_batch_ms: dict[str, float] = field(default_factory=dict)
    # The dtypes its figures ran emulated (``["fp8"]`` for fp8 layers served on the CPU
    # under --emulate fp8: `autoprec.precision.emulation`); none: real.
    emulated: list[str] = field(default_factory=list)

    METRICS: ClassVar[tuple[str, ...]] = (
        "accuracy",
        "accuracy_drop",
        "top1_agreement",
        "max_rel_deviation",
        "mean_rel_deviation",
        "latency_p50_ms",
        "latency_p90_ms",
        "throughput_sps",
        "peak_memory_mb",
        "weight_mb",
        "low_precision_share",
        "batch_size",
        "samples",
        "run_time_s",
    )

    TIME_METRIC = "latency_p50_ms"  # the median latency at the scenario's batch
    TIME_LABEL = "latency"
    MODE = "serving"

    def extra_metrics(self) -> dict[str, float]:
        """The median latency at every batch size measured."""
        return {f"latency_p50_ms.batch_{size}": v for size, v in self.latency_by_batch_ms.items()}

    def entry_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"switches": {}, "latency_by_batch_ms": self.latency_by_batch_ms}
        if self.emulated:  # labelled as training's are: no fp8 device's latency
            fields["execution"] = {"emulated": list(self.emulated)}
        return fields

    def within(self, feasibility: Feasibility) -> bool:
        """Agreement with fp32's top-1 predictions and deviation of the outputs within
        the scenario's bounds, where it sets them."""
        agreement, deviation = self.top1_agreement, self.max_rel_deviation
        least, most = feasibility.min_top1_agreement, feasibility.max_rel_deviation
        if least is not None and (agreement is None or agreement < least - 1e-12):
            return False
        return most is None or (deviation is not None and deviation <= most)


@dataclass(frozen=True)
class Reference:
    """The fp32 model's logits on each validation batch (kept on the CPU, so that a large
    validation set costs no device memory) and its accuracy: computed once per study,
    compared with every converted model."""

    logits: tuple[torch.Tensor, ...]
    accuracy: float
    samples: int

    @classmethod
    def of(cls, task: Task, model: nn.Module, backend: Backend) -> Reference:
        """Run an fp32 copy of ``model`` (eval mode; the model itself is left as it is)
        over the validation data."""
        with backend.selected():
            fp32 = convert(model, {}, backend)
            accuracy, logits, samples, _ = _validate(task, fp32, backend)
        if any(not bool(torch.isfinite(t).all()) for t in logits):
            raise TaskError(f"task {task.name!r}: the fp32 model's outputs are not finite")
        return cls(tuple(logits), accuracy, samples)


def measure_serving(
    task: Task,
    model: nn.Module,
    reference: Reference,
    backend: Backend,
    batch_size: int,
    timed_calls: int = TIMED_CALLS,
    warmup_calls: int = WARMUP_CALLS,
) -> ServingResult:
    """Score a converted ``model`` (see `convert`) against ``reference`` and time it at
    ``batch_size``; never raises for a problem of the model's precision (bad input to
    autoprec still raises AutoprecError)."""
    for name, value, least in (
        ("batch_size", batch_size, 1),
        ("timed_calls", timed_calls, 2),
        ("warmup_calls", warmup_calls, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise AutoprecError(f"{name}: must be an integer of at least {least}, got {value!r}")
    started = time.perf_counter()
    try:
        with backend.selected():
            batch = timing_batch(task, batch_size, backend)
            result = _measure(task, model, reference, backend)
            if result.state == TrialState.COMPLETE:
                _time(result, model, batch, backend, timed_calls, warmup_calls)
    except AutoprecError:
        raise
    except torch.OutOfMemoryError as error:
        result = ServingResult(TrialState.FAILED, f"out of memory: {first_line(error)}")
    except Exception as error:  # any failure of a trial is its result
        result = ServingResult(
            TrialState.FAILED, f"{type(error).__name__}: {first_line(error, 500)}"
        )
    finally:
        backend.empty_cache()
    result.batch_size = batch_size
    result.run_time_s = time.perf_counter() - started
    return result


def _measure(task: Task, model: nn.Module, reference: Reference, backend: Backend) -> ServingResult:
    """Accuracy and agreement with fp32 over the validation data."""
    accuracy, logits, samples, masks = _validate(task, model, backend)
    if len(logits) != len(reference.logits) or samples != reference.samples:
        raise AutoprecError(
            f"task {task.name!r}: the reference holds {len(reference.logits)} batches of "
            f"{reference.samples} samples; val_data gave {len(logits)} of {samples}"
        )
    for index, output in enumerate(logits):
        if not bool(torch.isfinite(output).all()):
            batch = task.batch(list(task.val_data())[index]).to(backend.device)
            layer = first_nonfinite_layer(model, partial(batch.run, model))
            where = f"; first non-finite output: {layer}" if layer else ""
            return ServingResult(
                TrialState.FAILED, f"non-finite outputs on validation batch {index}{where}"
            )
    if not math.isfinite(accuracy):
        return ServingResult(TrialState.FAILED, f"the task's metric returned {accuracy}")
    agree, scored, deviations = _agreement(task, logits, masks, reference.logits)
    return ServingResult(
        TrialState.COMPLETE,
        accuracy=accuracy,
        accuracy_drop=reference.accuracy - accuracy,
        top1_agreement=agree / max(scored, 1),
        max_rel_deviation=max(deviations),
        mean_rel_deviation=statistics.fmean(deviations),
        weight_mb=weight_bytes(model) / _MB,
        samples=samples,
    )


def _validate(
    task: Task, model: nn.Module, backend: Backend
) -> tuple[float, list[torch.Tensor], int, list[torch.Tensor]]:
    """The task's metric over the validation data (weighted by batch size); the logits of
    each batch in fp32 on the CPU; the samples; and which top-1 predictions the metric
    scores in each batch (`_scored`)."""
    total, count, logits, masks = 0.0, 0, [], []
    with torch.inference_mode():
        for raw in task.val_data():
            batch = task.batch(raw).to(backend.device)
            outputs = cast_floats(batch.run(model), torch.float32)
            total += task.score(outputs, batch.targets) * batch.size
            count += batch.size
            found = logits_of(outputs)
            if found is None:
                raise TaskError(f"task {task.name!r}: the model's outputs hold no logits")
            logits.append(found.float().cpu())
            masks.append(_scored(task, found.shape[:-1], batch.targets))
    if count == 0:
        raise TaskError(f"task {task.name!r}: val_data yielded no batches")
    return total / count, logits, count, masks


def _scored(task: Task, shape: torch.Size, targets: Any) -> torch.Tensor:
    """Which top-1 predictions count, as the metric counts them: all but positions whose
    target is -100, and for next-token accuracy all but each sequence's last position."""
    mask = torch.ones(shape, dtype=torch.bool)
    if task.metric == "next_token_accuracy" and len(shape) > 1:
        mask[..., -1] = False
        if isinstance(targets, torch.Tensor) and targets.shape == shape:
            mask[..., :-1] = targets[..., 1:].cpu() != IGNORE_INDEX
    elif isinstance(targets, torch.Tensor) and targets.shape == shape:
        mask = targets.cpu() != IGNORE_INDEX
    return mask


def _agreement(
    task: Task,
    logits: list[torch.Tensor],
    masks: list[torch.Tensor],
    reference: Sequence[torch.Tensor],
) -> tuple[int, int, list[float]]:
    """Top-1 predictions equal to fp32's, predictions scored, and each sample's relative
    deviation from fp32's logits."""
    agree = scored = 0
    deviations: list[float] = []
    for output, mask, expected in zip(logits, masks, reference, strict=True):
        if output.shape != expected.shape:
            raise TaskError(
                f"task {task.name!r}: outputs of shape {list(output.shape)} against fp32's "
                f"{list(expected.shape)}"
            )
        same = output.argmax(dim=-1) == expected.argmax(dim=-1)
        agree += int((same & mask).sum())
        scored += int(mask.sum())
        flat, flat_expected = output.flatten(1), expected.flatten(1)
        norms = flat_expected.norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        deviations += ((flat - flat_expected).norm(dim=1) / norms).tolist()
    return agree, scored, deviations


def timing_batch(task: Task, batch_size: int, backend: Backend) -> Batch:
    """A batch of exactly ``batch_size`` samples from the validation data, on the device:
    samples of successive batches joined (and repeated when there are fewer). Needs
    batch-first inputs of one shape per sample throughout."""
    first = None
    parts: list[list[torch.Tensor]] = []
    have = 0
    for raw in task.val_data():
        batch = task.batch(raw)
        inputs = _flat((batch.args, batch.kwargs))
        size = batch.size
        if first is None:
            first = batch
        if any(t.dim() == 0 or t.shape[0] != size for t in inputs):
            raise TaskError(
                f"task {task.name!r}: cannot form a batch of {batch_size}: its inputs are not "
                "all batch-first"
            )
        if parts and [t.shape[1:] for t in inputs] != [t.shape[1:] for t in parts[0]]:
            continue  # another sequence length: samples of one shape only
        parts.append(inputs)
        have += size
        if have >= batch_size:
            break
    if first is None:
        raise TaskError(f"task {task.name!r}: val_data yielded no batches")
    joined = [torch.cat(column) for column in zip(*parts, strict=True)]
    repeats = math.ceil(batch_size / have)
    joined = [t.repeat(repeats, *([1] * (t.dim() - 1)))[:batch_size].clone() for t in joined]
    column = iter(joined)
    args, kwargs = map_tensors(lambda _: next(column), (first.args, first.kwargs))
    return Batch(args, kwargs, None, first.raw_inputs).to(backend.device)


MAX_TIMING_INPUT_BYTES = 1 << 30  # inputs of the largest batch timed, before activations


def check_batch_sizes(task: Task, sizes: tuple[int, ...]) -> None:
    """Refuse, before anything runs, batch sizes whose inputs alone (validation samples
    repeated to fill them) would take more than `MAX_TIMING_INPUT_BYTES`."""
    first = next(iter(task.val_data()), None)
    if first is None:
        raise TaskError(f"task {task.name!r}: val_data yielded no batches")
    batch = task.batch(first)
    inputs = _flat((batch.args, batch.kwargs))
    per_sample = sum(t.element_size() * t[0].numel() for t in inputs if t.dim() > 0)
    largest = max(sizes)
    if per_sample * largest > MAX_TIMING_INPUT_BYTES:
        raise TaskError(
            f"--batch-sizes: a batch of {largest} takes {per_sample * largest / 2**30:.1f} GiB "
            f"of inputs alone ({per_sample} bytes per sample of task {task.name!r}); at most "
            f"{MAX_TIMING_INPUT_BYTES // 2**30} GiB"
        )


def _flat(value: Any) -> list[torch.Tensor]:
    """The tensors of a structure in the order `map_tensors` visits them."""
    found: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(keep, value)
    return found


def _time(
    result: ServingResult,
    model: nn.Module,
    batch: Batch,
    backend: Backend,
    timed_calls: int,
    warmup_calls: int,
) -> None:
    """Latency percentiles, throughput and peak memory at the batch's size."""
    times_s = latencies_s(model, batch, backend, timed_calls, warmup_calls)
    result.latency_p50_ms = statistics.median(times_s) * 1000.0
    result.latency_p90_ms = _percentile(times_s, 0.9) * 1000.0
    result.throughput_sps = batch.size * len(times_s) / sum(times_s)
    peak_bytes, result.peak_memory_is_estimate = peak_memory_bytes(model, batch, backend)
    result.peak_memory_mb = peak_bytes / _MB


def latency_ms(
    model: nn.Module,
    task: Task,
    backend: Backend,
    batch_size: int,
    timed_calls: int = TIMED_CALLS,
    warmup_calls: int = WARMUP_CALLS,
) -> float:
    """Median latency (ms) of one forward at ``batch_size`` samples of the validation data."""
    with backend.selected():
        batch = timing_batch(task, batch_size, backend)
        return (
            statistics.median(latencies_s(model, batch, backend, timed_calls, warmup_calls)) * 1e3
        )


def latencies_s(
    model: nn.Module, batch: Batch, backend: Backend, calls: int, warmup_calls: int = 0
) -> list[float]:
    """Seconds per forward, each between device syncs, after untimed warm-up calls."""
    times_s = []
    with torch.inference_mode():
        for _ in range(warmup_calls):
            batch.run(model)
        for _ in range(calls):
            started_s = backend.now_s()
            batch.run(model)
            times_s.append(backend.now_s() - started_s)
    return times_s


def _percentile(values: list[float], share: float) -> float:
    """Linear interpolation between the closest ranks."""
    ordered = sorted(values)
    position = share * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def peak_memory_bytes(model: nn.Module, batch: Batch, backend: Backend) -> tuple[int, bool]:
    """Peak memory of one forward on ``batch``, and whether it is an estimate: the model's
    `weight_bytes` plus its inputs plus the activations' peak. On CUDA and NPU the
    activations' peak is the allocator's, above what was allocated before the forward (so
    that other models held on the device are left out); on the CPU, which keeps no such
    statistics, it is estimated (see `LiveActivations`)."""
    weights = weight_bytes(model)
    if backend.kind != "cpu":
        inputs = sum(_storage_bytes(tensors((batch.args, batch.kwargs))).values())
        backend.synchronize()
        backend.reset_peak_memory()
        before = backend.max_memory_allocated_bytes()
        with torch.inference_mode():
            batch.run(model)
        backend.synchronize()
        return weights + inputs + backend.max_memory_allocated_bytes() - before, False
    with torch.inference_mode(), LiveActivations(model, (batch.args, batch.kwargs)) as meter:
        batch.run(model)
    return weights + meter.peak_bytes, True


def _storage_bytes(found: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage behind the tensors, keyed by its address."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}


class LiveActivations(TorchFunctionMode):
    """The peak bytes of activations alive at once during a forward, on the CPU.

    Counts the inputs and every tensor a torch function returns in the model's Python code
    (module forwards, functional calls, the conversion's casts), each storage once, from
    when it is returned until it is freed (a weak reference to its storage). Storages of
    the weights are left out, views of them included. Not counted: scratch memory inside
    a kernel (a quantized Linear's int8 copy of its input, attention's score matrix in
    fused kernels) and the allocator's own overhead, so the figure is a lower bound."""

    def __init__(self, model: nn.Module, inputs: Any) -> None:
        super().__init__()
        self.weights = {
            t.untyped_storage().data_ptr()
            for t in (*model.parameters(), *model.buffers())
            if type(t) in (torch.Tensor, nn.Parameter)
        }
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak_bytes = 0
        self._track(inputs)

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        self._track(result)
        return result

    def _track(self, value: Any) -> None:
        for tensor in tensors(value):
            if type(tensor) is not torch.Tensor or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            known = self.live.get(address)
            if address in self.weights or (known is not None and not known[0].expired()):
                continue
            self.live[address] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {a: entry for a, entry in self.live.items() if not entry[0].expired()}
        self.peak_bytes = max(self.peak_bytes, sum(n for _, n in self.live.values()))
