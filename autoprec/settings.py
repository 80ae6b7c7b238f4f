"""Every ``autoprec search`` setting, declared once: its type, default and help, in its
section.

Each section is a small frozen dataclass whose fields are the settings (made with
`option`). The search's classes are built from them (`autoprec.SearchConfig` is every
section but the first's task and space, `autoprec.trials.serving.ServingConfig` is the
serving section), and from the same fields come the command's options (`autoprec.cli`,
whose parser also fills the docs' option reference), the sections of a ``--config`` file
and of ``--print-config``, and the study's fingerprint (`study_settings`).

This module imports nothing heavy: ``autoprec search --help`` reads it without torch.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import autoprec.formats as formats
from autoprec._util.names import (
    BUILTIN_TASK_NAMES,
    DEFAULT_STORAGE,
    DEFAULT_TASK,
    DEFAULT_TRACKING_URI,
    HEARTBEAT_INTERVAL_S,
    SAMPLERS,
)
from autoprec.errors import AutoprecError, StoreError, redact
from autoprec.formats.fp8 import FP8
from autoprec.formats.int8 import INT8
from autoprec.serving.scenarios import SCENARIOS, scenario
from autoprec.trials import DEFAULT_MODE, MODES, Mode, mode_named
from autoprec.trials.schedule import TRIAL_SCHEDULES


def option(default: Any, help: str, **declared: Any) -> Any:
    """A setting: its default and help, with the rest of its `Option` (what the command line
    needs besides its type, the fingerprint's keys it makes, what a value must be)."""
    if isinstance(default, list | dict):
        raise TypeError("option(): give a tuple, not a mutable default")
    return field(default=default, metadata={"help": help, **declared})


@dataclass(frozen=True)
class Option:
    """One declared setting, as the command line, the config file and the fingerprint see
    it: ``name`` (the field, and the key in its section), ``section`` (its key), ``flag``
    (default ``--<name>``); the keys of the study's fingerprint it makes (``study``: the
    setting changes what a trial measures; ``study_if_set``: keys recorded only where they
    are not None); what a value must be besides its type and ``choices``: ``at_least``,
    ``at_most``, and what ``check`` takes (it raises an AutoprecError in its own words)."""

    name: str
    section: str
    type: Any
    default: Any
    help: str
    flag: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    study: tuple[str, ...] = ()
    study_if_set: tuple[str, ...] = ()
    at_least: float = -math.inf
    at_most: float = math.inf
    check: Callable[[Any], Any] | None = None
    required: bool = False  # on the command line (another command's, `declared`)

    @property
    def switch(self) -> bool:
        """A flag that takes no value: ``--compile`` sets True, ``--no-X`` sets False."""
        return self.type is bool

    @property
    def repeated(self) -> bool:
        """Given once per value (``--emulate fp8``), a list in a file."""
        return typing.get_origin(self.type) is tuple

    @property
    def scalar(self) -> type:
        """The type of one value on the command line (int, float or str)."""
        if self.repeated:
            return str
        members = [m for m in typing.get_args(self.type) if m is not type(None)]
        first = members[0] if members else self.type
        return first if first in (int, float, str) else str

    def accepts(self, value: Any) -> bool:
        """Whether a value read from a file has this option's type (and is one of its
        choices)."""
        if not _has_type(self.type, value):
            return False
        if self.choices is None or value is None:
            return True
        return all(v in self.choices for v in (value if self.repeated else [value]))

    def checked(self, value: Any) -> Any:
        """``value``, refused in one line naming the option unless its ``check`` passes, else
        unless it has its type (a number, a switch: not a path or a device, which their users
        check), is one of its choices, within its bounds. None passes where it is the default."""
        if value is None and self.default is None:
            return value
        if self.check is not None:
            self.check(value)
            return value
        typed = self.switch or self.scalar is not str or self.choices is not None
        numeric = self.scalar in (int, float) and not self.repeated
        if (typed and not self.accepts(value)) or (
            numeric and not (math.isfinite(value) and self.at_least <= value <= self.at_most)
        ):
            raise AutoprecError(f"{self.flag}: {_expected(self, python=True)}, got {value!r}")
        return value


def declared(name: str) -> Option:
    """The search's setting of that name, as other commands take it too (``--study``)."""
    return next(o for o in options() if o.name == name)


def check_values(settings: Any) -> None:
    """Every declared setting ``settings`` has as an attribute, checked (`Option.checked`)."""
    for o in options():
        if hasattr(settings, o.name):
            o.checked(getattr(settings, o.name))


def _has_type(hint: Any, value: Any) -> bool:
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(member, value) for member in members)
    if origin in (tuple, Sequence, list):
        return isinstance(value, list | tuple) and all(_has_type(members[0], v) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)  # str, Path, and Any (a device, as a file can name it)


