"""Deployment scenarios: what a serving search optimises, at which batch size, and how
close to fp32 a policy must stay.

The rule of thumb ("server: FP16, edge: FP16, medical: FP32, batch: FP16") is a guess
about the device; a scenario only states the goal, and the search measures which
precision meets it on the device at hand. Every preset value can be overridden
(``--batch-size``, ``--prefer``, ``--accuracy-tolerance``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoprec.errors import AutoprecError


@dataclass(frozen=True)
class Scenario:
    """``batch_size`` served at, the preference (``latency``, ``memory`` or
    ``throughput``, all at that batch size), the accuracy tolerance against fp32, and, for
    accuracy-critical serving, the top-1 agreement with fp32 required on every
    validation sample and a bound on the relative output deviation."""

    name: str
    batch_size: int
    prefer: str
    accuracy_tolerance: float
    min_top1_agreement: float | None = None
    max_rel_deviation: float | None = None
    about: str = ""


SCENARIOS = {
    "server": Scenario(
        "server", 8, "latency", 0.01, about="online requests: low latency at a small batch"
    ),
    "edge": Scenario("edge", 1, "memory", 0.01, about="one request at a time, memory is tight"),
    "critical": Scenario(
        "critical",
        1,
        "latency",
        0.0,
        min_top1_agreement=1.0,
        max_rel_deviation=0.01,
        about="medical, finance: every prediction as fp32's, outputs within 1%",
    ),
    "batch": Scenario("batch", 64, "throughput", 0.01, about="offline: samples per second"),
}
# What a serving preference minimises, as the training search names it: latency and
# throughput at one batch size order policies alike (throughput = batch / latency).
SERVING_PREFERENCES = ("latency", "memory", "throughput", "balanced")
AS_SELECTION = {
    "latency": "speed",
    "throughput": "speed",
    "memory": "memory",
    "balanced": "balanced",
}


def scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise AutoprecError(f"--scenario {name!r}: expected one of {', '.join(SCENARIOS)}")
    return SCENARIOS[name]
