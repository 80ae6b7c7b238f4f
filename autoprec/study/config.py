"""A search's settings, typed and checked in one place.

The CLI builds a `SearchConfig` from its options; ``autoprec.search(task, space, config)``
takes one (or its fields as keywords). Everything here is checked when the config is
made, before any task is loaded or any store opened; what depends on the task or the
space (the study's default name, the space's tolerance) is settled by the session.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Re-exported: the search's names for them (SAMPLERS' guided: profile-ranked seeding and
# bisection, `autoprec.profile.guided`, then TPE; a trial silent for 3 heartbeat intervals fails).
from autoprec._util.names import DEFAULT_STORAGE as DEFAULT_STORAGE
from autoprec._util.names import HEARTBEAT_INTERVAL_S as HEARTBEAT_INTERVAL_S
from autoprec._util.names import SAMPLERS as SAMPLERS
from autoprec.devices import check_emulate
from autoprec.errors import AutoprecError, redact
from autoprec.settings import (
    SECTIONS,
    Budget,
    Choice,
    Compiled,
    Faults,
    Launch,
    LongerThanATrial,
    Where,
    check_values,
    declared,
    options,
)
from autoprec.settings import check_study_name as check_study_name
from autoprec.trials import MODES, Mode, canonical, mode_named
from autoprec.trials.schedule import MAX_TRAIN_STEPS

if TYPE_CHECKING:
    from autoprec.trials.serving import ServingConfig


# The sections last to first: a dataclass takes its bases' fields in reverse order.
@dataclass(frozen=True, kw_only=True)
class SearchConfig(Launch, LongerThanATrial, Compiled, Faults, Choice, Where, Budget):
    """How a search runs: the settings of every section of `autoprec.settings` (`Budget`,
    `Where`, `Choice`, `Faults`, `Compiled`, `LongerThanATrial`, `Launch`; the task and
    the space are `autoprec.search`'s own arguments), each declared there once with its
    type, default and help, as ``autoprec search --help`` prints them.

    Beyond what the command line gives: ``device`` may be a Backend; ``runs_dir`` is where
    summary.json and best_policy.yaml go. A mode with settings of its own
    (`autoprec.trials.Mode.settings`) has them in the field of that name, as its settings
    object (`Mode.config`): ``serving`` holds the serving mode's
    (`autoprec.trials.serving.ServingConfig`: scenario, batch sizes, checkpoint, int8, fp8),
    whose fields may also be given flat with ``mode="serving"`` (``scenario="edge"``);
    ``mode`` left None is the mode whose settings object is given, else the default
    (training). ``prefer`` takes the mode's preferences (serving's: also ``latency`` or
    ``throughput``). The settings of the compiled trials and of the section "longer than a
    trial" are for modes whose trials train (`Mode.trains`): refused with
    ``mode="serving"``.

    A study keeps the settings that change what its trials measure (its fingerprint,
    `autoprec.settings.study_settings`): continuing it with others is refused.
    """

    serving: ServingConfig | None = None  # the serving mode's own settings
    # The modes' own settings given flat (``scenario="edge"``, ``--scenario``): nested into
    # the field of their mode's section, not kept as fields (FLAT_KEYWORDS).
    scenario: InitVar[str | None] = None
    batch_size: InitVar[int | None] = None
    batch_sizes: InitVar[str | Sequence[int] | None] = None
    checkpoint: InitVar[str | Path | None] = None
    int8: InitVar[str | None] = None
    fp8: InitVar[str | None] = None

    def __post_init__(self, *flat: Any) -> None:
        object.__setattr__(self, "runs_dir", Path(self.runs_dir))
        given = zip(FLAT_KEYWORDS, flat, strict=True)
        self._nest_own({name: value for name, value in given if value is not None})
        object.__setattr__(self, "emulate", tuple(sorted(check_emulate(self.emulate))))
        self._check_mode()
        check_values(self)  # each setting as declared (`autoprec.settings`); then together:
        _check_lengths(self.steps, self.confirm_steps, self.train_steps)
        from autoprec.distributed.launch import settle_parallel

        parallel = settle_parallel(
            self.nproc_per_trial, self.parallel, self.mode, self.devices, self.workers
        )
        object.__setattr__(self, "parallel", parallel)
        self._check_launched()

    def _nest_own(self, flat: dict[str, Any]) -> None:
        """Each mode's own settings object made of its flat keywords, on top of the one
        given (a dict of its fields, as a worker gets it, becomes one); and the mode: left
        None, the one whose settings object was given (flat keywords need ``mode``), else
        the default, its settings object made where none was given."""
        mode = canonical(self.mode)
        for key, owner in _own_settings().items():
            own = getattr(self, key)
            if isinstance(own, dict):
                own = owner.config_class()(**own)
            if mode is None and own is not None:
                mode = owner.name
            given = {name: flat[name] for name in _flat_keywords(key) if name in flat}
            if given:
                own = replace(own or owner.config_class()(), **given)
            object.__setattr__(self, key, own)
        if mode is None:
            mode = mode_named(None).name
        chosen = MODES.get(mode)  # an unknown mode is refused by _check_mode
        if chosen and chosen.settings is not None and getattr(self, chosen.settings) is None:
            object.__setattr__(self, chosen.settings, chosen.config_class()())
        object.__setattr__(self, "mode", mode)

    def _check_mode(self) -> None:
        """The mode, with the preference and each section's settings checked against it:
        a setting of a section that does not apply to it (`Section.applies_to`), set away
        from its default, is refused naming the modes it is for (a mode's own settings
        object given: by its first option set)."""
        mode = mode_named(self.mode)
        allowed = mode.preferences
        if self.prefer is not None and self.prefer not in (*allowed, "speed"):
            raise AutoprecError(
                f"--prefer: expected one of {', '.join(allowed)} for {self.mode}, "
                f"got {self.prefer!r}"
            )
        for section in SECTIONS:
            holder = getattr(self, section.key) if section.own else self
            if section.applies_to(mode) or holder is None:
                continue
            given = [o.flag for o in options(section) if getattr(holder, o.name) != o.default]
            if given or section.own:
                modes = " or ".join(m.name for m in MODES.values() if section.applies_to(m))
                why = " (trials that train)" if section.training else ""
                raise AutoprecError(f"{(given or ['--mode'])[0]}: only with --mode {modes}{why}")

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
        """The settings as keywords that make this config again (a mode's own settings
        object as a dict of its fields), for a worker process."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in _own_settings():
            own = values[key]
            values[key] = None if own is None else own.to_dict()
        return values

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> SearchConfig:
        """The config of the declared settings' values (`autoprec.settings.options`, as
        the command line and a config file give them; the task and the space left out).
        A mode's own settings away from their defaults are given flat: they need that
        mode, as ``--scenario`` needs ``--mode serving``."""
        given = {
            o.name: values[o.name]
            for o in options()
            if o.name in FLAT_KEYWORDS and values[o.name] != o.default
        }
        kept = {f.name for f in fields(cls)} - set(_own_settings())
        return cls(**{name: values[name] for name in kept}, **given)

    def option_values(self) -> dict[str, Any]:
        """The settings as they are in effect, one plain value per declared setting (the
        mode settled, a mode's own section at its defaults where it has no settings
        object): what ``--print-config`` writes, and `from_options` makes this config
        again of."""
        owners = _own_settings()
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in owners}
        for key, owner in owners.items():
            own = getattr(self, key) or owner.config_class()()
            values.update({name: getattr(own, name) for name in _flat_keywords(key)})
        return values

    @classmethod
    def of(cls, config: SearchConfig | None, settings: dict[str, Any]) -> SearchConfig:
        """``config`` (or the defaults) with ``settings`` given as keywords on top."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known - set(FLAT_KEYWORDS))
        if unknown:
            raise TypeError(f"search() got an unexpected keyword argument {unknown[0]!r}")
        base = config or cls()
        return cls(**{**{name: getattr(base, name) for name in known}, **settings})


def _check_lengths(steps: int, confirm_steps: int | None, train_steps: int | None) -> None:
    """The long confirmation and the forecast's horizon: at least the trials' steps."""
    if confirm_steps is not None and confirm_steps < steps:
        raise AutoprecError(
            f"--confirm-steps: expected an integer of at least --steps ({steps}), "
            f"got {confirm_steps!r}"
        )
    if train_steps is not None and train_steps < steps:
        raise AutoprecError(
            f"--train-steps: expected an integer of at least --steps ({steps}), got {train_steps!r}"
        )
    if train_steps is not None and train_steps > MAX_TRAIN_STEPS:
        raise AutoprecError(
            f"--train-steps {train_steps}: at most {MAX_TRAIN_STEPS} (the schedule is learnt "
            "by stepping the task's scheduler that far)"
        )


def _own_settings() -> dict[str, Mode]:
    """The modes with settings of their own, by the key of their section (SearchConfig's
    field holding their settings object)."""
    return {mode.settings: mode for mode in MODES.values() if mode.settings is not None}


def _flat_keywords(key: str) -> list[str]:
    """The settings of the section ``key``, as they are also given flat."""
    return [o.name for o in options() if o.section == key]


# The keywords SearchConfig takes that are no field of it: the flat ones, in the order
# __post_init__ gets them.
_FIELDS = {f.name for f in fields(SearchConfig)}
FLAT_KEYWORDS = tuple(p for p in inspect.signature(SearchConfig).parameters if p not in _FIELDS)
# The flat keywords are taken by __init__ only: reading them is a mistake.
for _name in FLAT_KEYWORDS:
    delattr(SearchConfig, _name)


def check_tolerance(tolerance: Any) -> float:
    """An accuracy tolerance (the option's, or a space file's), as ``--accuracy-tolerance``
    declares it."""
    return float(declared("accuracy_tolerance").checked(tolerance))
