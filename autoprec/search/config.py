"""A search's settings, typed and checked in one place.

The CLI builds a `SearchConfig` from its options; ``autoprec.search(task, space, config)``
takes one (or its fields as keywords). Everything here is checked when the config is
made, before any task is loaded or any store opened; what depends on the task or the
space (the study's default name, the space's tolerance) is settled by the session.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, fields, replace
from pathlib import Path
from typing import Any

from autoprec.devices import check_emulate
from autoprec.errors import AutoprecError, StoreError, redact
from autoprec.tracking import DEFAULT_TRACKING_URI, check_tracking_uri
from autoprec.trial_schedule import MAX_TRAIN_STEPS, TRIAL_SCHEDULES
from autoprec.trials import MODES, trials_class
from autoprec.trials.serving import ServingConfig

DEFAULT_STORAGE = "sqlite:///runs/optuna.db"
DEFAULT_RUNS_DIR = Path("runs")
# guided: profile-ranked seeding and bisection (autoprec.guided), then TPE.
SAMPLERS = ("guided", "tpe", "nsga2", "random")
HEARTBEAT_INTERVAL_S = 10  # the grace before a silent trial is failed: 3 intervals
# ServingConfig's fields, also taken flat (``SearchConfig(mode="inference", scenario=...)``,
# ``--scenario``) and nested into ``serving``.
SERVING_KEYWORDS = ("scenario", "batch_size", "batch_sizes", "checkpoint", "int8", "fp8")
# Matched whole (fullmatch): a pattern ending in "$" would pass a name ending in "\n".
STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """How a search runs.

    - ``trials``: the study's total, whoever runs them (continuing a study, or joining it
      from another host, runs only what is missing); ``steps`` per trial; ``seed`` of the
      weights, the data order and the sampler.
    - ``device``: ``auto``, ``cpu``, ``cuda[:N]`` or ``npu[:N]`` (or a Backend);
      ``workers`` processes on this host (default: one per ``devices`` entry, else 1),
      pinned round-robin to ``devices`` (``"npu:0-7"``, ``"cuda:0,cuda:1"``).
    - ``study`` (default: the task's name), ``storage`` (Optuna), ``tracking_uri``
      (MLflow), ``runs_dir`` (where summary.json and best_policy.yaml go).
    - ``accuracy_tolerance`` (default: the space's), ``prefer`` (speed, memory, balanced),
      ``sampler``, ``confirm_top`` (policies re-timed side by side before the choice;
      0 skips that, as does ``prefer="memory"``), ``early_stopping``.
    - ``trial_timeout_s`` (None: 25x the fp32 baseline's trial, at least 300 s; 0: no
      limit) and ``heartbeat_s`` (a trial silent for 3x this is failed).
    - ``mode``: ``training`` (trials train under each policy) or ``inference`` (trials
      convert a trained fp32 model's weights and serve it), one of `autoprec.trials.MODES`
      (default: inference when ``serving`` is given, else training); ``serving``: the
      serving settings (`autoprec.trials.serving.ServingConfig`: scenario, batch sizes,
      checkpoint, int8, fp8), whose fields may also be given flat with
      ``mode="inference"`` (``scenario="edge"``).
      ``prefer`` may then also be ``latency`` or ``throughput``; None takes the
      scenario's (training: speed).
    - ``nproc_per_trial``: each trial launched through torchrun as that many ranks on as
      many devices (`autoprec.distributed.launch`); ``parallel``: ``ddp`` (the default
      past one rank) or ``fsdp2``.
    - ``emulate``: dtypes the device may run emulated (``("fp8",)`` on the CPU: torchao's
      float8 numerics without its speed), recorded in the summary's settings.
    - ``compile``: train every trial under ``torch.compile`` (training only; a task may
      ask for it too, ``Task(compile=True)``): `autoprec.compiled`.
    - ``confirm_steps``: after the search, train the chosen policy this long beside fp32
      and, where it does not hold, the next candidate (`autoprec.search.confirm`); None:
      no confirmation. ``trial_schedule``: ``as-is`` (trials step the task's scheduler as
      the real run does) or ``compressed`` (its shape squeezed into the trials' steps,
      `autoprec.trial_schedule`).
    - ``train_steps``: how long the user's real run trains, the step every layer's range
      is forecast to (None: 10x ``steps``; at most `MAX_TRAIN_STEPS`); ``forecast``:
      ``infeasible`` (a trial whose forecast crosses its dtype's range within it is
      infeasible) or ``warn``. These, ``trial_schedule``, ``confirm_steps`` and
      ``compile`` are the training mode's: refused with ``mode="inference"``.

    A study keeps the settings that change what its trials measure (its fingerprint,
    `autoprec.search._studies.open_study`): continuing it with others is refused.
    """

    trials: int = 12
    steps: int = 200
    device: Any = "auto"
    study: str | None = None
    storage: str = DEFAULT_STORAGE
    tracking_uri: str = DEFAULT_TRACKING_URI
    seed: int = 0
    accuracy_tolerance: float | None = None
    prefer: str | None = None
    sampler: str = "guided"
    runs_dir: str | Path = DEFAULT_RUNS_DIR
    confirm_top: int = 3
    early_stopping: bool = True
    workers: int | None = None
    devices: str | Sequence[str] | None = None
    trial_timeout_s: float | None = None
    heartbeat_s: int = HEARTBEAT_INTERVAL_S
    mode: str | None = None  # None: inference with ``serving``, else training
    serving: ServingConfig | None = None
    emulate: tuple[str, ...] = ()
    compile: bool = False
    # -- longer than a trial (issue 21): the long confirmation, the trials' schedule
    confirm_steps: int | None = None
    trial_schedule: str = "as-is"
    # The range forecast (issue 21): the real run's length (None: 10x ``steps``), and
    # whether a trial forecast to overflow within it is infeasible or only warned of.
    train_steps: int | None = None
    forecast: str = "infeasible"
    nproc_per_trial: int = 1  # trials across several devices (autoprec.distributed)
    parallel: str | None = None
    # The serving settings given flat, nested into ``serving`` (not kept as fields).
    scenario: InitVar[str | None] = None
    batch_size: InitVar[int | None] = None
    batch_sizes: InitVar[str | Sequence[int] | None] = None
    checkpoint: InitVar[str | Path | None] = None
    int8: InitVar[str | None] = None
    fp8: InitVar[str | None] = None

    def __post_init__(
        self,
        scenario: str | None,
        batch_size: int | None,
        batch_sizes: str | Sequence[int] | None,
        checkpoint: str | Path | None,
        int8: str | None,
        fp8: str | None,
    ) -> None:
        object.__setattr__(self, "runs_dir", Path(self.runs_dir))
        flat = {
            "scenario": scenario,
            "batch_size": batch_size,
            "batch_sizes": batch_sizes,
            "checkpoint": checkpoint,
            "int8": int8,
            "fp8": fp8,
        }
        self._nest_serving({k: v for k, v in flat.items() if v is not None})
        object.__setattr__(self, "emulate", tuple(sorted(check_emulate(self.emulate))))
        _check_positive(self.trials, "--trials", "a positive integer")
        if _not_int(self.steps) or self.steps < 3:
            raise AutoprecError(f"steps: must be an integer of at least 3, got {self.steps!r}")
        if _not_int(self.seed):
            raise AutoprecError(f"--seed: expected an integer, got {self.seed!r}")
        if self.workers is not None:
            _check_positive(self.workers, "--workers", "a positive integer")
        if _not_int(self.confirm_top) or self.confirm_top < 0:
            raise AutoprecError(
                f"--confirm-top: expected an integer >= 0, got {self.confirm_top!r}"
            )
        timeout = self.trial_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0
        ):
            raise AutoprecError(
                f"--trial-timeout: expected seconds >= 0 (0: no limit), got {timeout!r}"
            )
        if _not_int(self.heartbeat_s) or self.heartbeat_s < 1:
            raise AutoprecError(
                f"--heartbeat: expected whole seconds >= 1, got {self.heartbeat_s!r}"
            )
        self._check_mode()
        if not isinstance(self.compile, bool):
            raise AutoprecError(f"--compile: expected True or False, got {self.compile!r}")
        if self.compile and self.mode != "training":
            raise AutoprecError("--compile: only with --mode training (serving is not compiled)")
        self._check_long_runs()
        _check_forecast(self.train_steps, self.forecast, self.steps)
        from autoprec.distributed.launch import settle_parallel

        parallel = settle_parallel(
            self.nproc_per_trial, self.parallel, self.mode, self.devices, self.workers
        )
        object.__setattr__(self, "parallel", parallel)
        self._check_launched()
        if self.sampler not in SAMPLERS:
            raise AutoprecError(
                f"--sampler: expected one of {', '.join(SAMPLERS)}, got {self.sampler!r}"
            )
        if self.accuracy_tolerance is not None:
            check_tolerance(self.accuracy_tolerance)
        if self.study is not None:
            check_study_name(self.study)
        check_storage_url(self.storage)
        check_tracking_uri(self.tracking_uri)

    def _nest_serving(self, flat: dict[str, Any]) -> None:
        """``serving`` made from the flat serving keywords (on top of a ``serving`` given
        too; a dict of its fields, as a worker gets it, becomes one), and the mode it
        implies."""
        serving = self.serving
        if isinstance(serving, dict):
            serving = ServingConfig(**serving)
        mode = self.mode
        if mode is None:  # a ServingConfig says the mode; flat keywords need --mode
            mode = _owner("serving") if serving is not None else "training"
        if flat:
            serving = replace(serving or ServingConfig(), **flat)
        if mode in MODES and MODES[mode][1] == "serving" and serving is None:
            serving = ServingConfig()
        object.__setattr__(self, "serving", serving)
        object.__setattr__(self, "mode", mode)

    def _check_mode(self) -> None:
        if self.mode not in MODES:
            raise AutoprecError(f"--mode: expected {' or '.join(MODES)}, got {self.mode!r}")
        allowed = trials_class(self.mode).preferences
        if self.prefer is not None and self.prefer not in (*allowed, "speed"):
            raise AutoprecError(
                f"--prefer: expected one of {', '.join(allowed)} for {self.mode}, "
                f"got {self.prefer!r}"
            )
        if self.serving is not None and MODES[self.mode][1] != "serving":
            given = self.serving.given() or ["--mode"]
            raise AutoprecError(f"{given[0]}: only with --mode {_owner('serving')}")

    def _check_long_runs(self) -> None:
        confirm = self.confirm_steps
        if confirm is not None and (_not_int(confirm) or confirm < self.steps):
            raise AutoprecError(
                f"--confirm-steps: expected an integer of at least --steps ({self.steps}), "
                f"got {confirm!r}"
            )
        training_only = {
            "--confirm-steps": confirm is not None,
            "--trial-schedule": self.trial_schedule != "as-is",
            "--train-steps": self.train_steps is not None,
            "--forecast": self.forecast != "infeasible",
        }
        for option, given in training_only.items():
            if given and self.mode != "training":
                raise AutoprecError(f"{option}: only with --mode training (trials that train)")
        if self.trial_schedule not in TRIAL_SCHEDULES:
            raise AutoprecError(
                f"--trial-schedule: expected {' or '.join(TRIAL_SCHEDULES)}, "
                f"got {self.trial_schedule!r}"
            )

    def _check_launched(self) -> None:
        """What a trial launched as several ranks does not do yet: refused in one line,
        rather than run on one device or eager while the search says otherwise."""
        if self.nproc_per_trial == 1:
            return
        unsupported = {
            "--compile": self.compile,
            "--trial-schedule compressed": self.trial_schedule == "compressed",
            "--confirm-steps": self.confirm_steps is not None,
        }
        for option, asked in unsupported.items():
            if asked:
                raise AutoprecError(
                    f"{option}: not with --nproc-per-trial {self.nproc_per_trial} yet "
                    "(launched trials run eager, on the task's own schedule, and are not "
                    "confirmed); drop one of them"
                )

    def public(self) -> dict[str, Any]:
        """The settings as they may be written down or shown (summary.json, the MLflow
        parent run, messages): every URL's password replaced by ``***``. The settings
        are only ever written through here; credentials stay in the URLs the stores are
        opened with, or better outside them (PGPASSWORD, ~/.pgpass,
        MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD)."""
        values = self.to_dict()
        for name in ("storage", "tracking_uri"):
            values[name] = redact(values[name])
        for name in ("runs_dir", "device"):
            values[name] = None if values[name] is None else str(values[name])
        return values

    def to_dict(self) -> dict[str, Any]:
        """The settings as keywords that make this config again (``serving`` as a dict of
        its fields), for a worker process."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["serving"] = None if self.serving is None else self.serving.to_dict()
        return values

    @classmethod
    def of(cls, config: SearchConfig | None, settings: dict[str, Any]) -> SearchConfig:
        """``config`` (or the defaults) with ``settings`` given as keywords on top."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known - set(SERVING_KEYWORDS))
        if unknown:
            raise TypeError(f"search() got an unexpected keyword argument {unknown[0]!r}")
        base = config or cls()
        return cls(**{**{name: getattr(base, name) for name in known}, **settings})


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _check_positive(value: Any, option: str, expected: str) -> None:
    if _not_int(value) or value < 1:
        raise AutoprecError(f"{option}: expected {expected}, got {value!r}")


FORECAST_MODES = ("infeasible", "warn")


def _check_forecast(train_steps: Any, mode: Any, steps: int) -> None:
    if train_steps is not None and (_not_int(train_steps) or train_steps < steps):
        raise AutoprecError(
            f"--train-steps: expected an integer of at least --steps ({steps}), got {train_steps!r}"
        )
    if train_steps is not None and train_steps > MAX_TRAIN_STEPS:
        raise AutoprecError(
            f"--train-steps {train_steps}: at most {MAX_TRAIN_STEPS} (the schedule is learnt "
            "by stepping the task's scheduler that far)"
        )
    if mode not in FORECAST_MODES:
        raise AutoprecError(f"--forecast: expected infeasible or warn, got {mode!r}")


def _owner(field: str) -> str:
    """The mode whose own settings are SearchConfig's ``field``."""
    return next(mode for mode, (_, owned) in MODES.items() if owned == field)


# The flat serving keywords are taken by __init__ only: reading them is a mistake.
for _name in SERVING_KEYWORDS:
    delattr(SearchConfig, _name)


def check_tolerance(tolerance: Any) -> float:
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, int | float)
        or not math.isfinite(tolerance)
        or tolerance < 0
    ):
        raise AutoprecError(f"--accuracy-tolerance: expected a number >= 0, got {tolerance!r}")
    return float(tolerance)


def check_study_name(name: str) -> str:
    if not isinstance(name, str) or not STUDY_NAME.fullmatch(name):
        raise AutoprecError(
            f"--study {name!r}: use letters, digits, '.', '-' and '_' (at most 100)"
        )
    return name


def check_storage_url(url: str) -> None:
    """Refuse an Optuna storage URL that is not a database URL, before anything is
    written."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # no URL; a port that is no number
        raise StoreError(
            f"--storage {redact(str(url))!r}: not a database URL (e.g. sqlite:///runs/optuna.db)"
        ) from None
    if parsed.get_backend_name() not in ("sqlite", "postgresql", "mysql"):
        raise StoreError(f"--storage {redact(url)!r}: expected a sqlite, postgresql or mysql URL")
