"""summary.json as types: what a finished search hands to the CLI, the report and the
exports, with a schema version and one JSON round trip.

Readers use fields (``summary.best.speedup_vs_fp32``), never string keys, so that a
renamed field is one change here. ``Summary.from_json`` reads every summary written
since the first version (version 0 has no ``schema_version``); ``to_json`` writes the
same shape plus the version. Metrics stay a mapping by metric name: each mode measures
its own (``metric_names``), and MLflow and the report name them alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Self

from autoprec.numerics.state_health import GroupStateHealth, GroupStateLoss
from autoprec.study.confirmation import Confirmation
from autoprec.trials import canonical, mode_named

if TYPE_CHECKING:
    from autoprec.study._records import TrialRecord

# 0: summaries written before the version was recorded; 2: the serving mode under its one
# name ("mode": "serving", its part under "serving"), which a reader of 1 refuses.
SCHEMA_VERSION = 2

Key = int | str  # a trial's number, or "baseline"
BASELINE = "baseline"

CONFIRMED_TIME = "confirmed_step_time_ms"  # the side-by-side re-timing, in either mode


def _number(value: Any) -> Any:
    """A metric read back from strict JSON: 'nan' and 'inf' (see `finite`) are floats."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value


@dataclass
class Layer:
    """One leaf module of the chosen policy, as it runs."""

    name: str
    type: str
    params: int
    dtype: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layer:
        return cls(data["name"], data["type"], data["params"], data["dtype"])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "params": self.params, "dtype": self.dtype}


