"""One serving trial: convert the fp32 model under a policy and measure it.

Pure, as the training trial is: no Optuna, no MLflow. The fp32 model is converted into a
copy (it is never trained, never changed); a policy the model cannot be converted to, or
that breaks it, comes back ``failed`` with the reason."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from autoprec.devices import Backend, get_backend
from autoprec.errors import AutoprecError, first_line
from autoprec.inference.convert import convert, convert_policy
from autoprec.inference.measure import (
    TIMED_CALLS,
    WARMUP_CALLS,
    InferenceResult,
    Reference,
    latency_ms,
    measure_inference,
)
from autoprec.plan import low_precision_share
from autoprec.policy import Policy
from autoprec.tasks import Task


def run_inference_trial(
    task: Task,
    policy: Policy,
    model: nn.Module,
    backend: Backend,
    reference: Reference,
    batch_sizes: Sequence[int],
    int8: str | None = None,
    timed_calls: int = TIMED_CALLS,
    warmup_calls: int = WARMUP_CALLS,
) -> InferenceResult:
    """Convert ``model`` (fp32, trained) under ``policy``, score it against ``reference``
    and time it at each of ``batch_sizes`` (the first is the scenario's); never raises for
    a problem of the policy."""
    started = time.perf_counter()
    previous = backend.set_switches(policy.tf32, policy.hf32)
    try:
        layer_dtypes = policy.resolve_inference(model)
        converted = convert(model, layer_dtypes, backend, int8 or policy.int8_method)
        result = measure_inference(
            task, converted, reference, backend, batch_sizes[0], timed_calls, warmup_calls
        )
        if result.state == "complete":
            result.latency_by_batch_ms[str(batch_sizes[0])] = float(result.latency_p50_ms or 0)
            for size in batch_sizes[1:]:
                result.latency_by_batch_ms[str(size)] = latency_ms(
                    converted, task, backend, size, timed_calls, warmup_calls
                )
        result.low_precision_share = low_precision_share(model, layer_dtypes)
    except AutoprecError as error:  # a policy this model cannot be served in
        result = InferenceResult("failed", first_line(error, 500))
    except Exception as error:  # any failure of a trial is its result
        result = InferenceResult("failed", f"{type(error).__name__}: {first_line(error, 500)}")
    finally:
        backend.restore_switches(previous)
    result.batch_size = batch_sizes[0]
    result.run_time_s = time.perf_counter() - started
    return result


def load_inference_model(
    model: nn.Module,
    policy: Policy,
    device: str | torch.device | Backend | None = None,
    int8: str | None = None,
) -> nn.Module:
    """``model`` (fp32, trained) converted for serving as ``policy`` says, in one call: a
    copy whose layers hold their weights in the policy's dtypes (int8 by ``int8``, default:
    the method the policy records, else the device's), inputs cast at the boundaries,
    outputs in fp32. It computes what the serving search's trial of that policy computed.

    A policy's TF32 (CUDA) or HF32 (Ascend) switch is process-wide, so it is set here for
    the whole process, as the trial had it; a policy without one leaves the device as is."""
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else "cpu"
    backend = get_backend(device)
    backend.set_switches(policy.tf32, policy.hf32)
    return convert_policy(model, policy, backend, int8)
