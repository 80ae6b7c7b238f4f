"""fp8 for serving: which float8 method a device serves Linear layers with, and which
layers can take it.

A serving policy's fp8 layers hold their weights in float8 (torchao's ``Float8Tensor``:
e4m3 values and a per-row scale), quantized by a method of the one registry of quantizers
(`autoprec.serving.quantizers`, ``dtype="fp8"``), the same way int8 layers are:

- ``torchao-fp8-weight-only`` (``Float8WeightOnlyConfig``): the weights are fp8 and are
  dequantized for a matmul in the activations' dtype. It runs on the CPU (torch 2.13,
  torchao 0.18), so tests can serve real fp8 weights there.
- ``torchao-fp8-dynamic`` and ``torchao-fp8-dynamic-rowwise``
  (``Float8DynamicActivationFloat8WeightConfig``, per-tensor or per-row scales): the
  activations are quantized too and the matmul is ``torch._scaled_mm``'s. torchao refuses
  them below CUDA compute capability 8.9 (an AssertionError on the CPU), so they are
  offered only there.

Device truth, as for fp8 training (`autoprec.devices`): CUDA needs compute capability
8.9 or later (H100, H200, L40, B200); Ascend 910 parts have no fp8 and are refused in one
line; on the CPU a serving *search* offers fp8 only with ``--emulate fp8`` (its latencies
are not an fp8 device's, and the summary's settings say emulated). Converting a policy that
already names fp8 weight-only layers (`autoprec.load_served_model`, the exports, the
MLflow model) runs on the CPU as torchao runs it: the weights really are fp8 there.

Never run on a GPU here: the dynamic methods were only seen refused on the CPU.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from autoprec.devices import NPU_NO_FP8, Backend
from autoprec.formats.fp8 import FP8
from autoprec.serving.quantizers import QUANTIZERS

_FP8 = FP8()
# The fp8 serving methods, in the format's order.
FP8_SERVING_METHODS: tuple[str, ...] = tuple(m.name for m in _FP8.methods)
# The method a device kind serves fp8 with when none is named.
DEFAULT_FP8_METHOD = _FP8.default_methods


def is_fp8_serving_method(method: object) -> bool:
    """Whether ``method`` names an fp8 serving method (not a training recipe)."""
    return method in FP8_SERVING_METHODS


def default_fp8_method(device_kind: str) -> str | None:
    """The fp8 method a device kind serves with when none is named; None where none runs."""
    return DEFAULT_FP8_METHOD.get(device_kind)


def fp8_serving_refusal(backend: Backend, method: str | None = None) -> str | None:
    """Why ``method`` (default: the device's) cannot serve fp8 layers on ``backend``, in one
    line; None when it can. The CPU runs weight-only without asking: see `search_refusal`
    for what a search needs besides."""
    method = method or default_fp8_method(backend.kind)
    if backend.kind == "npu":
        return NPU_NO_FP8
    if method is None:
        return f"fp8: no fp8 serving method for {backend.kind}"
    if method not in FP8_SERVING_METHODS:
        return f"fp8: unknown serving method {method!r} (expected {', '.join(FP8_SERVING_METHODS)})"
    if importlib.util.find_spec("torchao") is None:
        return f"fp8 {method}: torchao is not installed (pip install torchao)"
    if backend.kind == "cuda":
        refusal = backend.fp8_refusal()
        if refusal is not None:
            return f"fp8 {method}: {refusal}"
    return QUANTIZERS[method].unavailable_reason(backend.kind)


def search_refusal(backend: Backend, method: str | None = None) -> str | None:
    """Why a serving search cannot offer fp8 by ``method`` on ``backend`` (None: it can):
    `fp8_serving_refusal`, and on the CPU the opt-in, since its figures are no fp8
    device's."""
    reason = fp8_serving_refusal(backend, method)
    if reason is None and backend.kind == "cpu" and backend.fp8_refusal() is not None:
        return (
            "fp8 serving on the CPU is emulated (torchao's float8 weights and outputs, no fp8 "
            "device's latency); opt in with --emulate fp8 (SearchConfig(emulate=['fp8']))"
        )
    return reason


def fp8_layer_refusal(module: nn.Module, method: str | None) -> str | None:
    """Why ``module`` cannot be served in fp8 by ``method`` (None: it can; the format's
    `autoprec.formats.fp8.FP8.serving_layer_refusal`)."""
    return _FP8.serving_layer_refusal(module, None if method is None else QUANTIZERS[method])