@dataclass
class Entry:
    """One measured policy: the baseline or a trial, with its metrics and verdicts."""

    number: Key
    state: str
    metrics: dict[str, Any]
    params: dict[str, Any]
    feasible: bool
    pareto: bool
    reason: str | None = None
    counted: bool = True  # in the budget: measured to an end
    anchor: str | None = None
    guided: str | None = None
    policy: dict[str, Any] | None = None
    mlflow_run_id: str | None = None
    peak_memory_is_estimate: bool = False
    switches: dict[str, Any] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    latency_by_batch_ms: dict[int, float] | None = None  # serving: at each batch size
    # How the figures were made: compute_capability, and where so, compiled (graph_breaks,
    # compile_s) and emulated (the dtypes run emulated: `autoprec.precision.emulation`).
    execution: dict[str, Any] = field(default_factory=dict)
    # Training with optimizer states: each group's health at the end (the mechanism and
    # reason where its quantised state hurt), and on an all-fp32 entry (the baseline)
    # what each quantised kind would lose on its states (`autoprec.numerics.state_health`).
    state_health: list[GroupStateHealth] = field(default_factory=list)
    state_loss: list[GroupStateLoss] = field(default_factory=list)
    # Why it was run again before its figures (`autoprec.trials.base.Measured.retries`).
    retries: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        """The number as text: how re-timings, run ids and MLflow name an entry."""
        return str(self.number)

    @property
    def is_baseline(self) -> bool:
        return self.number == BASELINE

    @property
    def complete(self) -> bool:
        return self.state == "complete"

    @property
    def accuracy(self) -> float | None:
        return self.metrics.get("accuracy")

    @property
    def accuracy_drop(self) -> float | None:
        return self.metrics.get("accuracy_drop")

    @property
    def peak_memory_mb(self) -> float | None:
        return self.metrics.get("peak_memory_mb")

    @property
    def emulated(self) -> list[str]:
        """The dtypes this entry's figures ran emulated (``["fp8"]``; none: real)."""
        return list(self.execution.get("emulated") or [])

    @property
    def confirmed_time_ms(self) -> float | None:
        """The side-by-side re-timing, where this entry was re-timed."""
        return self.metrics.get(CONFIRMED_TIME)

    @property
    def label(self) -> str:
        """``fp32 baseline``, or ``trial 7 (uniform-bf16)``."""
        if self.is_baseline:
            return "fp32 baseline"
        return self.name

    @property
    def name(self) -> str:
        """``baseline``, or ``trial 7 (uniform-bf16)``."""
        if self.is_baseline:
            return BASELINE
        return f"trial {self.number}" + (f" ({self.anchor})" if self.anchor else "")

    @property
    def retried(self) -> str | None:
        """``launched again after rank 1 was killed by SIGKILL (log: ...)``, where it was."""
        return f"launched again after {'; '.join(self.retries)}" if self.retries else None

    @property
    def groups(self) -> list[str]:
        """The searched layer groups, in the space's order."""
        return [k.removeprefix("dtype.") for k in self.params if k.startswith("dtype.")]

    def dtype_of(self, group: str) -> str:
        return self.params[f"dtype.{group}"]

    @classmethod
    def _fields_from(cls, data: dict[str, Any]) -> dict[str, Any]:
        by_batch = data.get("latency_by_batch_ms")
        return {
            "number": data["number"],
            "state": data["state"],
            "metrics": {k: _number(v) for k, v in (data.get("metrics") or {}).items()},
            "params": dict(data.get("params") or {}),
            "feasible": bool(data.get("feasible", False)),
            "pareto": bool(data.get("pareto", False)),
            "reason": data.get("reason"),
            "counted": data.get("counted", True),
            "anchor": data.get("anchor"),
            "guided": data.get("guided"),
            "policy": data.get("policy"),
            "mlflow_run_id": data.get("mlflow_run_id"),
            "peak_memory_is_estimate": data.get("peak_memory_is_estimate", False),
            "switches": data.get("switches") or {},
            "telemetry": data.get("telemetry") or {},
            "execution": dict(data.get("execution") or {}),
            "state_health": [GroupStateHealth.from_json(g) for g in data.get("state_health") or []],
            "state_loss": [GroupStateLoss.from_json(g) for g in data.get("state_loss") or []],
            "retries": [str(r) for r in data.get("retries") or []],
            "latency_by_batch_ms": None
            if by_batch is None
            else {int(k): _number(v) for k, v in by_batch.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        return cls(**cls._fields_from(data))

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "number": self.number,
            "state": self.state,
            "reason": self.reason,
            "counted": self.counted,
            "anchor": self.anchor,
            "guided": self.guided,
            "params": self.params,
            "policy": self.policy,
            "metrics": self.metrics,
            "feasible": self.feasible,
            "pareto": self.pareto,
            "mlflow_run_id": self.mlflow_run_id,
            "peak_memory_is_estimate": self.peak_memory_is_estimate,
            "switches": self.switches,
        }
        if self.latency_by_batch_ms is not None:
            data["latency_by_batch_ms"] = {str(k): v for k, v in self.latency_by_batch_ms.items()}
        data["telemetry"] = self.telemetry
        if self.execution:
            data["execution"] = self.execution
        if self.state_health:
            data["state_health"] = [g.to_json() for g in self.state_health]
        if self.state_loss:
            data["state_loss"] = [g.to_json() for g in self.state_loss]
        if self.retries:
            data["retries"] = self.retries
        return data


@dataclass
class Best(Entry):
    """The chosen entry, with its gains over fp32 and its layer table."""

    trial: Key = BASELINE
    speedup_vs_fp32: float | None = None
    memory_saving_vs_fp32: float | None = None
    layers: list[Layer] = field(default_factory=list)

    @classmethod
    def of(
        cls, entry: Entry, speedup_vs_fp32: float | None, memory_saving_vs_fp32: float | None
    ) -> Best:
        own = {f.name: getattr(entry, f.name) for f in fields(Entry)}
        return cls(
            **own,
            trial=entry.number,
            speedup_vs_fp32=speedup_vs_fp32,
            memory_saving_vs_fp32=memory_saving_vs_fp32,
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Best:
        return cls(
            **cls._fields_from(data),
            trial=data.get("trial", data["number"]),
            speedup_vs_fp32=_number(data.get("speedup_vs_fp32")),
            memory_saving_vs_fp32=_number(data.get("memory_saving_vs_fp32")),
            layers=[Layer.from_json(r) for r in data.get("layers") or []],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **super().to_json(),
            "trial": self.trial,
            "speedup_vs_fp32": self.speedup_vs_fp32,
            "memory_saving_vs_fp32": self.memory_saving_vs_fp32,
            "layers": [layer.to_json() for layer in self.layers],
        }


class SummaryPart:
    """A mode's own part of the summary (`autoprec.trials.Mode.summary_part`; serving's is
    `autoprec.study.serving_summary.Serving`): written under its key (``KEYS[0]``; older
    summaries may hold it under one of the others), checked as read from a file, and
    completed by what the trials measured and what the search left behind. The defaults
    are those of a part that adds nothing once made."""

    KEYS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.KEYS:
            raise TypeError(f"{cls.__name__}: a summary part names its key (KEYS)")

    @classmethod
    def block_of(cls, data: dict[str, Any]) -> Any:
        """The part as a summary.json mapping holds it: under the first of its keys found
        (None: under none)."""
        return next((data[key] for key in cls.KEYS if key in data), None)

    @classmethod
    def check(cls, block: Any) -> None:
        """Raise `autoprec.errors.SummaryError` naming the first field of ``block`` (the
        part as summary.json holds it) that a reader would trip on."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def batch_size(self) -> int | None:
        """The batch size the study chose by, where its mode serves batches of a size."""
        return None

    def summarized(
        self, records: list[TrialRecord], baseline: TrialRecord, confirmed: dict[str, float]
    ) -> Self:
        """The part with what the trials measured (``confirmed``: the side-by-side
        re-timings by key)."""
        return self

    def completed(self, left: dict[str, Any] | None) -> Self:
        """The part with what the search left behind besides the summary and the best
        policy (`autoprec.trials.base.Trials.leave_behind`'s fields; None: nothing)."""
        return self


@dataclass
class Settings:
    """The search's settings as written, in order (the report lists them all); what the
    CLI and the exports read is a field."""

    values: dict[str, Any] = field(default_factory=dict)

    @property
    def task_spec(self) -> str | None:
        """The task by name or path, for ``autoprec export`` (None: given as an object)."""
        return self.values.get("task_spec")

    @property
    def checkpoint(self) -> str | None:
        return self.values.get("checkpoint")

    @property
    def device(self) -> str:
        return str(self.values.get("device", "cpu"))

    @property
    def device_name(self) -> str:
        return str(self.values.get("device_name", self.values.get("device", "?")))

    @property
    def emulated(self) -> list[str]:
        """The dtypes the search's device ran emulated (``--emulate fp8``)."""
        return [d for d in str(self.values.get("emulated") or "").split(",") if d]

    @property
    def int8(self) -> str | None:
        return self.values.get("int8")

    @property
    def tracking_uri(self) -> str | None:
        return self.values.get("tracking_uri")

    @property
    def confirm_top(self) -> int | None:
        return self.values.get("confirm_top")

    @property
    def guard(self) -> bool:
        """Whether the search ran for a guarded run (``--guard``; False in summaries
        written before it)."""
        return self.values.get("guard") is True


@dataclass
class ProfileRow:
    """One of the riskiest layers the profile found."""

    rank: int
    module: str
    risk: float
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "module": self.module, "risk": self.risk, "reason": self.reason}


@dataclass
class Header:
    """What every reader of a summary reads first, and all an export needs."""

    mode: str
    settings: Settings

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Header:
        return cls(canonical(data["mode"]), Settings(dict(data.get("settings") or {})))


@dataclass
class Summary:
    """A finished (or interrupted) search: the baseline, every trial, the Pareto front,
    the chosen best, the settings and what the run took."""

    study: str
    mode: str
    baseline: Entry
    trials: list[Entry]
    best: Best
    accuracy_tolerance: float
    prefer: str
    metric_names: list[str] = field(default_factory=list)
    peak_memory_is_estimate: bool = False
    step_times_confirmed: list[str] = field(default_factory=list)
    pareto_front: list[Key] = field(default_factory=list)
    duplicates_skipped: int = 0
    advice: list[str] = field(default_factory=list)
    trial_time_s: float = 0.0
    part: SummaryPart | None = None  # the mode's own (`autoprec.trials.Mode.summary_part`)
    settings: Settings = field(default_factory=Settings)
    mlflow_parent_run_id: str | None = None
    optuna_study: dict[str, Any] | None = None  # see autoprec.study._identity
    interrupted: bool = False
    profile: list[ProfileRow] | None = None
    wall_time_s: float | None = None
    phase_time_s: dict[str, float] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    confirmation: Confirmation | None = None  # --confirm-steps: the long runs

    @property
    def entries(self) -> list[Entry]:
        """The baseline, then every trial."""
        return [self.baseline, *self.trials]

    def entry(self, key: Key) -> Entry | None:
        """The baseline or trial of that number (as a number or as text)."""
        return next((e for e in self.entries if e.key == str(key)), None)

    @property
    def time_metric(self) -> str:
        """The metric the study's time is, its mode's: the training step's, the latency
        served, ..."""
        return mode_named(self.mode).time_metric()

    @property
    def batch_size(self) -> int | None:
        """The batch size the study chose by, where its mode serves batches of a size (its
        part says, or its baseline measured at one); None for training."""
        chosen = None if self.part is None else self.part.batch_size
        found = chosen or self.baseline.metrics.get("batch_size")
        return None if found is None else int(found)

    def time_ms(self, entry: Entry) -> float | None:
        """An entry's time as compared: its side-by-side re-timing where it has one."""
        confirmed = entry.confirmed_time_ms
        return confirmed if confirmed is not None else entry.metrics.get(self.time_metric)

    def retimed(self, entry: Entry) -> bool:
        """Whether the entry and fp32 were both re-timed side by side."""
        return BASELINE in self.step_times_confirmed and entry.key in self.step_times_confirmed

    @property
    def header(self) -> Header:
        return Header(self.mode, self.settings)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        """A summary as any version wrote it (checked first: see summary_file)."""
        profile = data.get("profile")
        mode = canonical(data["mode"])
        return cls(
            study=data["study"],
            mode=mode,
            baseline=Entry.from_json(data["baseline"]),
            trials=[Entry.from_json(t) for t in data["trials"]],
            best=Best.from_json(data.get("best") or data["baseline"]),
            accuracy_tolerance=data["accuracy_tolerance"],
            prefer=data["prefer"],
            metric_names=list(data.get("metric_names") or []),
            peak_memory_is_estimate=data.get("peak_memory_is_estimate", False),
            step_times_confirmed=[str(k) for k in data.get("step_times_confirmed") or []],
            pareto_front=list(data.get("pareto_front") or []),
            duplicates_skipped=data.get("duplicates_skipped", 0),
            advice=list(data.get("advice") or []),
            trial_time_s=data.get("trial_time_s", 0.0),
            part=_part_of(mode, data),
            settings=Settings(dict(data.get("settings") or {})),
            mlflow_parent_run_id=data.get("mlflow_parent_run_id"),
            optuna_study=data.get("optuna_study"),
            interrupted=data.get("interrupted", False),
            profile=None if profile is None else [ProfileRow(**row) for row in profile],
            wall_time_s=data.get("wall_time_s"),
            phase_time_s=dict(data.get("phase_time_s") or {}),
            schema_version=data.get("schema_version", 0),
            confirmation=None
            if data.get("confirmation") is None
            else Confirmation.from_json(data["confirmation"]),
        )

    def to_json(self) -> dict[str, Any]:
        """The summary.json shape (floats as they are: `finite` makes them strict JSON)."""
        data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "study": self.study,
            "mode": self.mode,
            "metric_names": self.metric_names,
            "peak_memory_is_estimate": self.peak_memory_is_estimate,
            "step_times_confirmed": self.step_times_confirmed,
            "accuracy_tolerance": self.accuracy_tolerance,
            "prefer": self.prefer,
            "baseline": self.baseline.to_json(),
            "trials": [t.to_json() for t in self.trials],
            "pareto_front": self.pareto_front,
            "best": self.best.to_json(),
            "duplicates_skipped": self.duplicates_skipped,
            "advice": self.advice,
            "trial_time_s": self.trial_time_s,
        }
        if self.part is not None:
            data[self.part.KEYS[0]] = self.part.to_json()
        data.update(
            settings=self.settings.values,
            mlflow_parent_run_id=self.mlflow_parent_run_id,
            optuna_study=self.optuna_study,
            interrupted=self.interrupted,
            profile=None if self.profile is None else [r.to_json() for r in self.profile],
            wall_time_s=self.wall_time_s,
            phase_time_s=self.phase_time_s,
        )
        if self.confirmation is not None:
            data["confirmation"] = self.confirmation.to_json()
        return data


def _part_of(mode: str, data: dict[str, Any]) -> SummaryPart | None:
    """The mode's own part of a summary.json mapping, under the first of its keys found;
    None where the mode has none, or the summary holds none."""
    part = mode_named(mode).summary_part_class()
    if part is None:
        return None
    block = part.block_of(data)
    return None if block is None else part.from_json(block)  # type: ignore[no-any-return]


def as_summary(summary: Summary | dict[str, Any]) -> Summary:
    """A summary given typed or as its JSON mapping (``SearchResult.summary``, a test's
    edited copy)."""
    return summary if isinstance(summary, Summary) else Summary.from_json(summary)


def finite(value: Any) -> Any:
    """Strict JSON: non-finite floats (a diverged loss) become the strings 'nan', 'inf'."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