# -- checks that are more than a type, bounds or choices ---------------------------------

# Matched whole (fullmatch): a pattern ending in "$" would pass a name ending in "\n".
STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MAX_BATCH_SIZE = 65536  # a served batch; the validation samples are repeated to fill it
_TRACKING_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "databricks")


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


def check_tracking_uri(uri: str) -> str:
    """Refuse a URI MLflow would not understand, before anything is written."""
    scheme = urlparse(uri).scheme.split("+")[0] if isinstance(uri, str) else ""
    if scheme not in _TRACKING_SCHEMES:
        raise StoreError(
            f"--tracking-uri {redact(str(uri))!r}: unsupported scheme (expected sqlite:///path, "
            "http(s)://host:port, postgresql://..., or file:///path)"
        )
    return uri


def parse_batch_sizes(value: str | Sequence[int]) -> list[int]:
    """``"1,8,64"`` (or a list) as batch sizes, each a positive integer, no repeats."""
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        sizes = [int(str(item).strip()) for item in items]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes) or len(set(sizes)) != len(sizes):
        raise AutoprecError(
            f"--batch-sizes {value!r}: expected distinct positive integers, e.g. 1,8,64"
        )
    if max(sizes) > MAX_BATCH_SIZE:
        raise AutoprecError(f"--batch-sizes {value!r}: at most {MAX_BATCH_SIZE} per batch")
    return sizes


# -- the sections ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Target:
    """What is searched: the task and the space (`autoprec.search`'s arguments, not
    `SearchConfig`'s)."""

    task: str = option(
        DEFAULT_TASK,
        f"built-in ({', '.join(sorted(BUILTIN_TASK_NAMES))}), package.module:attr or "
        "path/to/file.py:attr (a Task or a callable returning one)",
        study="task",
    )
    space: str | None = option(
        None,
        "shipped space name or YAML file (default: the space named after the task if "
        "shipped, else 'default')",
        study=("space", "space_fingerprint"),
    )


@dataclass(frozen=True, kw_only=True)
class Budget:
    """What is searched, and how long: the trials, their steps, the seed, the mode."""

    trials: int = option(
        12,
        "total trials in the study (the fp32 baseline is extra); a continued study runs "
        "only the missing ones",
        at_least=1,
    )
    steps: int = option(200, "training steps per trial", study="steps", at_least=3)
    seed: int = option(0, "seed of weights, data order and sampler", study="seed")
    mode: str | None = option(
        None,
        "; ".join(f"{m.name}: {m.help}" for m in MODES.values())
        + f" (default: {DEFAULT_MODE}; from Python, serving when given a ServingConfig; "
        + "; ".join(f"{a}: {m.name}'s earlier name" for m in MODES.values() for a in m.aliases)
        + ")",
        choices=(*MODES, *(alias for m in MODES.values() for alias in m.aliases)),
        metavar="{" + ",".join(MODES) + "}",
        study="mode",
        check=mode_named,  # a mode registered later too
    )


_PRESETS = "; ".join(
    f"{s.name}: batch {s.batch_size}, {s.prefer}, tolerance {s.accuracy_tolerance:g}"
    + (", every prediction as fp32's, outputs within 1%%" if s.min_top1_agreement else "")
    for s in SCENARIOS.values()
)


@dataclass(frozen=True, kw_only=True)
class ServingSettings:
    """The serving mode's own settings (``--mode serving``)."""

    scenario: str | None = option(
        None,
        f"what the serving optimises (default: server): {_PRESETS}",
        choices=tuple(SCENARIOS),
        study="scenario",
        check=scenario,
    )
    batch_size: int | None = option(
        None,
        "batch size served (default: the scenario's)",
        study="batch_sizes",
        at_least=1,
        at_most=MAX_BATCH_SIZE,
    )
    batch_sizes: str | Sequence[int] | None = option(
        None,
        "also measure these batch sizes (e.g. 1,8,64): the report shows where the best "
        "choice flips",
        metavar="N,N,...",
        study="batch_sizes",
        check=parse_batch_sizes,
    )
    checkpoint: str | Path | None = option(
        None,
        "the fp32 weights to serve (a state dict); default: the task's checkpoint, else the "
        "model trained once for --steps and kept as runs/<study>/fp32.pt (never overwritten)",
        metavar="PATH",
        study="checkpoint_sha256",
    )
    int8: str = option(
        "auto",
        "int8 Linear layers: auto (where the device has kernels), off, or a method",
        choices=("auto", "off", *(m.name for m in INT8.methods)),
        study="int8",
    )
    fp8: str = option(
        "auto",
        "fp8 Linear layers for serving (torchao float8 weights): auto (CUDA 8.9+; on the CPU "
        "only with --emulate fp8), off, or a method",
        choices=("auto", "off", *(m.name for m in FP8.methods)),
        study_if_set="fp8",  # studies without fp8 keep the identity they had before it
    )


