"""Serving: convert a trained fp32 model per layer (`conversion`, with the int8 and fp8
methods of `quantizers` and `fp8`), and measure it against the fp32 model (agreement,
latency, throughput, memory); the served model as an MLflow model."""

import importlib
from typing import Any

# Imported on first use (PEP 562), so that autoprec.serving.scenarios, which the CLI's
# help reads, is importable without torch.
_WHERE = {
    "SERVING_DTYPES": "autoprec.dtypes",
    **dict.fromkeys(
        (
            "INT8_METHODS",
            "convert",
            "default_int8_method",
            "int8_available",
            "int8_unavailable_reason",
            "tied_leaves",
            "weight_bytes",
            "weight_dtypes",
        ),
        "autoprec.serving.conversion",
    ),
    "load_served_model": "autoprec.serving.load",
    "load_inference_model": "autoprec.serving.load",  # its earlier name
    **dict.fromkeys(
        (
            "ServingResult",
            "Reference",
            "latency_ms",
            "measure_serving",
            "peak_memory_bytes",
            "timing_batch",
        ),
        "autoprec.serving.measure",
    ),
}

__all__ = [
    "INT8_METHODS",
    "SERVING_DTYPES",
    "Reference",
    "ServingResult",
    "convert",
    "default_int8_method",
    "int8_available",
    "int8_unavailable_reason",
    "latency_ms",
    "load_served_model",
    "measure_serving",
    "peak_memory_bytes",
    "tied_leaves",
    "timing_batch",
    "weight_bytes",
    "weight_dtypes",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
