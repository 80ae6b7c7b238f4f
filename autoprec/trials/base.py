"""What every kind of trial shares: the `Trials` protocol a search calls, the result
protocol, the trial states, when a result is feasible, and the side-by-side re-timing.

A mode of search (training, serving, and next fp8 or trials across several devices) is
one `Trials` implementation: everything that differs between modes sits behind this
protocol, so that the search loop, the session, the records and the tracker never ask
which mode they are in. This module depends on nothing of autoprec but the device
backend, so that results (in `autoprec.serving.measure` too) can build on it.
"""

from __future__ import annotations

import enum
import math
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeVar

from autoprec.errors import AutoprecError, TrialTimeout

if TYPE_CHECKING:
    from torch import nn

    from autoprec.devices import Backend
    from autoprec.policy import Policy
    from autoprec.profile.sensitivity import Profile
    from autoprec.space import SearchSpace

R = TypeVar("R", bound="Result")
# Timed units (training steps, or forwards) per candidate and round of a side-by-side.
# Default per-trial time limit: this many times the fp32 baseline's trial, at least
# TRIAL_TIMEOUT_MIN_S (fp16 can be 20x slower than fp32 where it has no native kernels).
TRIAL_TIMEOUT_FACTOR = 25
TRIAL_TIMEOUT_MIN_S = 300.0
SIDE_BY_SIDE_BLOCK = 20


class TrialState(enum.StrEnum):
    """How a trial ended. A ``str``, so that stored results, summary.json and the MLflow
    tags hold the same words as before: ``complete``, ``pruned`` or ``failed``."""

    COMPLETE = "complete"
    PRUNED = "pruned"  # stopped early as hopeless (training only)
    FAILED = "failed"


class Measured:
    """A mixin for result dataclasses: the metrics by the names used everywhere
    (summary.json, MLflow, the tables), a plain dict form for the study, and the hooks
    through which the summary and the tracker read what only some modes measure.
    ``METRICS`` names the fields that are metrics."""

    METRICS: ClassVar[tuple[str, ...]] = ()
    # The time the search minimises, by its metric name, and what a person calls it.
    TIME_METRIC: ClassVar[str] = ""
    TIME_LABEL: ClassVar[str] = ""
    MODE: ClassVar[str] = ""  # summary.json's "mode" for a study of such results

    state: TrialState
    reason: str | None
    accuracy: float | None
    peak_memory_mb: float | None
    peak_memory_is_estimate: bool
    run_time_s: float
    # Why the trial was run again before this result (a launch across devices that lost a
    # rank: ``rank 1 was killed by SIGKILL (log: ...)``); none where it ran once. A mode
    # whose trials can be run again keeps it as a field of its result.
    retries: Sequence[str] = ()

    def __post_init__(self) -> None:
        self.state = TrialState(self.state)
        self.retries = tuple(self.retries)  # as read back from JSON (a list) or made

    @property
    def time_ms(self) -> float | None:
        """The time the search minimises (``TIME_METRIC``), so that callers need not know
        which kind of result they hold."""
        return getattr(self, self.TIME_METRIC)

    def metrics(self) -> dict[str, float]:
        """The numeric metrics that were measured (None and non-finite values left out)."""
        values = {name: getattr(self, name) for name in self.METRICS}
        return {k: float(v) for k, v in values.items() if v is not None and math.isfinite(float(v))}

    def extra_metrics(self) -> dict[str, float]:
        """Metrics beyond ``METRICS`` that a trial's MLflow run holds (none here)."""
        return {}

    def run_params(self) -> dict[str, str]:
        """Facts a trial's MLflow run holds as params beside its policy's (none here)."""
        return {}

    def run_tags(self) -> dict[str, str]:
        """Text a trial's MLflow run holds as tags beside its state and reason (none here)."""
        return {}

    def curves(self) -> dict[str, list[float]]:
        """Per-step curves for MLflow, by metric name (none here)."""
        return {}

    def artifacts(self) -> dict[str, str]:
        """Text files a trial's MLflow run holds besides its policy, by name (none here)."""
        return {}

    def entry_fields(self) -> dict[str, Any]:
        """What a summary.json entry holds of this result beyond its metrics."""
        return {"switches": {}}

    def telemetry_brief(self) -> dict[str, Any]:
        """The worst layers and the warnings, for summary.json (none here)."""
        return {}

    def advice(self) -> list[str]:
        """What the fp32 baseline's own numbers say about low precision (none here)."""
        return []

    def within(self, feasibility: Feasibility) -> bool:
        """Whether this complete result meets the bounds other than the accuracy drop."""
        return True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
        return cls(**{k: v for k, v in data.items() if k in fields})


