"""The quantizers: every way autoprec serves a layer in a quantized dtype, in one registry.

A serving policy names its method (``quantization: {int8: torchao-dynamic}``), the search
measures with it, and the conversion (`autoprec.serving.conversion`), the ``torchao``
export and the MLflow model all look it up here, so what is served is what was measured.
Each entry says where it runs, how it quantizes the named layers, which torchao config a
torchao workflow writes for it, whether ``torch.export`` can trace its weights, and what a
saved model needs installed. The fp8 serving methods are entries too (``dtype="fp8"``:
torchao's float8 weight-only and dynamic configs; where they run: `autoprec.serving.fp8`).

The int8 methods and their defaults were chosen by measuring (benchmarks/bench_int8.py and
benchmarks/README.md): torch's own dynamic quantization on the CPU; on CUDA torchao is the
only int8 with kernels there, weight-only its choice for memory-bound serving (not measured
here: no GPU was lent).
"""

from __future__ import annotations

from autoprec.errors import PolicyError
from autoprec.formats import all_formats
from autoprec.formats.int8 import INT8
from autoprec.formats.methods import Quantizer, import_torchao

__all__ = [
    "DEFAULT_INT8_METHOD",
    "INT8_METHODS",
    "QUANTIZERS",
    "Quantizer",
    "default_int8_method",
    "import_torchao",
    "int8_available",
    "int8_unavailable_reason",
    "quantizer",
]


# Every serving method of every quantizing format, by name.
QUANTIZERS: dict[str, Quantizer] = {m.name: m for f in all_formats() for m in f.methods}
INT8_METHODS: tuple[str, ...] = tuple(m.name for m in INT8.methods)
# The method a device kind serves int8 with when none is named.
DEFAULT_INT8_METHOD = INT8.default_methods


def quantizer(method: str) -> Quantizer:
    """The registry's entry for ``method``; PolicyError naming the known ones otherwise."""
    if method not in QUANTIZERS:
        raise PolicyError(f"int8: unknown method {method!r} (expected {', '.join(INT8_METHODS)})")
    return QUANTIZERS[method]


def default_int8_method(device_kind: str) -> str | None:
    """The int8 method used on a device kind when none is named; None where int8 has no
    kernels."""
    return DEFAULT_INT8_METHOD.get(device_kind)


def int8_unavailable_reason(device_kind: str, method: str | None = None) -> str | None:
    """Why int8 cannot run on this device kind with this method (default: the device's),
    in one line; None when it can. Lets a search refuse int8 before any trial runs."""
    method = method or default_int8_method(device_kind)
    if method is None:
        return f"int8: no int8 kernels for {device_kind} in torch or torchao"
    if method not in QUANTIZERS:
        return f"int8: unknown method {method!r} (expected {', '.join(INT8_METHODS)})"
    return QUANTIZERS[method].unavailable_reason(device_kind)


def int8_available(device_kind: str, method: str | None = None) -> bool:
    """Whether int8 layers can run on this device kind (see `int8_unavailable_reason`)."""
    return int8_unavailable_reason(device_kind, method) is None
