"""The loss-scale part of a space: the modes and ranges searched (the ``loss_scale``
section), its Optuna parameters (``loss_scale.mode``, ``loss_scale.init_scale_log2``...),
and the `LossScale` they give. Only a mode whose space rules scale the loss searches it,
and only where some group is fp16."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from autoprec.errors import PolicyError, SpaceError
from autoprec.precision.loss_scale import LOSS_SCALE_MODES, LossScale

Fail = Callable[[str], SpaceError]


class Suggester(Protocol):
    """What a space needs from an Optuna trial (``optuna.Trial`` satisfies it)."""

    def suggest_categorical(self, name: str, choices: Any) -> Any: ...

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int: ...


# Settings searched on an integer range (both ends equal: fixed).
RANGE_FIELDS = {
    "static_scale_log2": (0, 24),
    "init_scale_log2": (16, 16),
    "growth_interval": (2000, 2000),
    "hysteresis": (1, 1),
}
# Dynamic-scaling settings searched as a choice among listed values (one value: fixed).
CHOICE_FIELDS: dict[str, tuple[float, ...]] = {
    "growth_factor": (2.0,),
    "backoff_factor": (0.5,),
    "min_scale": (0.0,),
}
_TORCH_DEFAULTS = {
    "static_scale_log2": 16,
    "init_scale_log2": 16,
    "growth_interval": 2000,
    "hysteresis": 1,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "min_scale": 0.0,
}
_DYNAMIC_FIELDS = (
    "init_scale_log2",
    "growth_interval",
    "hysteresis",
    "growth_factor",
    "backoff_factor",
    "min_scale",
)


@dataclass(frozen=True)
class LossScaleSpace:
    modes: tuple[str, ...] = ("none", "static", "dynamic")
    ranges: Mapping[str, tuple[int, int]] = field(default_factory=lambda: dict(RANGE_FIELDS))
    choices: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: dict(CHOICE_FIELDS))


def mode_fields(mode: str) -> tuple[str, ...]:
    """The settings a loss-scale mode has."""
    return {"static": ("static_scale_log2",), "dynamic": _DYNAMIC_FIELDS}.get(mode, ())


# -- reading the section ----------------------------------------------------------------


def read_loss_scale(data: Any, fail: Fail) -> LossScaleSpace:
    """The ``loss_scale`` section (None: the defaults)."""
    if data is None:
        return LossScaleSpace()
    if not isinstance(data, dict):
        raise fail("loss_scale: expected a mapping")
    known = ["modes", *RANGE_FIELDS, *CHOICE_FIELDS]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise fail(f"loss_scale.{unknown[0]}: unknown field (expected {', '.join(known)})")
    modes = _read_modes(data, fail)
    ranges = dict(RANGE_FIELDS)
    ranges.update({key: _read_range(key, data[key], fail) for key in RANGE_FIELDS if key in data})
    choices = dict(CHOICE_FIELDS)
    choices.update(
        {key: _read_choices(key, data[key], fail) for key in CHOICE_FIELDS if key in data}
    )
    return LossScaleSpace(modes, ranges, choices)


def _read_modes(data: dict[str, Any], fail: Fail) -> tuple[str, ...]:
    modes = data.get("modes", list(LOSS_SCALE_MODES))
    if not isinstance(modes, list) or not modes or any(m not in LOSS_SCALE_MODES for m in modes):
        raise fail(
            f"loss_scale.modes: expected a list drawn from none, static, dynamic; got {modes!r}"
        )
    return tuple(dict.fromkeys(modes))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read_range(key: str, value: Any, fail: Fail) -> tuple[int, int]:
    """``[low, high]`` integers (one integer: a fixed value), within what the key allows."""
    if _is_int(value):
        value = [value, value]
    pair = isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)
    if not pair or value[0] > value[1]:
        raise fail(
            f"loss_scale.{key}: expected [low, high] integers with low <= high, got {value!r}"
        )
    minimum = 0 if key.endswith("log2") else 1
    if value[0] < minimum or (key.endswith("log2") and value[1] > 64):
        raise fail(f"loss_scale.{key}: out of range, got {value!r}")
    return (value[0], value[1])


def _read_choices(key: str, value: Any, fail: Fail) -> tuple[float, ...]:
    """A list of numbers (one number: a fixed value), each a valid setting on its own."""
    if _is_number(value):
        value = [value]
    if not (isinstance(value, list) and value and all(_is_number(v) for v in value)):
        raise fail(f"loss_scale.{key}: expected a list of numbers, got {value!r}")
    try:
        for v in value:
            setting: dict[str, Any] = {key: float(v)}
            LossScale("dynamic", **setting)
    except PolicyError as error:
        raise fail(str(error)) from None
    return tuple(float(v) for v in dict.fromkeys(value))


# -- parameters --------------------------------------------------------------------------


def suggest_loss_scale(space: LossScaleSpace, trial: Suggester) -> dict[str, Any]:
    """Ask the trial for the mode, then for each of its settings that is not fixed."""
    mode = trial.suggest_categorical("loss_scale.mode", list(space.modes))
    params: dict[str, Any] = {"loss_scale.mode": mode}
    for key in mode_fields(mode):
        name = f"loss_scale.{key}"
        if key in space.choices:
            if len(space.choices[key]) > 1:
                params[name] = trial.suggest_categorical(name, list(space.choices[key]))
            continue
        low, high = space.ranges[key]
        if low != high:
            params[name] = trial.suggest_int(name, low, high, log=key == "growth_interval")
    return params


def torch_default_params(space: LossScaleSpace) -> dict[str, Any]:
    """Dynamic scaling with torch's defaults where the space allows it (as Apex O1/O2 or
    GradScaler would), each clipped to the space's range."""
    enabled = [m for m in space.modes if m != "none"]
    mode = "dynamic" if "dynamic" in enabled else (enabled[0] if enabled else "none")
    params: dict[str, Any] = {"loss_scale.mode": mode}
    for key in mode_fields(mode):
        default = _TORCH_DEFAULTS[key]
        if key in space.choices:
            options = space.choices[key]
            if len(options) > 1:
                params[f"loss_scale.{key}"] = default if default in options else options[0]
            continue
        low, high = space.ranges[key]
        if low != high:
            params[f"loss_scale.{key}"] = min(max(default, low), high)
    return params