class Result(Protocol):
    """What a trial measured, as the search reads it (see `Measured`)."""

    METRICS: ClassVar[tuple[str, ...]]
    TIME_METRIC: ClassVar[str]
    TIME_LABEL: ClassVar[str]
    MODE: ClassVar[str]
    state: TrialState
    reason: str | None
    accuracy: float | None
    peak_memory_mb: float | None
    peak_memory_is_estimate: bool
    run_time_s: float
    retries: Sequence[str]

    def __init__(self, state: str, reason: str | None = None) -> None: ...  # a failed one
    @property
    def time_ms(self) -> float | None: ...
    def metrics(self) -> dict[str, float]: ...
    def extra_metrics(self) -> dict[str, float]: ...
    def run_params(self) -> dict[str, str]: ...
    def run_tags(self) -> dict[str, str]: ...
    def curves(self) -> dict[str, list[float]]: ...
    def artifacts(self) -> dict[str, str]: ...
    def entry_fields(self) -> dict[str, Any]: ...
    def telemetry_brief(self) -> dict[str, Any]: ...
    def advice(self) -> list[str]: ...
    def within(self, feasibility: Feasibility) -> bool: ...
    def to_dict(self) -> dict[str, Any]: ...
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self: ...


@dataclass(frozen=True)
class Feasibility:
    """When a measured policy counts as good enough: its accuracy drop from fp32 at most
    ``tolerance``; for serving, also at least ``min_top1_agreement`` with fp32's top-1
    predictions and at most ``max_rel_deviation`` of relative output deviation, where the
    scenario sets them (the critical preset: every prediction as fp32's). The result
    judges the bounds it measures (`Measured.within`)."""

    tolerance: float
    min_top1_agreement: float | None = None
    max_rel_deviation: float | None = None
    # Training: a trial whose range forecast crosses within the run stays feasible.
    forecast_warns: bool = False

    def judge(self, result: Result, drop: float | None) -> bool:
        if result.state != TrialState.COMPLETE or drop is None or drop > self.tolerance + 1e-12:
            return False
        return result.within(self)


@dataclass(frozen=True)
class Choice:
    """What a mode settles before any store is opened: when a policy is feasible, the
    preference the best is chosen by, and the study's name."""

    feasibility: Feasibility
    prefer: str
    study: str


