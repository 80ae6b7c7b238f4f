"""Per-layer range trends and the forecast they give to the user's run length.

A trial trains for a few hundred steps; the user's run trains for thousands, and
activations that grow under training (logits, attention scores, a residual stream)
overflow fp16 long after the trial has ended. The numerics watcher records each layer's
largest |activation| (and, for layers with parameters, the largest and a low quantile of
its |gradients| as held at the loss scale) on every observed step, in the dtype the
layer runs in (`RangeSeries`). `fit_trend` fits each series in log space over the window
after the first steps' transient, choosing between exponential growth (log amax linear
in the step) and a power law (log amax linear in log step) by which fits better, and
calls a series flat unless its growth stands clear of its noise. `forecast` projects
every layer to ``train_steps`` and says how many bits of range are left now and then,
and at which step the first layer would cross its dtype's largest value.

All of it is pure: plain numbers in, frozen dataclasses out; the watcher, the trial and
the report call it.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# (largest finite value, smallest normal) of each dtype a value can be held in.
DTYPE_RANGES: dict[str, tuple[float, float]] = {
    "fp8_e4m3": (448.0, 2.0**-6),
    "fp8_e5m2": (57344.0, 2.0**-14),
    "fp16": (65504.0, 2.0**-14),
    "bf16": (3.3895313892515355e38, 2.0**-126),
    "fp32": (3.4028234663852886e38, 2.0**-126),
    "fp64": (1.7976931348623157e308, 2.0**-1022),
}
# The order in which a module's output dtypes are coded as a number by the watcher (its
# index + 1; 0: no floating output), widest last, so that a maximum keeps the widest.
DTYPE_ORDER: tuple[str, ...] = tuple(DTYPE_RANGES)
_TORCH_NAMES = {
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fnuz": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "float8_e5m2fnuz": "fp8_e5m2",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
}

FORECAST_MULTIPLE = 10  # --train-steps' default: this many times the trial's steps
TRANSIENT_FRACTION = 0.2  # the first fifth of the trial's steps are start-up, not trend
MIN_POINTS = 6  # fewer points after the transient: no trend is claimed
SIGNIFICANCE = 3.0  # a slope counts as growth when this many standard errors above 0
NOISE_Z = 2.0  # projections carry this many robust sigmas of the series' own scatter
TIE_SHARE = 0.1  # fits whose scatter differs by less than this: the gentler one wins
STORED_LAYERS = 6  # layers whose series a result keeps for the report's chart


def dtype_code(torch_dtype_name: str) -> int:
    """The watcher's number for a torch dtype (``"float16"`` -> fp16's), 0 if unknown."""
    name = _TORCH_NAMES.get(torch_dtype_name)
    return DTYPE_ORDER.index(name) + 1 if name else 0


def dtype_of_code(code: float) -> str | None:
    index = round(code) - 1
    return DTYPE_ORDER[index] if 0 <= index < len(DTYPE_ORDER) else None


class TrendKind(enum.StrEnum):
    FLAT = "flat"  # no growth that stands clear of the noise (flat, decaying, erratic)
    EXPONENTIAL = "exponential"  # log amax linear in the step
    POWER = "power"  # log amax linear in log step
    INSUFFICIENT = "insufficient"  # too few points after the transient


@dataclass(frozen=True)
class Trend:
    """A fitted series, in log2 of the values: ``log2 v = intercept + slope * x`` with x
    the step (exponential) or log2 of the step (power). Projections never go below the
    largest value seen after the transient (``level_log2``), and growth carries the
    series' own scatter (``noise_log2``, robust sigma) on top, so that a noisy series
    is projected to its peaks, not its middle."""

    kind: TrendKind
    slope: float = 0.0
    intercept: float = 0.0
    noise_log2: float = 0.0
    level_log2: float = -math.inf
    first_step: int = 0
    last_step: int = 0

    @property
    def grows(self) -> bool:
        return self.kind in (TrendKind.EXPONENTIAL, TrendKind.POWER)

    def log2_at(self, step: float) -> float:
        """The projected log2 of the series' largest value at ``step``."""
        if not self.grows or step <= self.last_step:
            return self.level_log2
        x = step if self.kind == TrendKind.EXPONENTIAL else math.log2(step)
        return max(self.level_log2, self.intercept + self.slope * x + NOISE_Z * self.noise_log2)

    def first_step_reaching(self, log2_limit: float) -> int | None:
        """The first step after the observed ones at which the projection reaches
        ``log2_limit`` (None: never); the last observed step when it already has."""
        if self.level_log2 >= log2_limit:
            return self.last_step
        if not self.grows:
            return None
        x = (log2_limit - NOISE_Z * self.noise_log2 - self.intercept) / self.slope
        if self.kind == TrendKind.POWER:
            if x > 1000:  # past any step a run can reach
                return None
            x = 2.0**x
        return max(self.last_step + 1, math.ceil(x))