def loss_scale_of(space: LossScaleSpace, params: Mapping[str, Any], fp16: bool) -> LossScale:
    """The scaling the parameters set (missing values take the low end of their range,
    or the first choice); none where nothing is ``fp16``."""
    mode = params.get("loss_scale.mode", "none")
    if mode == "none" or not fp16:
        return LossScale()

    def value(key: str) -> Any:
        if key in space.choices:
            return float(params.get(f"loss_scale.{key}", space.choices[key][0]))
        return int(params.get(f"loss_scale.{key}", space.ranges[key][0]))

    if mode == "static":
        return LossScale("static", init_scale=2.0 ** value("static_scale_log2"))
    init_scale = 2.0 ** value("init_scale_log2")
    return LossScale(
        "dynamic",
        init_scale=init_scale,
        growth_interval=value("growth_interval"),
        hysteresis=value("hysteresis"),
        growth_factor=value("growth_factor"),
        backoff_factor=value("backoff_factor"),
        min_scale=min(value("min_scale"), init_scale),
    )


def flat_loss_scale(scale: LossScale) -> dict[str, str]:
    """The same keys for every scaling (``-`` where the mode has no such setting)."""
    dynamic = scale.mode == "dynamic"
    flat = {
        "loss_scale.mode": scale.mode,
        "loss_scale.init_scale": "-" if scale.mode == "none" else f"{scale.init_scale:g}",
        "loss_scale.growth_interval": str(scale.growth_interval) if dynamic else "-",
        "loss_scale.hysteresis": str(scale.hysteresis) if dynamic else "-",
    }
    for key in ("growth_factor", "backoff_factor", "min_scale"):
        flat[f"loss_scale.{key}"] = f"{getattr(scale, key):g}" if dynamic else "-"
    return flat
