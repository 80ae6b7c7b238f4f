"""Inference precision: convert a trained fp32 model per layer for serving."""

from autoprec.inference.convert import (
    INFERENCE_DTYPES,
    INT8_METHODS,
    convert,
    default_int8_method,
    int8_available,
    int8_capable,
    int8_unavailable_reason,
    weight_bytes,
    weight_dtypes,
)

__all__ = [
    "INFERENCE_DTYPES",
    "INT8_METHODS",
    "convert",
    "default_int8_method",
    "int8_available",
    "int8_capable",
    "int8_unavailable_reason",
    "weight_bytes",
    "weight_dtypes",
]