def _theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """The median of pairwise slopes and the median intercept: a line that a few wild
    points (a batch with an outlier) do not pull."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))


def _robust_sigma(values: Sequence[float]) -> float:
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values)


@dataclass(frozen=True)
class _Fit:
    kind: TrendKind
    slope: float
    intercept: float
    sigma: float
    significant: bool


def _fit(kind: TrendKind, xs: list[float], ys: list[float]) -> _Fit:
    slope, intercept = _theil_sen(xs, ys)
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    sigma = _robust_sigma(residuals)
    mean_x = statistics.fmean(xs)
    spread = math.sqrt(sum((x - mean_x) ** 2 for x in xs))
    # The slope's standard error from the robust scatter; the rise over the window must
    # also stand clear of the scatter, so that a tiny but steady drift is not growth.
    standard_error = sigma / spread if spread else math.inf
    rise = slope * (max(xs) - min(xs))
    significant = slope > SIGNIFICANCE * standard_error and rise > NOISE_Z * sigma
    return _Fit(kind, slope, intercept, sigma, significant and slope > 0)


def fit_trend(
    steps: Sequence[int],
    values: Sequence[float],
    trial_steps: int | None = None,
) -> Trend:
    """The trend of a layer's largest values (one per observed step) after the start-up
    transient (the first ``TRANSIENT_FRACTION`` of ``trial_steps``, default the last
    observed step). Values that are not finite and positive are left out."""
    points = [
        (int(s), math.log2(v))
        for s, v in zip(steps, values, strict=True)
        if isinstance(v, int | float) and math.isfinite(v) and v > 0
    ]
    if not points:
        return Trend(TrendKind.INSUFFICIENT)
    last_step = max(s for s, _ in points)
    start = TRANSIENT_FRACTION * (trial_steps if trial_steps else last_step)
    window = [(s, y) for s, y in points if s >= max(start, 1)]
    level = max((y for _, y in window), default=max(y for _, y in points))
    first = window[0][0] if window else last_step
    if len(window) < MIN_POINTS:
        return Trend(
            TrendKind.INSUFFICIENT, level_log2=level, first_step=first, last_step=last_step
        )
    ys = [y for _, y in window]
    fits = [
        _fit(TrendKind.EXPONENTIAL, [float(s) for s, _ in window], ys),
        _fit(TrendKind.POWER, [math.log2(s) for s, _ in window], ys),
    ]
    exponential, power = fits
    best = exponential if exponential.sigma < (1 - TIE_SHARE) * power.sigma else power
    if not best.significant:
        noise = min(f.sigma for f in fits)
        return Trend(TrendKind.FLAT, 0.0, level, noise, level, first, last_step)
    return Trend(best.kind, best.slope, best.intercept, best.sigma, level, first, last_step)


@dataclass
class RangeSeries:
    """Per layer, the steps observed and the largest |activation| on each, the dtype its
    outputs were held in, and for layers with parameters the largest and a low quantile
    of their |gradients| as held at the loss scale (filled by the numerics watcher)."""

    steps: dict[str, list[int]] = field(default_factory=dict)
    act_max: dict[str, list[float]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    grad_steps: dict[str, list[int]] = field(default_factory=dict)
    grad_max: dict[str, list[float]] = field(default_factory=dict)
    grad_low: dict[str, list[float]] = field(default_factory=dict)

    def add_activation(self, layer: str, step: int, amax: float, dtype: str | None) -> None:
        self.steps.setdefault(layer, []).append(step)
        self.act_max.setdefault(layer, []).append(amax)
        if dtype is not None:
            self.dtypes[layer] = dtype

    def add_gradient(self, layer: str, step: int, gmax: float, glow: float) -> None:
        self.grad_steps.setdefault(layer, []).append(step)
        self.grad_max.setdefault(layer, []).append(gmax)
        self.grad_low.setdefault(layer, []).append(glow)


@dataclass(frozen=True)
class Headroom:
    """One layer's range, now and projected to ``Forecast.train_steps``, in bits (log2 of
    the dtype's largest value over the layer's largest |activation|). For layers with
    parameters, the same for their gradients, and against the smallest normal from a low
    quantile of their nonzero |gradients| (at the loss scale)."""

    layer: str
    dtype: str
    observed_amax: float
    headroom_now_bits: float
    forecast_bits_at_n: float
    crossing_step: int | None
    trend: str
    grad_max: float | None = None
    grad_headroom_now_bits: float | None = None
    grad_underflow_now_bits: float | None = None
    grad_underflow_bits_at_n: float | None = None
    # The fit, so that the report can draw the projection.
    slope: float = 0.0
    intercept: float = 0.0
    noise_log2: float = 0.0
    level_log2: float = 0.0
    last_step: int = 0

    def projected_amax(self, step: int) -> float:
        """The projected largest |activation| at ``step`` (the report's chart)."""
        trend = Trend(
            TrendKind(self.trend),
            self.slope,
            self.intercept,
            self.noise_log2,
            self.level_log2,
            last_step=self.last_step,
        )
        return 2.0 ** trend.log2_at(step)


@dataclass(frozen=True)
class Forecast:
    """Every observed layer's headroom, the least first, and the observed series of the
    ``STORED_LAYERS`` with the least (for the report)."""

    train_steps: int
    trial_steps: int
    layers: tuple[Headroom, ...] = ()
    series: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @property
    def first_crossing(self) -> Headroom | None:
        """The layer that would cross its dtype's largest value first, within the run."""
        crossing = [h for h in self.layers if h.crossing_step is not None]
        return min(crossing, key=lambda h: h.crossing_step or 0) if crossing else None

    @property
    def min_headroom_bits(self) -> float | None:
        """The least headroom any layer is forecast to have at ``train_steps``."""
        return min((h.forecast_bits_at_n for h in self.layers), default=None)

    @property
    def min_headroom_now_bits(self) -> float | None:
        return min((h.headroom_now_bits for h in self.layers), default=None)

    def at_risk(self) -> str | None:
        """Why the run would fail at its length, naming the layer, dtype and step."""
        first = self.first_crossing
        if first is None:
            return None
        limit = DTYPE_RANGES[first.dtype][0]
        return (
            f"at risk: forecast: {first.layer} ({first.dtype}) passes {limit:g} at step "
            f"~{first.crossing_step} (its largest |activation| now {first.observed_amax:.3g}, "
            f"growing, {first.trend}), within --train-steps {self.train_steps}"
        )

    def metrics(self) -> dict[str, float]:
        """What MLflow holds per trial: the least headroom now and at the run's length,
        and the first crossing step where there is one."""
        values: dict[str, float] = {}
        if self.min_headroom_now_bits is not None:
            values["headroom_now_bits"] = self.min_headroom_now_bits
        if self.min_headroom_bits is not None:
            values["forecast_min_headroom_bits"] = self.min_headroom_bits
        first = self.first_crossing
        if first is not None and first.crossing_step is not None:
            values["forecast_crossing_step"] = float(first.crossing_step)
        return {k: v for k, v in values.items() if math.isfinite(v)}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = [json_floats(asdict(h)) for h in self.layers]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Forecast:
        layers = tuple(Headroom(**restored_floats(layer)) for layer in data.get("layers", []))
        return cls(
            int(data["train_steps"]), int(data["trial_steps"]), layers, data.get("series", {})
        )


def json_floats(values: dict[str, Any]) -> dict[str, Any]:
    """Infinite floats as strings, so that JSON stores (Optuna, summary.json) keep them."""
    return {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in values.items()}


def restored_floats(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(v) if v in ("inf", "-inf") else v) for k, v in values.items()}


