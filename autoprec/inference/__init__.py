"""Inference precision: convert a trained fp32 model per layer for serving, and measure it
against the fp32 model (agreement, latency, throughput, memory)."""

from autoprec.devices import INFERENCE_DTYPES
from autoprec.inference.convert import (
    INT8_METHODS,
    convert,
    default_int8_method,
    int8_available,
    int8_unavailable_reason,
    tied_leaves,
    weight_bytes,
    weight_dtypes,
)
from autoprec.inference.load import load_inference_model
from autoprec.inference.measure import (
    InferenceResult,
    Reference,
    latency_ms,
    measure_inference,
    peak_memory_bytes,
    timing_batch,
)

__all__ = [
    "INFERENCE_DTYPES",
    "INT8_METHODS",
    "InferenceResult",
    "Reference",
    "convert",
    "default_int8_method",
    "int8_available",
    "int8_unavailable_reason",
    "latency_ms",
    "load_inference_model",
    "measure_inference",
    "peak_memory_bytes",
    "tied_leaves",
    "timing_batch",
    "weight_bytes",
    "weight_dtypes",
]
