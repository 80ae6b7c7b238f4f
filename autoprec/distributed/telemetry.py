"""One trial's telemetry from the telemetry of its ranks (`autoprec.numerics.telemetry`).

Each rank counts what it saw: the activations of its own slice of the batch, and the
gradients it holds. Under DDP those gradients are the same on every rank (all-reduced), so
they are counted once; under FSDP2 each rank holds its shard of them, so the shards' counts
add up to the whole gradient's. Activation counts add up over the ranks' slices, and the
largest magnitude is the largest rank's.
"""

from __future__ import annotations

from typing import Any

_GRAD_COUNTS = ("grad_elements", "grad_nonzero", "grad_zero", "grad_flushed", "grad_nonfinite")
_ACT_COUNTS = ("act_elements", "act_nonfinite", "act_at_fp16_max", "act_overflow_origin")


def reduce_telemetry(reports: list[dict[str, Any]], parallel: str) -> dict[str, Any]:
    """The ranks' ``GradientMonitor.report()`` dicts (in rank order) made one, as a single
    device's report reads: per-layer counts combined, ratios recomputed, warnings of all
    ranks (once each)."""
    if not reports:
        return {}
    first = reports[0]
    sharded = parallel == "fsdp2"
    layers: dict[str, dict[str, Any]] = {}
    for rank, report in enumerate(reports):
        for layer in report.get("layers", []):
            into = layers.setdefault(layer["name"], {**layer, **dict.fromkeys(_ACT_COUNTS, 0)})
            for key in _ACT_COUNTS:
                into[key] += layer.get(key, 0)
            into["act_max_abs"] = max(into.get("act_max_abs", 0.0), layer.get("act_max_abs", 0.0))
            if sharded and rank > 0:
                for key in _GRAD_COUNTS:
                    into[key] += layer.get(key, 0)
    for layer in layers.values():
        nonzero, elements = layer.get("grad_nonzero", 0), layer.get("grad_elements", 0)
        layer["grad_underflow_ratio"] = layer.get("grad_flushed", 0) / nonzero if nonzero else 0.0
        layer["grad_zero_share"] = layer.get("grad_zero", 0) / elements if elements else 0.0
    ordered = sorted(
        layers.values(),
        key=lambda s: (
            s.get("act_overflow_origin", 0),
            s.get("act_nonfinite", 0) + s.get("act_at_fp16_max", 0),
            s["grad_underflow_ratio"],
        ),
        reverse=True,
    )
    nonzero = sum(layer.get("grad_nonzero", 0) for layer in ordered)
    flushed = sum(layer.get("grad_flushed", 0) for layer in ordered)
    warnings = list(dict.fromkeys(w for report in reports for w in report.get("warnings", [])))
    return {
        **first,
        "grad_underflow_ratio": flushed / nonzero if nonzero else 0.0,
        "layers": ordered,
        "warnings": warnings,
    }
