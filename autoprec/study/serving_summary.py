"""The serving mode's own part of summary.json (`autoprec.trials.Mode.summary_part`): the
scenario and its bounds, the fp32 weights converted, the best policy at each batch size
measured (where the best choice flips) and the model saved; read, checked and written
through `Serving`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

from autoprec.selection import TIME_TIE
from autoprec.study._summary_file import NUMBER, check_batch_size, expect
from autoprec.study.summary import latency_by_batch
from autoprec.study.summary_schema import Key, SummaryPart

if TYPE_CHECKING:
    from autoprec.study._records import TrialRecord


@dataclass
class BatchBest:
    """At one batch size a serving study measured: the fastest feasible policy there."""

    batch_size: int
    best: Key
    latency_ms: float
    fp32_latency_ms: float | None
    speedup_vs_fp32: float | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchBest:
        return cls(
            data["batch_size"],
            data["best"],
            data["latency_ms"],
            data.get("fp32_latency_ms"),
            data.get("speedup_vs_fp32"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "best": self.best,
            "latency_ms": self.latency_ms,
            "fp32_latency_ms": self.fp32_latency_ms,
            "speedup_vs_fp32": self.speedup_vs_fp32,
        }


@dataclass
class ServedModel:
    """The chosen model saved as an MLflow model, or why it was not."""

    logged: bool
    reason: str | None = None
    format: str | None = None
    unpickles: bool | None = None
    path: str | None = None
    uri: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServedModel:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_json(self) -> dict[str, Any]:
        if not self.logged:
            return {"logged": False, "reason": self.reason}
        return {
            "logged": True,
            "format": self.format,
            "unpickles": self.unpickles,
            "path": self.path,
            "uri": self.uri,
        }


@dataclass
class Serving(SummaryPart):
    """What a serving study adds: the scenario and its bounds, the fp32 weights the trials
    converted, the best at each batch size measured and the saved model."""

    # Under the mode's earlier name in older summaries.
    KEYS: ClassVar[tuple[str, ...]] = ("serving", "inference")

    scenario: str | None
    batch_sizes: list[int]
    int8: str | None = None
    fp32_checkpoint: str | None = None
    min_top1_agreement: float | None = None
    max_rel_deviation: float | None = None
    by_batch_size: list[BatchBest] = field(default_factory=list)
    mlflow_model: ServedModel | None = None

    @property
    def batch_size(self) -> int | None:
        """The batch size the study chose by: the scenario's, the first measured."""
        return self.batch_sizes[0] if self.batch_sizes else None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Serving:
        model = data.get("mlflow_model")
        return cls(
            data.get("scenario"),
            list(data.get("batch_sizes") or []),
            data.get("int8"),
            data.get("fp32_checkpoint"),
            data.get("min_top1_agreement"),
            data.get("max_rel_deviation"),
            [BatchBest.from_json(r) for r in data.get("by_batch_size") or []],
            None if model is None else ServedModel.from_json(model),
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "scenario": self.scenario,
            "batch_sizes": self.batch_sizes,
            "int8": self.int8,
            "fp32_checkpoint": self.fp32_checkpoint,
            "min_top1_agreement": self.min_top1_agreement,
            "max_rel_deviation": self.max_rel_deviation,
            "by_batch_size": [r.to_json() for r in self.by_batch_size],
        }
        if self.mlflow_model is not None:
            data["mlflow_model"] = self.mlflow_model.to_json()
        return data

    @classmethod
    def check(cls, block: Any) -> None:
        expect(block, dict, "serving")
        expect(block.get("batch_sizes"), list, "serving.batch_sizes")
        for i, size in enumerate(block["batch_sizes"]):
            check_batch_size(size, f"serving.batch_sizes[{i}]")
        for key in ("scenario", "int8"):
            expect(block.get(key), (str, type(None)), f"serving.{key}")
        for key in ("min_top1_agreement", "max_rel_deviation"):
            expect(block.get(key), (*NUMBER, type(None)), f"serving.{key}")
        expect(block.get("by_batch_size", []), list, "serving.by_batch_size")
        for i, row in enumerate(block.get("by_batch_size", [])):
            where = f"serving.by_batch_size[{i}]"
            expect(row, dict, where)
            check_batch_size(row.get("batch_size"), f"{where}.batch_size")
            expect(row.get("best"), (str, int), f"{where}.best")
            expect(row.get("latency_ms"), NUMBER, f"{where}.latency_ms")
            for key in ("fp32_latency_ms", "speedup_vs_fp32"):
                expect(row.get(key), (*NUMBER, type(None)), f"{where}.{key}")

    def summarized(
        self, records: list[TrialRecord], baseline: TrialRecord, confirmed: dict[str, float]
    ) -> Serving:
        """The best at each batch size measured (`by_batch_size`)."""
        return replace(
            self, by_batch_size=by_batch_size(records, baseline, self.batch_sizes, confirmed)
        )

    def completed(self, left: dict[str, Any] | None) -> Serving:
        """The saved model (or why not): what the serving trials leave behind."""
        return replace(self, mlflow_model=None if left is None else ServedModel(**left))


def by_batch_size(
    records: list[TrialRecord],
    baseline: TrialRecord,
    batch_sizes: list[int],
    confirmed: dict[str, float] | None = None,
) -> list[BatchBest]:
    """For each batch size a serving study measured, the feasible policy with the lowest
    latency there (within TIME_TIE a tie, to less memory): where the best choice flips.

    At the scenario's batch size (the first), where the fastest were re-timed side by
    side, the pool and the latencies are the re-timed ones, as for the choice itself: the
    trials' first latencies are noisy, timed one after another on a changing machine."""
    rows = []
    for index, size in enumerate(batch_sizes):
        retimed = confirmed if index == 0 and confirmed else None
        latency = {
            str(r.number): ms
            for r in [baseline, *records]
            if r.feasible and (ms := _latency_at(r, size, retimed)) is not None
        }
        pool = [r for r in [baseline, *records] if str(r.number) in latency]
        if not pool:
            continue
        fastest = min(latency[str(r.number)] for r in pool)
        tied = [r for r in pool if latency[str(r.number)] <= fastest * (1 + TIME_TIE)]
        best = min(tied, key=lambda r: (r.result.peak_memory_mb, latency[str(r.number)]))
        base = _latency_at(baseline, size, retimed)
        best_ms = latency[str(best.number)]
        rows.append(
            BatchBest(size, best.number, best_ms, base, None if not base else base / best_ms)
        )
    return rows


def _latency_at(record: TrialRecord, size: int, retimed: dict[str, float] | None) -> float | None:
    """The record's latency at ``size``: the side-by-side re-timing where ``retimed`` is
    given (None for a record not re-timed), else its own."""
    if retimed is not None:
        return retimed.get(str(record.number))
    return (latency_by_batch(record.result) or {}).get(size)