class Trials(Protocol):
    """One mode of search: how its trials run, and everything else that differs between
    modes. Made by the mode's module from the checked inputs (`autoprec.trials.of`),
    before any store is opened; `load` then readies what the trials start from."""

    mode: ClassVar[str]  # the --mode that selects it, and summary.json's "mode"
    objectives: ClassVar[tuple[str, str, str]]  # the study's metric names, as Optuna's
    result_type: ClassVar[type[Result]]
    baseline_verb: ClassVar[str]  # "the fp32 baseline did not <verb>"

    @property
    def settings(self) -> dict[str, Any]:
        """What a study is identified by beyond the search's common settings."""
        ...

    def fit(self, space: SearchSpace, profile: Profile | None) -> SearchSpace:
        """The space fitted to the model and the device for this mode's trials."""
        ...

    def choice(self, space: SearchSpace) -> Choice: ...

    def load(self, out_dir: Path, may_train: bool, on_training: Callable[[Path], None]) -> None:
        """Ready what the trials start from (serving: the trained fp32 model)."""
        ...

    def profile(self, seed: int) -> Profile:
        """The sensitivity profile of the model these trials measure."""
        ...

    def warm_up(self, space: SearchSpace, limit_s: float) -> None:
        """Pay the process's one-time costs before any trial is timed."""
        ...

    def judged_against(self, baseline: Result, early_stopping: bool) -> Trials:
        """These trials, stopping a hopeless one early against the fp32 baseline where
        the mode can (``early_stopping``)."""
        ...

    def measure(self, policy: Policy) -> Result: ...

    def failed(self, reason: str) -> Result: ...

    def retime(self, policies: list[Policy]) -> list[float]:
        """The time (``result_type.TIME_METRIC``) of each policy, timed side by side."""
        ...

    def layer_table(self, policy: Policy, model: nn.Module) -> list[dict[str, Any]]:
        """summary.json's table of what runs where under the chosen policy."""
        ...

    def summary_settings(self) -> dict[str, Any]:
        """What summary.json's settings hold of this mode (its checkpoint, say)."""
        ...

    def summary_part(self, feasibility: Feasibility) -> dict[str, Any] | None:
        """The fields of the summary's mode part (serving: the scenario and what it asks,
        the fp32 weights converted), or None where the mode adds none."""
        ...

    def leave_behind(
        self, policy: Policy, out_dir: Path, task_spec: str | None, publish: Publisher
    ) -> dict[str, Any] | None:
        """What a finished search leaves besides the summary and the best policy (the
        served MLflow model), as the fields the summary records of it; None for nothing."""
        ...


class Publisher(Protocol):
    """Where a finished search's extras go: the tracker's warnings and model folders."""

    @property
    def parent_id(self) -> str | None: ...

    def warn(self, message: str) -> None: ...

    def log_model_folder(
        self, folder: Path, name: str = "model", tags: dict[str, str] | None = None
    ) -> None: ...


class Timed(Protocol):
    """One candidate of a side-by-side timing: a trained or served model under a policy."""

    def warm_up(self, calls: int) -> None: ...

    def timed(self, calls: int) -> list[float]:
        """Seconds of each of ``calls`` units (steps or forwards), between device syncs."""
        ...


def time_side_by_side(
    candidates: Sequence[Timed],
    backend: Backend,
    rounds: int = 5,
    block: int = SIDE_BY_SIDE_BLOCK,
    warmup: int | None = None,
) -> list[float]:
    """Median time (ms) of each candidate's unit, measured in alternating blocks.

    Separate trials run minutes apart on a shared machine and drift by 10-20%; timing
    the candidates in turn, round after round, exposes them to the same conditions.
    Round 0 warms each up (``warmup`` units, default ``block``), untimed."""
    if rounds < 1 or block < 1:
        raise AutoprecError(f"rounds and block: must be positive, got {rounds} and {block}")
    times_s: list[list[float]] = [[] for _ in candidates]
    with backend.selected():
        for candidate in candidates:
            candidate.warm_up(block if warmup is None else warmup)
        for _ in range(rounds):
            for times, candidate in zip(times_s, candidates, strict=True):
                times += candidate.timed(block)
    return [statistics.median(times) * 1000.0 for times in times_s]


def measured(value: float | None, name: str) -> float:
    """A metric of a complete trial, which always has it (None only where a trial did not
    complete): read where the search compares complete trials."""
    if value is None:
        raise AutoprecError(f"a complete trial has no {name}: its record is damaged")
    return value


def run_with_time_limit(measure: Callable[[], R], limit_s: float, failed: Callable[[str], R]) -> R:
    """``measure()``, or ``failed(reason)`` when it runs past ``limit_s`` (0: no limit).

    The limit is a SIGALRM timer, so it needs the main thread (elsewhere there is no
    limit), and it strikes between Python calls: a hang inside one native call is only
    cut short when that call returns.
    """
    if not limit_s or threading.current_thread() is not threading.main_thread():
        return measure()

    def on_alarm(signum: int, frame: Any) -> None:
        raise TrialTimeout(f"no result after {limit_s:.0f} s (the per-trial time limit)")

    started_s = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        result = measure()
    except TrialTimeout as error:  # struck outside the measurement's own handling
        result = failed(f"TrialTimeout: {error}")
        result.run_time_s = time.perf_counter() - started_s
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return result