def _bits(limit: float, log2_value: float) -> float:
    return math.log2(limit) - log2_value


def headroom(
    layer: str,
    dtype: str,
    steps: Sequence[int],
    amax: Sequence[float],
    train_steps: int,
    trial_steps: int | None = None,
) -> Headroom:
    """One layer's activation headroom now and at ``train_steps`` in ``dtype``."""
    limit = DTYPE_RANGES[dtype][0]
    trend = fit_trend(steps, amax, trial_steps)
    finite = [v for v in amax if math.isfinite(v) and v > 0]
    observed = max(finite, default=0.0)
    now = _bits(limit, math.log2(observed)) if observed > 0 else math.inf
    at_n = _bits(limit, trend.log2_at(train_steps)) if observed > 0 else math.inf
    crossing = trend.first_step_reaching(math.log2(limit)) if observed > 0 else None
    if crossing is not None and crossing > train_steps:
        crossing = None
    return Headroom(
        layer,
        dtype,
        observed,
        now,
        min(now, at_n),
        crossing,
        str(trend.kind),
        slope=trend.slope,
        intercept=trend.intercept,
        noise_log2=trend.noise_log2,
        level_log2=trend.level_log2 if math.isfinite(trend.level_log2) else 0.0,
        last_step=trend.last_step,
    )