@dataclass(frozen=True, kw_only=True)
class Where:
    """Where the search runs and is recorded."""

    device: Any = option(
        "auto",
        "auto (npu, then cuda, then cpu), cpu, cuda[:N], npu[:N]",
        study="device",
        study_if_set="backend",  # the collective backend of trials launched as ranks
    )
    emulate: tuple[str, ...] = option(
        (),
        "run a dtype the device lacks, emulated, for tests: fp8 or an MX format on the CPU "
        "(torchao's numerics without its speed; the summary's settings say emulated)",
        choices=tuple(f.name for f in formats.all_formats() if f.emulated_elsewhere),
        study="emulated",
    )
    study: str | None = option(
        None, "study name (default: the task's name); reuse it to continue", check=check_study_name
    )
    storage: str = option(DEFAULT_STORAGE, "Optuna storage URL", check=check_storage_url)
    tracking_uri: str = option(
        DEFAULT_TRACKING_URI, "MLflow tracking URI", check=check_tracking_uri
    )
    runs_dir: str | Path = option(
        "runs",
        "the folder of the outputs: <folder>/<study>/summary.json, best_policy.yaml (the "
        "stores are --storage and --tracking-uri)",
    )


@dataclass(frozen=True, kw_only=True)
class Choice:
    """How the best policy is chosen."""

    accuracy_tolerance: float | None = option(
        None,
        "largest accepted accuracy drop from fp32, absolute (0.01 = 1 point); default: the "
        "space file's",
        at_least=0,
        study="accuracy_tolerance",
    )
    prefer: str | None = option(
        None,
        "how the best feasible policy is chosen (default: speed in training, the scenario's "
        "in serving; latency and throughput are for serving)",
        choices=tuple(dict.fromkeys(p for m in MODES.values() for p in ("speed", *m.preferences))),
        study="prefer",
    )
    sampler: str = option(
        "guided",
        "guided: profile the model, try the most promising policies and bisect for the "
        "layers that must stay fp32, then TPE; or an Optuna sampler alone",
        choices=SAMPLERS,
        study="sampler",
    )
    confirm_top: int = option(
        3,
        "re-time this many of the fastest feasible policies side by side with the fp32 "
        "baseline before choosing (0: off; skipped with --prefer memory)",
        at_least=0,
        study="confirm_top",
    )
    early_stopping: bool = option(
        True,
        "train every trial to the end, even when its loss trails the fp32 baseline's or its "
        "loss scaler keeps skipping steps",
        study="early_stopping",
    )


@dataclass(frozen=True, kw_only=True)
class Faults:
    """Workers, and what happens when a trial or a worker fails."""

    workers: int | None = option(
        None,
        "worker processes on this host, sharing the study's budget (default: one per "
        "--devices entry, else 1; run the same command on other hosts, with a shared "
        "--storage and --tracking-uri, to join)",
        at_least=1,
    )
    devices: str | Sequence[str] | None = option(
        None,
        "devices the workers are pinned to, round-robin: npu:0-7, cuda:0,cuda:1 (default: "
        "the --device for every worker; on the CPU they share its cores)",
    )
    trial_timeout_s: float | None = option(
        None,
        "a trial running longer fails with that reason (default: 25x the fp32 baseline's "
        "trial, at least 300 s; 0: no limit)",
        flag="--trial-timeout",
        metavar="SECONDS",
        at_least=0,
    )
    heartbeat_s: int = option(
        HEARTBEAT_INTERVAL_S,
        "a running trial records a heartbeat this often; one silent for 3x this (its worker "
        "died) is failed and its MLflow run closed as KILLED",
        flag="--heartbeat",
        metavar="SECONDS",
        at_least=1,
    )


@dataclass(frozen=True, kw_only=True)
class Compiled:
    """Compiled trials (training only)."""

    compile: bool = option(
        False,
        "train every trial under torch.compile, whatever its policy (fp8 layers are fast "
        "only compiled); records each trial's graph breaks and compile time, which the step "
        "time leaves out (training only; a Task(compile=True) asks for it too; on the CPU a "
        "first compile takes ~20 s)",
        study="compile",
    )


