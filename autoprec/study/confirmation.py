"""A long confirmation as types: which candidate held when trained ``steps`` steps beside
fp32 trained as long, and what failed before it (``--confirm-steps``).

A short trial sees a few hundred steps; precision failures often start later (activations
that grow, a warm-up that ends). The confirmation trains the chosen policy for as long as
asked and, if it does not hold there, the next candidate the choice ranks, and so on. This
module holds only the result and its JSON round trip (summary.json's ``confirmation``);
the runs are `autoprec.study.confirm`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

Key = int | str  # a trial's number, or "baseline"


@dataclass
class ConfirmationCheck:
    """One candidate trained ``steps`` steps: whether it held, and if not, why."""

    key: Key  # the trial it confirms (or "baseline": fp32 itself, which always holds)
    label: str  # "trial 7 (uniform-fp16)"
    held: bool
    state: str  # how the long run ended: complete, pruned or failed
    reason: str | None = None  # what failed (None when it held)
    accuracy: float | None = None
    accuracy_drop: float | None = None  # against fp32 trained as long
    steps_run: int = 0
    nonfinite_steps: int = 0
    overflow_steps: int = 0
    reused: bool = False  # read back from the study: an earlier run confirmed it
    mlflow_run_id: str | None = None
    # What the telemetry saw first in a run that did not hold (`autoprec.numerics.first_events`):
    # flush to zero, overflow or loss scale collapse, in which layer, on which step.
    mechanism: str | None = None
    layer: str | None = None
    first_step: int | None = None

    @property
    def is_baseline(self) -> bool:
        return self.key == "baseline"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConfirmationCheck:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """``trial 7 (uniform-fp16): failed at 2000 steps: non-finite loss ...``"""
        if self.held:
            if self.is_baseline:
                return f"{self.label}: holds (it is the reference)"
            drop = "" if self.accuracy_drop is None else f", accuracy drop {self.accuracy_drop:.4f}"
            return f"{self.label}: held over {self.steps_run} steps{drop}"
        return f"{self.label}: failed after {self.steps_run} steps: {self.reason}"


@dataclass
class Confirmation:
    """The long confirmation of a search: ``steps`` per run, fp32 trained as long (reused
    from the study when it already had one), every candidate tried in the choice's order,
    and which one held (None: none was tried to the end, see ``reason``)."""

    steps: int
    checks: list[ConfirmationCheck] = field(default_factory=list)
    held: Key | None = None
    fp32_accuracy: float | None = None
    fp32_reused: bool = False
    fp32_mlflow_run_id: str | None = None
    chosen_before: Key | None = None  # what the short trials chose
    reason: str | None = None  # why nothing was confirmed (fp32 itself failed, Ctrl-C)
    interrupted: bool = False

    @property
    def failed(self) -> list[ConfirmationCheck]:
        return [c for c in self.checks if not c.held]

    @property
    def changed_choice(self) -> bool:
        """Whether the policy that held is not the one the short trials chose."""
        return self.held is not None and str(self.held) != str(self.chosen_before)

    def lines(self) -> list[str]:
        """What the CLI prints: the outcome, then one line per candidate tried."""
        if self.held is None:
            why = self.reason or "no candidate held"
            head = f"confirmation at {self.steps} steps: nothing confirmed ({why})"
        else:
            held = next(c for c in self.checks if str(c.key) == str(self.held))
            head = f"confirmation at {self.steps} steps: {held.label} held"
            if self.failed:
                head += f" after {len(self.failed)} candidate(s) failed"
        return [head, *(f"  {c.line()}" for c in self.checks)]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Confirmation:
        return cls(
            steps=data["steps"],
            checks=[ConfirmationCheck.from_json(c) for c in data.get("checks") or []],
            held=data.get("held"),
            fp32_accuracy=data.get("fp32_accuracy"),
            fp32_reused=data.get("fp32_reused", False),
            fp32_mlflow_run_id=data.get("fp32_mlflow_run_id"),
            chosen_before=data.get("chosen_before"),
            reason=data.get("reason"),
            interrupted=data.get("interrupted", False),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "held": self.held,
            "chosen_before": self.chosen_before,
            "fp32_accuracy": self.fp32_accuracy,
            "fp32_reused": self.fp32_reused,
            "fp32_mlflow_run_id": self.fp32_mlflow_run_id,
            "reason": self.reason,
            "interrupted": self.interrupted,
            "checks": [c.to_json() for c in self.checks],
        }