def _with_gradients(
    room: Headroom, series: RangeSeries, train_steps: int, trial_steps: int | None
) -> Headroom:
    """``room`` with its layer's gradient headroom: the largest |gradient| against the
    dtype's largest value, and a low quantile against its smallest normal, now and (the
    quantile's shrinking fitted as the growth of its reciprocal) at ``train_steps``."""
    steps = series.grad_steps.get(room.layer)
    if not steps:
        return room
    largest, smallest = DTYPE_RANGES[room.dtype]
    gmax = max((v for v in series.grad_max[room.layer] if math.isfinite(v)), default=0.0)
    lows = [v for v in series.grad_low[room.layer] if math.isfinite(v) and v > 0]
    underflow_now = underflow_at_n = None
    if lows:
        underflow_now = math.log2(min(lows) / smallest)
        inverse = [
            1.0 / v if math.isfinite(v) and v > 0 else math.nan for v in series.grad_low[room.layer]
        ]
        shrink = fit_trend(steps, inverse, trial_steps)
        underflow_at_n = min(underflow_now, -shrink.log2_at(train_steps) - math.log2(smallest))
    return replace(
        room,
        grad_max=gmax,
        grad_headroom_now_bits=_bits(largest, math.log2(gmax)) if gmax > 0 else None,
        grad_underflow_now_bits=underflow_now,
        grad_underflow_bits_at_n=underflow_at_n,
    )


def forecast(series: RangeSeries, train_steps: int, trial_steps: int) -> Forecast:
    """Every layer of ``series`` projected to ``train_steps`` (see the module's
    docstring), the least headroom first; ties in the crossing step keep the order in
    which the layers completed their forwards (an origin before the parents that only
    pass its values on)."""
    rooms = []
    for layer, steps in series.steps.items():
        dtype = series.dtypes.get(layer)
        if dtype is None or dtype not in DTYPE_RANGES:
            continue
        room = headroom(layer, dtype, steps, series.act_max[layer], train_steps, trial_steps)
        rooms.append(_with_gradients(room, series, train_steps, trial_steps))
    order = {room.layer: i for i, room in enumerate(rooms)}
    rooms.sort(
        key=lambda h: (
            h.crossing_step if h.crossing_step is not None else math.inf,
            h.forecast_bits_at_n,
            order[h.layer],
        )
    )
    kept = {
        h.layer: {
            "steps": [float(s) for s in series.steps[h.layer]],
            "amax": series.act_max[h.layer],
        }
        for h in rooms[:STORED_LAYERS]
    }
    return Forecast(train_steps, trial_steps, tuple(rooms), kept)


def default_train_steps(trial_steps: int) -> int:
    """--train-steps' default: ``FORECAST_MULTIPLE`` times the trial's steps."""
    return FORECAST_MULTIPLE * trial_steps


def forecast_brief(data: dict[str, Any]) -> dict[str, Any] | None:
    """What summary.json keeps of a trial's forecast: the run's length, the least
    headroom, the first crossing, the layers with the least headroom and their series."""
    if not data:
        return None
    ahead = Forecast.from_dict(data)
    first = ahead.first_crossing
    return {
        "train_steps": ahead.train_steps,
        "trial_steps": ahead.trial_steps,
        "min_headroom_now_bits": _finite_number(ahead.min_headroom_now_bits),
        "min_headroom_bits": _finite_number(ahead.min_headroom_bits),
        "crossing_step": None if first is None else first.crossing_step,
        "crossing_layer": None if first is None else first.layer,
        "layers": [json_floats(asdict(h)) for h in ahead.layers[:STORED_LAYERS]],
        "series": ahead.series,
    }


def _finite_number(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


HEADROOM_COLUMNS = ("dtype", "headroom_now_bits", "forecast_bits_at_n", "crossing_step", "trend")


def with_headroom(rows: list[dict[str, Any]], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-layer telemetry rows (by ``name``) with each layer's headroom columns, for
    the table a trial's MLflow run holds; empty cells where a layer has no forecast."""
    rooms = {h["layer"]: h for h in (data or {}).get("layers", [])}
    return [
        {**row, **{c: rooms.get(row.get("name"), {}).get(c) for c in HEADROOM_COLUMNS}}
        for row in rows
    ]