@dataclass(frozen=True, kw_only=True)
class LongerThanATrial:
    """The real run beyond the trials (training only): the long confirmation, the
    trials' schedule, the range forecast and the guard."""

    confirm_steps: int | None = option(
        None,
        "after the search, train the chosen policy K steps beside fp32 trained as long; if "
        "it does not hold there (non-finite loss, accuracy past the tolerance), confirm the "
        "next candidate, and so on (default: no confirmation)",
        metavar="K",
        study="confirm_steps",
    )
    trial_schedule: str = option(
        "as-is",
        "as-is: trials step the task's learning-rate scheduler as the real run does (a "
        "warning says when they end inside its warm-up); compressed: the real run's "
        "schedule squeezed into the trial's steps",
        choices=TRIAL_SCHEDULES,
        study="trial_schedule",
    )
    train_steps: int | None = option(
        None,
        "how long your real run trains: every trial forecasts each layer's range to step N "
        "(default: 10x --steps)",
        metavar="N",
        study="train_steps",
    )
    forecast: str = option(
        "infeasible",
        "a trial whose forecast overflows a layer's dtype within --train-steps is 'at risk': "
        "infeasible, or only warned of",
        choices=("infeasible", "warn"),
        study="forecast",
    )
    guard: bool = option(
        False,
        "your run will be guarded (best_policy.yaml gets a guard: section, so "
        "policy.apply(model) watches each low-precision layer and promotes one at risk "
        "before it fails): a trial whose forecast cannot tell is kept feasible, not trained "
        "longer, and the choice is not confirmed at --train-steps (--confirm-steps still is)",
        study_if_set="guard",  # unguarded studies keep the identity they had before it
    )


@dataclass(frozen=True, kw_only=True)
class Launch:
    """Trials across several devices (`autoprec.distributed.launch`)."""

    nproc_per_trial: int = option(
        1,
        "launch each trial through torchrun as N ranks on N devices (gloo on the CPU, nccl "
        "on CUDA, hccl on NPUs); with --devices cuda:0-7 and N=4, two trials run at once",
        metavar="N",
        study="nproc_per_trial",
        at_least=1,
    )
    parallel: str | None = option(
        None,
        "how the ranks share the model (default with N>1: ddp)",
        choices=("ddp", "fsdp2"),
        study="parallel",
    )


@dataclass(frozen=True)
class Section:
    """A section of the settings: its key in a config file, its title (the command's
    option group), its classes, and the modes it applies to: every mode's, one mode's own
    (``own``: the mode whose `Mode.settings` is this key), or those whose trials train
    (``training``: `Mode.trains`)."""

    key: str
    title: str
    classes: tuple[type, ...]
    own: bool = False
    training: bool = False

    def applies_to(self, mode: Mode) -> bool:
        if self.own:
            return mode.settings == self.key
        return mode.trains or not self.training


SERVING = Section("serving", "serving (--mode serving)", (ServingSettings,), own=True)
SECTIONS = (
    Section("what", "what is searched", (Target, Budget)),
    SERVING,
    Section("where", "where it runs and is recorded", (Where,)),
    Section("choice", "how the best policy is chosen", (Choice,)),
    Section("faults", "workers and faults", (Faults,)),
    Section("compiled", "compiled trials", (Compiled,), training=True),
    Section("longer", "longer than a trial", (LongerThanATrial,), training=True),
    Section("launch", "trials across several devices", (Launch,)),
)


def options(section: Section | None = None) -> Iterator[Option]:
    """Every declared setting (of one section), in the order of the sections."""
    for each in SECTIONS if section is None else (section,):
        for cls in each.classes:
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                meta = dict(f.metadata)
                default_flag = "--" + ("no-" if f.default is True else "") + f.name
                meta.setdefault("flag", default_flag.replace("_", "-"))
                for key in ("study", "study_if_set"):  # one key, or several
                    meta[key] = (
                        (meta[key],) if isinstance(meta.get(key), str) else meta.get(key, ())
                    )
                yield Option(f.name, each.key, hints[f.name], f.default, **meta)


# -- the config file ---------------------------------------------------------------------


def to_yaml(values: Mapping[str, Any]) -> str:
    """The settings (one value per declared name) as a config file: one mapping per
    section, under a comment with its title. `read_file` reads it back to the same."""
    import yaml

    parts = []
    for section in SECTIONS:
        body = {o.name: _plain(values[o.name]) for o in options(section)}
        text = yaml.safe_dump({section.key: body}, sort_keys=False, default_flow_style=False)
        parts.append(f"# {section.title}\n{text}")
    return "\n".join(parts)


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def read_file(path: str | Path) -> dict[str, Any]:
    """The settings a config file gives (a name per setting, as `options` names them),
    checked: a section or key that is not declared, or a value of the wrong type, is an
    AutoprecError naming the file and the key. Read with ``yaml.safe_load`` only."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise AutoprecError(f"{path}: cannot read the config file ({error})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = "" if mark is None else f"line {mark.line + 1}: "
        if isinstance(error, yaml.constructor.ConstructorError):  # !!python/object and kin
            raise AutoprecError(f"{path}: {line}not plain YAML data ({error.problem})") from None
        raise AutoprecError(f"{path}: {line}not a YAML file") from None
    if loaded is None:
        return {}
    sections = {section.key: section for section in SECTIONS}
    if not isinstance(loaded, dict):
        raise AutoprecError(f"{path}: expected sections {', '.join(sections)}")
    values: dict[str, Any] = {}
    for key, body in loaded.items():
        if key not in sections:
            raise AutoprecError(f"{path}: unknown section {key!r} (expected {', '.join(sections)})")
        declared = {o.name: o for o in options(sections[key])}
        if body is None:
            continue
        if not isinstance(body, dict):
            raise AutoprecError(f"{path}: {key}: expected a mapping of its settings")
        for name, value in body.items():
            found = declared.get(name)
            if found is None:
                raise AutoprecError(
                    f"{path}: {key}.{name}: unknown setting (section {key} has "
                    f"{', '.join(declared)})"
                )
            if not found.accepts(value):
                raise AutoprecError(f"{path}: {key}.{name}: {_expected(found)}, got {value!r}")
            values[name] = value
    return values


def _expected(found: Option, python: bool = False) -> str:
    """What a value of ``found`` must be, in words: as a config file spells it, or as
    Python does (``python``: True or False, and None said by no one)."""
    if found.choices is not None:
        what = f"one of {', '.join(found.choices)}"
    elif found.at_least == 1 and found.scalar is int and found.at_most == math.inf:
        what = "a positive integer"
    else:
        words = {int: "an integer", float: "a number", str: "a string"}
        what = (
            ("True or False" if python else "true or false")
            if found.switch
            else words[found.scalar]
        )
        bounds = [f">= {found.at_least:g}"] if math.isfinite(found.at_least) else []
        bounds += [f"<= {found.at_most:g}"] if math.isfinite(found.at_most) else []
        what += " " + " and ".join(bounds) if bounds else ""
    if found.repeated:
        return f"expected a list, each {what}"
    nullable = type(None) in typing.get_args(found.type) and not python
    return f"expected {what}{' or null' if nullable else ''}"


# -- the study's fingerprint -------------------------------------------------------------


def study_keys(mode: str) -> list[str]:
    """The keys of a study's fingerprint in ``mode``: every setting that changes a record
    of the study (what a trial measures, what is chosen), of the sections that apply to it
    (`Section.applies_to`)."""
    keys: dict[str, None] = {}
    for section in SECTIONS:
        if section.applies_to(mode_named(mode)):
            keys.update((k, None) for o in options(section) for k in o.study + o.study_if_set)
    return list(keys)


def study_settings(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The study's fingerprint: the values of `study_keys` of its mode as the search
    settled them (``resolved``, in its order: the mode, the task's name, the device's kind,
    the fitted space's fingerprint, ...). A key flagged ``study_if_set`` is left out when
    it is None; a key resolved but not declared, or declared but not resolved, is a
    mistake of the code."""
    keys = study_keys(resolved["mode"])
    optional = {k for o in options() for k in o.study_if_set}
    stray = sorted(set(resolved) - set(keys))
    missing = sorted(set(keys) - set(resolved) - optional)
    if stray or missing:
        raise ValueError(f"fingerprint: not declared {stray}, not resolved {missing}")
    return {k: v for k, v in resolved.items() if not (k in optional and v is None)}


def study_options() -> dict[str, str]:
    """The option(s) that set each key of a fingerprint, for a refusal's line
    (``batch_sizes``: ``--batch-size/--batch-sizes``)."""
    flags: dict[str, list[str]] = {}
    for o in options():
        for key in o.study + o.study_if_set:
            flags.setdefault(key, []).append(o.flag)
    return {key: "/".join(found) for key, found in flags.items()}
