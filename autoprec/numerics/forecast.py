"""Per-layer range trends and the forecast they give to the user's run length.

A trial trains for a few hundred steps; the user's run trains for thousands, and values
that drift under training overflow fp16 long after the trial has ended (logits, attention
scores, a residual stream), or shrink until they flush to zero (a decaying branch, a
vanishing gradient, a loss scale that keeps backing off). The numerics watcher records
each layer's largest |activation| (and, for layers with parameters, the largest and a low
quantile of its |gradients| as held at the loss scale) on every observed step, in the
dtype the layer runs in (`RangeSeries`).

`fit_trend` fits a series, after the first steps' transient, in one direction: toward the
dtype's largest value (``Direction.UP``) or its smallest normal (``Direction.DOWN``). A
series is flat unless its drift stands clear of its noise. A drifting one is fitted by
several models (exponential, power law, a polynomial in the step with an offset (log,
square root, linear, quadratic), saturating growth toward a ceiling), each fitted to the
earlier part of the window and checked against its last part (out of sample). Only a
model that predicts the trial's own last part is extrapolated, the one that predicts it
best; when none does, or when the models that do disagree on whether the run crosses its
limit, the trend is `TrendKind.UNCERTAIN`: the forecast cannot tell, and says so rather
than guessing (`Forecast.cannot_tell`). `forecast` projects every layer, both ways, and
the loss scale to ``train_steps``: the bits of range left now and then, and the first step
at which a layer (or the scale) would cross its limit (`Forecast.at_risk`).

All of it is pure: plain numbers in, frozen dataclasses out; the watcher, the trial and
the report call it.
"""

from __future__ import annotations

import enum
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import autoprec.formats as formats
from autoprec.formats import Limits

_FP64 = Limits(1.7976931348623157e308, 2.0**-1022, 2.0**-1074, 52)  # no format, but held
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
# The order in which a module's output dtypes are coded as a number by the watcher (its
# index + 1; 0: no floating output), widest last, so that a maximum keeps the widest.
DTYPE_ORDER: tuple[str, ...] = tuple(dict.fromkeys(_TORCH_NAMES.values()))


def element_limits() -> dict[str, Limits]:
    """The limits of each floating type a value can be held in: every format's element
    types (fp8's e4m3 and e5m2), and fp64. Below the smallest normal a value keeps fewer
    bits but still steps its weight (the zoo's gradients that went there, with their
    training holding: tiny-llama, tiny-t5, zoo-gradient-underflow, benchmarks/README.md);
    below the smallest subnormal it is lost, flushed to zero."""
    found = {"fp64": _FP64}
    for made in formats.all_formats():
        found |= {n: limits for n, limits in made.element_limits().items() if limits.mantissa_bits}
    return found


def dtype_range(dtype: str) -> tuple[float, float]:
    """(largest finite value, smallest normal) of a type a value can be held in."""
    limits = element_limits()[dtype]
    return limits.largest, limits.smallest_normal


FORECAST_MULTIPLE = 10  # --train-steps' default: this many times the trial's steps
TRANSIENT_FRACTION = 0.2  # the first fifth of the steps trained are start-up, not trend
MIN_POINTS = 6  # fewer points after the transient: no trend is claimed
SIGNIFICANCE = 3.0  # a slope counts as drift when this many standard errors from 0
NOISE_Z = 2.0  # projections carry this many robust sigmas of the series' own scatter
STORED_LAYERS = 6  # layers whose series a result keeps for the report's chart
# Out of sample: each model is fitted to the window but its last HOLDOUT_FRACTION of points
# and must predict those within VALID_Z sigmas of the series' noise (at least
# VALID_FLOOR_BITS) to be extrapolated.
HOLDOUT_FRACTION = 1 / 3
VALID_Z = 3.0
VALID_FLOOR_BITS = 0.15
# Models that predict the last part within this share of the best one's error are as good:
# when they disagree on whether the run crosses, the forecast cannot tell.
AMBIGUITY_SHARE = 0.25
AMBIGUITY_BITS = 0.01
STABLE_FACTOR = 1.5  # a crossing's distance, fitted to the earlier part and to all of it
COMPLEXITY_SHARE = 0.2  # a model with one more parameter must predict this much better
POLYNOMIAL_EXPONENTS = (0.0, 0.5, 1.0, 2.0)  # 0: the logarithm of the step
SATURATION_TIMES = (0.1, 0.2, 0.35, 0.5)  # a saturation's time constant, of the window's span
# A layer whose outputs hold at least this share of subnormal values (nonzero, below its
# dtype's smallest normal) over the trial's last third, more than over its first, has
# values shrinking into the band where they flush to zero: the forecast cannot tell. On
# the zoo's healthy tasks (fp16, 200 steps) the share stays at or below 0.7% and does not
# grow; the annealed RBF kernel's rises from 1.9% to 38% before its rows flush.
SUBNORMAL_SHARE = 0.05
# A crossing that needs more than this many times the bits its trend moved over the
# trial's window is an extrapolation the trial has not earned: the forecast cannot tell
# (and the trial is extended, where a steady trend earns it). On the zoo the crossings
# that held needed at most 2.9 times (an activation shrinking to fp16's smallest normal,
# 200 steps); a healthy classifier's logits, rising early at 100 steps, needed 5.4.
EXTRAPOLATION_LIMIT = 4.0
# A start-up transient's time constant, of the window's span: exponential or power growth
# under a saturating start (a temperature annealed under logits that saturate). Such a
# model is only a witness: it is never the trend extrapolated (on the zoo it raised false
# alarms as one), but where it predicts the trial's last part and crosses while the trend
# does not, the forecast cannot tell (and the trial is extended).
TRANSIENT_TIMES = (0.1, 0.2)
MAX_STEP = 10**9  # no projection looks further
# A crossing forecast past the horizon but within this multiple of it lies within the
# forecast's own error: on the zoo every crossing it flagged was within 2x of the real
# failure (18 of 18), and a run failing at 958 steps was forecast at ~1255 against a
# 1000-step horizon. Such a trend cannot tell (and the trial is extended, where it runs
# into the failure or the crossing moves out of the band).
NEAR_HORIZON = 2.0
# A growing trend that stays below the limit at the horizon by fewer bits than this cannot
# tell: where it levels off is itself a projection. On the zoo (fp16, 200-step trials),
# trends that held short of the limit fell short of the largest value their 2000-step run
# reached by up to 2.2 bits (tiny-gpt2's MLP outputs, saturating); no healthy or boundary
# trial's projection came within 7.1 bits of fp16's largest value (9.4 at 200 steps).
LEVEL_MARGIN_BITS = 3.0
# A learning rate still rising this much over the trial's last fifth: its warm-up has not
# ended, and what grows after it cannot be seen yet.
WARMUP_RISE = 1.1


def dtype_code(torch_dtype_name: str) -> int:
    """The watcher's number for a torch dtype (``"float16"`` -> fp16's), 0 if unknown."""
    name = _TORCH_NAMES.get(torch_dtype_name)
    return DTYPE_ORDER.index(name) + 1 if name else 0


def dtype_of_code(code: float) -> str | None:
    index = round(code) - 1
    return DTYPE_ORDER[index] if 0 <= index < len(DTYPE_ORDER) else None


class TrendKind(enum.StrEnum):
    FLAT = "flat"  # no drift that stands clear of the noise (flat, erratic, the other way)
    EXPONENTIAL = "exponential"  # log v linear in the step
    POWER = "power"  # log v linear in log step
    POLYNOMIAL = "polynomial"  # v = a + b * g(step), g: log, sqrt, linear or square
    SATURATING = "saturating"  # log v approaching a ceiling (a floor, shrinking)
    INSUFFICIENT = "insufficient"  # too few points after the transient
    UNCERTAIN = "cannot tell"  # drifting, but no model predicts the trial's last part


MOVING = (TrendKind.EXPONENTIAL, TrendKind.POWER, TrendKind.POLYNOMIAL, TrendKind.SATURATING)


class Direction(enum.IntEnum):
    """Which limit a series is watched against: the dtype's largest value or its smallest
    normal."""

    UP = 1
    DOWN = -1


class Outcome(enum.StrEnum):
    """A layer's (or a trial's) verdict at the run's length."""

    CLEAR = "clear"
    AT_RISK = "at risk"
    CANNOT_TELL = "cannot tell"


@dataclass(frozen=True)
class Trend:
    """A fitted series, in log2 of the values. The model (``kind``) is read with
    ``slope``, ``intercept`` and ``exponent``:

    - exponential: ``log2 v = intercept + slope * step``;
    - power: ``log2 v = intercept + slope * log2 step``;
    - either, with a start-up transient that decays (``exponent`` > 0): ``+ transient *
      exp(-step / exponent)`` (a head that learns fast, then the trend under it);
    - polynomial: ``v = intercept + slope * g(step)``, ``g = step ** exponent`` (log2 for 0);
    - saturating: ``log2 v = intercept + slope * exp(-step / exponent)``.

    Projections never come back past the most extreme value seen after the transient
    (``level_log2``), and carry the series' own scatter (``noise_log2``, robust sigma)
    toward the limit, so that a noisy series is projected to its peaks (troughs, shrinking),
    not its middle. ``holdout_error_bits`` is how far the model, fitted to the earlier part
    of the window, missed the last part; ``why`` says why an uncertain trend is so."""

    kind: TrendKind
    slope: float = 0.0
    intercept: float = 0.0
    noise_log2: float = 0.0
    level_log2: float = -math.inf
    first_step: int = 0
    last_step: int = 0
    exponent: float = 0.0
    direction: Direction = Direction.UP
    holdout_error_bits: float | None = None
    why: str | None = None
    transient: float = 0.0

    @property
    def grows(self) -> bool:
        """Whether the trend is extrapolated (toward its direction's limit)."""
        return self.kind in MOVING

    def model_log2(self, step: float) -> float:
        """The fitted model's log2 value at ``step``, without the noise margin."""
        kind = self.kind
        decay = self.transient * math.exp(-step / self.exponent) if self.exponent > 0 else 0.0
        if kind == TrendKind.EXPONENTIAL:
            return self.intercept + self.slope * step + decay
        if kind == TrendKind.POWER:
            return self.intercept + self.slope * math.log2(max(step, 1.0)) + decay
        if kind == TrendKind.POLYNOMIAL:
            value = self.intercept + self.slope * _power_of(step, self.exponent)
            return math.log2(value) if value > 0 else -math.inf
        if kind == TrendKind.SATURATING:
            return self.intercept + self.slope * math.exp(-step / self.exponent)
        return self.level_log2

    def log2_at(self, step: float) -> float:
        """The projected log2 of the series' extreme value at ``step``."""
        if not self.grows or step <= self.last_step:
            return self.level_log2
        margin = self.direction * NOISE_Z * self.noise_log2
        projected = self.model_log2(step) + margin
        if self.direction == Direction.UP:
            return max(self.level_log2, projected)
        return min(self.level_log2, projected)

    def reached(self, step: float, log2_limit: float) -> bool:
        return self.direction * (self.log2_at(step) - log2_limit) >= 0

    def first_step_reaching(self, log2_limit: float) -> int | None:
        """The first step after the observed ones at which the projection reaches
        ``log2_limit`` (None: never); the last observed step when it already has."""
        if self.direction * (self.level_log2 - log2_limit) >= 0:
            return self.last_step
        if not self.grows or not self.reached(MAX_STEP, log2_limit):
            return None
        low, high = self.last_step, MAX_STEP  # not reached at low, reached at high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if self.reached(middle, log2_limit) else (middle, high)
        return high


def _power_of(step: float, exponent: float) -> float:
    step = max(step, 1.0)
    return math.log2(step) if exponent == 0 else step**exponent


def _theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """The median of pairwise slopes and the median intercept: a line that a few wild
    points (a batch with an outlier) do not pull."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    if not slopes:
        return 0.0, statistics.median(ys)
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """An ordinary least-squares line, refitted once without the points more than 3.5
    robust sigmas off it (one outlying batch does not bend a model)."""
    slope, intercept = _ols(xs, ys)
    residuals = [y - intercept - slope * x for x, y in zip(xs, ys, strict=True)]
    sigma = _robust_sigma(residuals)
    if sigma > 0:
        kept = [(x, y) for x, y, r in zip(xs, ys, residuals, strict=True) if abs(r) <= 3.5 * sigma]
        if len(kept) >= 3 and len(kept) < len(xs):
            slope, intercept = _ols([x for x, _ in kept], [y for _, y in kept])
    return slope, intercept


def _two_regressors(
    xs: Sequence[float], us: Sequence[float], ys: Sequence[float]
) -> tuple[float, float, float]:
    """(slope in x, intercept, coefficient of u) of ``y = intercept + slope x + c u``, by
    least squares; a degenerate design falls back to the line in x."""
    mx, mu, my = statistics.fmean(xs), statistics.fmean(us), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    suu = sum((u - mu) ** 2 for u in us)
    sxu = sum((x - mx) * (u - mu) for x, u in zip(xs, us, strict=True))
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    suy = sum((u - mu) * (y - my) for u, y in zip(us, ys, strict=True))
    determinant = sxx * suu - sxu * sxu
    if determinant <= 1e-12 * max(sxx * suu, 1e-300):
        return (*_least_squares(xs, ys), 0.0)
    slope = (sxy * suu - suy * sxu) / determinant
    coefficient = (suy * sxx - sxy * sxu) / determinant
    return slope, my - slope * mx - coefficient * mu, coefficient


def _ols(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0, mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    return slope, mean_y - slope * mean_x


def _robust_sigma(values: Sequence[float]) -> float:
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values)


def _noise_of(ys: Sequence[float]) -> float:
    """The series' scatter from one point to the next (robust sigma of the differences,
    over sqrt 2): a trend's own rise does not count as noise."""
    differences = [b - a for a, b in itertools.pairwise(ys)]
    return _robust_sigma(differences) / math.sqrt(2) if len(differences) >= 2 else 0.0


def _drifts(xs: list[float], ys: list[float], direction: Direction) -> bool:
    """Whether the series drifts toward ``direction``'s limit clear of its scatter: a
    robust slope in the step or in log step this many standard errors from 0, and a drift
    over the window larger than the noise."""
    for x_values in (xs, [math.log2(max(x, 1.0)) for x in xs]):
        slope, intercept = _theil_sen(x_values, ys)
        slope *= direction
        residuals = [
            y - (intercept + direction * slope * x) for x, y in zip(x_values, ys, strict=True)
        ]
        sigma = _robust_sigma(residuals)
        mean_x = statistics.fmean(x_values)
        spread = math.sqrt(sum((x - mean_x) ** 2 for x in x_values))
        standard_error = sigma / spread if spread else math.inf
        rise = slope * (max(x_values) - min(x_values))
        if slope > 0 and slope > SIGNIFICANCE * standard_error and rise > NOISE_Z * sigma:
            return True
    return False


@dataclass(frozen=True)
class _Model:
    """One candidate model's shape: its kind and, for polynomials and saturation, the
    exponent or time constant it is fitted with."""

    kind: TrendKind
    exponent: float = 0.0
    transient: bool = False  # exponential or power: with a decaying start-up term

    def fit(self, ts: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
        """(slope, intercept, transient) of this model fitted to steps ``ts`` and log2
        values ``ys``."""
        if self.kind in (TrendKind.EXPONENTIAL, TrendKind.POWER):
            xs = (
                list(ts)
                if self.kind == TrendKind.EXPONENTIAL
                else [math.log2(max(t, 1.0)) for t in ts]
            )
            if self.transient:
                return _two_regressors(xs, [math.exp(-t / self.exponent) for t in ts], ys)
            return (*_least_squares(xs, ys), 0.0)
        if self.kind == TrendKind.POLYNOMIAL:
            xs = [_power_of(t, self.exponent) for t in ts]
            return (*_least_squares(xs, [2.0**y for y in ys]), 0.0)
        return (*_least_squares([math.exp(-t / self.exponent) for t in ts], ys), 0.0)

    def moves(self, slope: float, direction: Direction) -> bool:
        """Whether a fit with ``slope`` heads toward ``direction``'s limit."""
        sign = -1 if self.kind == TrendKind.SATURATING else 1
        return sign * slope * direction > 0


def _models(span: float, direction: Direction) -> list[_Model]:
    """The candidate models. Polynomials only for growth: one that shrinks reaches 0 at a
    finite step, which |values| that scale down (and so underflow) never do."""
    polynomials = [_Model(TrendKind.POLYNOMIAL, p) for p in POLYNOMIAL_EXPONENTS]
    transients = [
        _Model(kind, share * span, transient=True)
        for kind in (TrendKind.EXPONENTIAL, TrendKind.POWER)
        for share in TRANSIENT_TIMES
    ]
    return [
        _Model(TrendKind.EXPONENTIAL),
        _Model(TrendKind.POWER),
        *transients,
        *(polynomials if direction == Direction.UP else []),
        *(_Model(TrendKind.SATURATING, share * span) for share in SATURATION_TIMES),
    ]


def _residuals(trend: Trend, ts: Sequence[float], ys: Sequence[float]) -> list[float]:
    """Observed minus modelled log2 values; a model that leaves the positive values (a
    polynomial crossing 0) misses by 64 bits."""
    out = []
    for t, y in zip(ts, ys, strict=True):
        modelled = trend.model_log2(t)
        out.append(y - modelled if math.isfinite(modelled) else 64.0)
    return out


@dataclass(frozen=True)
class _Candidate:
    trend: Trend  # fitted to the whole window
    holdout_error_bits: float  # the earlier part's fit, against the last part
    crossing: int | None  # within the horizon (None: not)
    early_crossing: int | None = None  # the earlier part's fit's, where the whole's crosses
    just_past: int | None = None  # past the horizon, within ``NEAR_HORIZON`` times it

    @property
    def stable(self) -> bool:
        """Whether a crossing holds as the trial goes on: the fit to the earlier part puts
        it within ``STABLE_FACTOR`` of the distance the fit to the whole window does (a
        growth that slows down moves its crossing later and later: not yet earned)."""
        if self.crossing is None:
            return True
        if self.early_crossing is None:
            return False
        last = self.trend.last_step
        ahead, early = max(self.crossing - last, 1), max(self.early_crossing - last, 1)
        return ahead / STABLE_FACTOR <= early <= ahead * STABLE_FACTOR

    @property
    def rank(self) -> float:
        """The out-of-sample error, a model with a start-up term (one parameter more)
        counted ``COMPLEXITY_SHARE`` worse: it wins only where it predicts clearly better."""
        extra = 1 + COMPLEXITY_SHARE if self.trend.transient else 1.0
        return self.holdout_error_bits * extra


def fit_trend(
    steps: Sequence[int],
    values: Sequence[float],
    trial_steps: int | None = None,
    *,
    direction: Direction = Direction.UP,
    log2_limit: float | None = None,
    horizon: int | None = None,
    noise_floor_bits: float = 0.0,
    start_step: float = 0.0,
    near_horizon: float = NEAR_HORIZON,
) -> Trend:
    """The trend of a series (one value per observed step) after the start-up transient
    (the first ``TRANSIENT_FRACTION`` of ``trial_steps``, default the last observed step),
    toward ``direction``'s limit. Values that are not finite and positive are left out.

    With ``log2_limit`` and ``horizon`` the models that predict the trial's last part are
    asked whether they cross the limit by the horizon: when the best and those nearly as
    good disagree the trend is uncertain; when no model predicts the last part, it is
    uncertain only if some model would cross (a trend no model would take past the limit is
    clear however it wanders). ``noise_floor_bits``: the least scatter the series has (the
    loss scale moves in whole bits); ``start_step``: a later start of the window (the end
    of the learning rate's warm-up); ``near_horizon``: a crossing past the horizon but
    within this multiple of it cannot tell (1: none)."""
    points = [
        (int(s), math.log2(v))
        for s, v in zip(steps, values, strict=True)
        if isinstance(v, int | float) and math.isfinite(v) and v > 0
    ]
    if not points:
        return Trend(TrendKind.INSUFFICIENT, direction=direction)
    last_step = max(s for s, _ in points)
    start = max(TRANSIENT_FRACTION * (trial_steps if trial_steps else last_step), start_step)
    window = [(s, y) for s, y in points if s >= max(start, 1)]
    extreme = max if direction == Direction.UP else min
    level = extreme((y for _, y in window), default=extreme(y for _, y in points))
    first = window[0][0] if window else last_step
    base = Trend(
        TrendKind.INSUFFICIENT,
        level_log2=level,
        first_step=first,
        last_step=last_step,
        direction=direction,
    )
    if len(window) < MIN_POINTS:
        return base
    ts = [float(s) for s, _ in window]
    ys = [y for _, y in window]
    noise = max(_noise_of(ys), noise_floor_bits)
    if not _drifts(ts, ys, direction) or max(ys) - min(ys) <= NOISE_Z * noise_floor_bits:
        return replace(base, kind=TrendKind.FLAT, noise_log2=noise)
    candidates = _candidates(ts, ys, base, noise, log2_limit, horizon, near_horizon)
    judged = log2_limit is not None and horizon is not None
    return _choose(candidates, base, noise, judged, log2_limit)


def _candidates(
    ts: list[float],
    ys: list[float],
    base: Trend,
    noise: float,
    log2_limit: float | None,
    horizon: int | None,
    near_horizon: float = NEAR_HORIZON,
) -> list[_Candidate]:
    """Every model that heads toward the limit, fitted to the whole window, with its
    out-of-sample error and its crossing within the horizon (or near past it)."""
    held = max(2, round(HOLDOUT_FRACTION * len(ts)))
    early_ts, early_ys = ts[:-held], ys[:-held]
    out = []
    for model in _models(ts[-1] - ts[0], base.direction):
        slope, intercept, transient = model.fit(ts, ys)
        if not model.moves(slope, base.direction):
            continue
        whole = replace(
            base,
            kind=model.kind,
            slope=slope,
            intercept=intercept,
            exponent=model.exponent,
            transient=transient,
        )
        early_slope, early_intercept, early_transient = model.fit(early_ts, early_ys)
        early = replace(
            whole, slope=early_slope, intercept=early_intercept, transient=early_transient
        )
        missed = _residuals(early, ts[-held:], ys[-held:])
        error = math.sqrt(statistics.fmean(r * r for r in missed))
        scatter = _robust_sigma(_residuals(whole, ts, ys))
        whole = replace(whole, noise_log2=max(scatter, noise), holdout_error_bits=error)
        crossing = early_crossing = just_past = None
        if log2_limit is not None and horizon is not None:
            reach = whole.first_step_reaching(log2_limit)
            crossing = reach if reach is not None and reach <= horizon else None
            if reach is not None and horizon < reach <= near_horizon * horizon:
                just_past = reach
            if crossing is not None:
                early_crossing = replace(early, noise_log2=whole.noise_log2).first_step_reaching(
                    log2_limit
                )
        out.append(_Candidate(whole, error, crossing, early_crossing, just_past))
    return out


def _choose(
    candidates: list[_Candidate],
    base: Trend,
    noise: float,
    judged: bool,
    log2_limit: float | None = None,
) -> Trend:
    """The model that predicts the last part best, if it predicts it; uncertain where the
    models that predict it disagree on crossing, none does and some would cross, or its
    crossing needs more than ``EXTRAPOLATION_LIMIT`` times the bits it moved over the
    window."""
    tolerance = max(VALID_Z * noise, VALID_FLOOR_BITS)
    witnesses = [c for c in candidates if c.trend.transient and c.holdout_error_bits <= tolerance]
    candidates = [c for c in candidates if not c.trend.transient]
    valid = sorted(
        (c for c in candidates if c.holdout_error_bits <= tolerance),
        key=lambda c: c.rank,
    )
    crossing = [c for c in candidates if c.crossing is not None]
    if not valid:
        if judged and not crossing:
            return replace(base, kind=TrendKind.FLAT, noise_log2=noise)
        best = min(candidates, key=lambda c: c.holdout_error_bits, default=None)
        missed = f"{best.holdout_error_bits:.2f}" if best else "?"
        return replace(
            base,
            kind=TrendKind.UNCERTAIN,
            noise_log2=noise,
            holdout_error_bits=best.holdout_error_bits if best else None,
            why=f"no trend predicts the trial's last part (the best misses it by {missed} bits)",
        )
    best = valid[0]
    why = _unclear_why(best, valid, witnesses, log2_limit) if judged else None
    if why is None:
        return best.trend
    return replace(
        base,
        kind=TrendKind.UNCERTAIN,
        noise_log2=noise,
        holdout_error_bits=best.holdout_error_bits,
        why=why,
    )


def _unclear_why(
    best: _Candidate,
    valid: list[_Candidate],
    witnesses: list[_Candidate],
    log2_limit: float | None,
) -> str | None:
    """Why the best model's verdict cannot be trusted, if it cannot: its crossing moves as
    the trial goes on, models nearly as good disagree on crossing, the crossing needs more
    than ``EXTRAPOLATION_LIMIT`` times the bits the trend moved, a start-up-transient
    witness crosses where the best does not, or its crossing lies just past the horizon
    (within ``NEAR_HORIZON`` times it)."""
    near = [c for c in valid if c.rank <= (1 + AMBIGUITY_SHARE) * best.rank + AMBIGUITY_BITS]
    if not best.stable:
        return (
            f"its crossing moves as the trial goes on ({best.trend.kind}: at step "
            f"~{best.early_crossing} from the trial's earlier part, ~{best.crossing} "
            "from all of it)"
        )
    if any((c.crossing is None) != (best.crossing is None) for c in near):
        crossing_one = next(c for c in near if c.crossing is not None)
        return (
            f"trends that predict the trial's last part disagree ({crossing_one.trend.kind} "
            f"crosses at step ~{crossing_one.crossing}, another does not)"
        )
    if best.crossing is not None and log2_limit is not None:
        trend = best.trend
        now = trend.model_log2(trend.last_step)
        moved = (now - trend.model_log2(trend.first_step)) * trend.direction
        needed = (log2_limit - now) * trend.direction
        if math.isfinite(moved) and needed > EXTRAPOLATION_LIMIT * max(moved, 0.0):
            return (
                f"its crossing at step ~{best.crossing} ({trend.kind}) needs "
                f"{needed:.1f} bits more, {needed / max(moved, 1e-9):.1f} times what it "
                "moved over the trial: an extrapolation the trial has not earned"
            )
    witness = next((c for c in witnesses if c.crossing is not None), None)
    if best.crossing is None and witness is not None:
        return (
            f"may go on under its saturating start ({witness.trend.kind} growth "
            f"after a start-up transient also predicts the trial's last part, and crosses "
            f"at step ~{witness.crossing})"
        )
    if best.crossing is None and best.just_past is not None:
        return (
            f"crosses at step ~{best.just_past} ({best.trend.kind}), past the run's length "
            f"but within {NEAR_HORIZON:g}x of it: within the forecast's own error"
        )
    return None


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
    # The share of each observed step's outputs that are subnormal in their dtype.
    act_subnormal: dict[str, list[float]] = field(default_factory=dict)

    def add_activation(
        self, layer: str, step: int, amax: float, dtype: str | None, subnormal_share: float = 0.0
    ) -> None:
        self.steps.setdefault(layer, []).append(step)
        self.act_max.setdefault(layer, []).append(amax)
        self.act_subnormal.setdefault(layer, []).append(subnormal_share)
        if dtype is not None:
            self.dtypes[layer] = dtype

    def add_gradient(self, layer: str, step: int, gmax: float, glow: float) -> None:
        self.grad_steps.setdefault(layer, []).append(step)
        self.grad_max.setdefault(layer, []).append(gmax)
        self.grad_low.setdefault(layer, []).append(glow)


@dataclass(frozen=True)
class Headroom:
    """One layer's range, now and projected to ``Forecast.train_steps``, in bits.

    Overflow: log2 of the dtype's largest value over the layer's largest |activation|
    (``headroom_now_bits``, ``forecast_bits_at_n``, ``crossing_step``, ``trend``).
    Underflow: log2 of the smallest of its largest |activation| after the transient over
    the dtype's smallest normal (``underflow_now_bits``, ``underflow_bits_at_n``,
    ``underflow_crossing_step``, ``underflow_trend``): a layer whose every output shrinks
    below it is flushing to zero. For layers with parameters, the largest |gradient| (at the
    loss scale) against the largest value and, shrinking, against the smallest subnormal,
    where it is flushed to zero (``grad_crossing_step``), and a low quantile of them against
    the smallest normal.
    ``outcome`` is the layer's verdict; ``why`` says why it cannot tell."""

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
    # The overflow fit, so that the report can draw the projection.
    slope: float = 0.0
    intercept: float = 0.0
    noise_log2: float = 0.0
    level_log2: float = 0.0
    last_step: int = 0
    exponent: float = 0.0
    transient: float = 0.0
    # The underflow side: the activations' largest shrinking toward the smallest normal.
    underflow_now_bits: float | None = None
    underflow_bits_at_n: float | None = None
    underflow_crossing_step: int | None = None
    underflow_trend: str = "flat"
    low_slope: float = 0.0
    low_intercept: float = 0.0
    low_noise_log2: float = 0.0
    low_level_log2: float = 0.0
    low_exponent: float = 0.0
    low_transient: float = 0.0
    # The gradients' largest shrinking toward the smallest normal.
    grad_crossing_step: int | None = None
    grad_trend: str = "flat"
    # The largest unscaled |gradient| growing past the largest value over the scale's floor.
    grad_overflow_step: int | None = None
    grad_overflow_trend: str = "flat"
    grad_unscaled_max: float | None = None
    # The share of its outputs that were subnormal over the trial's last third, where it
    # grew to SUBNORMAL_SHARE or more.
    subnormal_share: float | None = None
    outcome: str = "clear"
    why: str | None = None

    def _trend(self, low: bool) -> Trend:
        if low:
            return Trend(
                _kind(self.underflow_trend),
                self.low_slope,
                self.low_intercept,
                self.low_noise_log2,
                self.low_level_log2,
                last_step=self.last_step,
                exponent=self.low_exponent,
                direction=Direction.DOWN,
                transient=self.low_transient,
            )
        return Trend(
            _kind(self.trend),
            self.slope,
            self.intercept,
            self.noise_log2,
            self.level_log2,
            last_step=self.last_step,
            exponent=self.exponent,
            transient=self.transient,
        )

    def projected_amax(self, step: int) -> float:
        """The projected largest |activation| at ``step`` (the report's chart): toward the
        largest value where it grows, toward the smallest normal where it shrinks."""
        low = not self._trend(False).grows and self._trend(True).grows
        return 2.0 ** self._trend(low).log2_at(step)

    @property
    def first_crossing(self) -> tuple[int, str] | None:
        """The layer's first crossing within the run that breaks it, and its side
        (overflow, underflow, a collapsing scale). Its gradients' flush to zero
        (``grad_crossing_step``) is not one: it is where the layer stops learning, which
        the forecast cannot tell the cost of (`_with_outcome`)."""
        sides = [
            (self.crossing_step, "overflow"),
            (self.underflow_crossing_step, "underflow"),
            (self.grad_overflow_step, "a collapsing scale"),
        ]
        crossing = [(step, side) for step, side in sides if step is not None]
        return min(crossing) if crossing else None


def _kind(name: str) -> TrendKind:
    try:
        return TrendKind(name)
    except ValueError:
        return TrendKind.FLAT


@dataclass(frozen=True)
class ScaleForecast:
    """The dynamic loss scale's trend (the scale each step used) toward its floor (the
    scaler's ``min_scale``, at least 1: below it skipped steps are the policy's failure)."""

    floor: float
    now: float
    crossing_step: int | None
    trend: str
    bits_now: float
    bits_at_n: float
    why: str | None = None


@dataclass(frozen=True)
class Forecast:
    """Every observed layer's headroom, the first to cross (then the least headroom)
    first, the observed series of the ``STORED_LAYERS`` first, the loss scale's trend, and
    what the trial did about a forecast that cannot tell: ``extended_steps`` (the steps it
    trained past its own to see more; 0: none) and ``path`` (what was, or is to be, done)."""

    train_steps: int
    trial_steps: int
    layers: tuple[Headroom, ...] = ()
    series: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    scale: ScaleForecast | None = None
    warmup: str | None = None  # the learning rate still warming up at the trial's end
    extended_steps: int = 0
    path: str | None = None
    broken: str | None = None  # the extended trial broke (a non-finite loss, a stuck scaler)
    broken_step: int | None = None  # the step it broke at

    @property
    def first_crossing(self) -> Headroom | None:
        """The layer that would cross its dtype's largest value first, within the run."""
        crossing = [h for h in self.layers if h.crossing_step is not None]
        return min(crossing, key=lambda h: h.crossing_step or 0) if crossing else None

    @property
    def first_underflow(self) -> Headroom | None:
        """The layer whose activations or gradients would shrink below the smallest normal
        first, within the run."""
        found = [
            (step, h)
            for h in self.layers
            for step in (h.underflow_crossing_step, h.grad_crossing_step)
            if step is not None
        ]
        return min(found, key=lambda pair: pair[0])[1] if found else None

    @property
    def min_headroom_bits(self) -> float | None:
        """The least headroom any layer is forecast to have at ``train_steps``."""
        return min((h.forecast_bits_at_n for h in self.layers), default=None)

    @property
    def min_headroom_now_bits(self) -> float | None:
        return min((h.headroom_now_bits for h in self.layers), default=None)

    @property
    def min_underflow_bits(self) -> float | None:
        """The least room above the smallest normal forecast at ``train_steps``."""
        values = [h.underflow_bits_at_n for h in self.layers if h.underflow_bits_at_n is not None]
        return min(values, default=None)

    @property
    def min_underflow_now_bits(self) -> float | None:
        values = [h.underflow_now_bits for h in self.layers if h.underflow_now_bits is not None]
        return min(values, default=None)

    def crossing(self) -> tuple[int, str] | None:
        """The first crossing within the run, of any side, with its reason: where the
        extended trial broke, the step it broke at (seen, not forecast)."""
        within = f"within --train-steps {self.train_steps}"
        if self.broken is not None and self.broken_step is not None:
            return self.broken_step, f"{self.broken}, {within}"
        found: list[tuple[int, str]] = []
        for h in self.layers:
            largest, smallest = dtype_range(h.dtype)
            if h.crossing_step is not None:
                found.append(
                    (
                        h.crossing_step,
                        f"{h.layer} ({h.dtype}) passes {largest:g} at step ~{h.crossing_step} "
                        f"(its largest |activation| now {h.observed_amax:.3g}, growing, "
                        f"{h.trend}), {within}",
                    )
                )
            if h.underflow_crossing_step is not None:
                low = smallest * 2.0 ** (h.underflow_now_bits or 0.0)
                found.append(
                    (
                        h.underflow_crossing_step,
                        f"{h.layer} ({h.dtype}) shrinks below {smallest:g} (its smallest "
                        f"normal) at step ~{h.underflow_crossing_step} (its largest "
                        f"|activation| now {low:.3g}, shrinking, {h.underflow_trend}): "
                        f"underflow, {within}",
                    )
                )
            if h.grad_overflow_step is not None:
                found.append(
                    (
                        h.grad_overflow_step,
                        f"{h.layer}'s gradients ({h.dtype}) pass {largest:g} even at the loss "
                        f"scale's floor at step ~{h.grad_overflow_step} (the largest unscaled "
                        f"|gradient| now {h.grad_unscaled_max or 0:.3g}, growing, "
                        f"{h.grad_overflow_trend}): a collapsing scale, {within}",
                    )
                )
        scale = self.scale
        if scale is not None and scale.crossing_step is not None:
            found.append(
                (
                    scale.crossing_step,
                    f"the loss scale falls to {scale.floor:g} at step ~{scale.crossing_step} "
                    f"(now {scale.now:g}, collapsing, {scale.trend}): a collapsing scale, "
                    f"{within}",
                )
            )
        return min(found, key=lambda pair: pair[0]) if found else None

    def at_risk(self) -> str | None:
        """Why the run would fail at its length, naming the layer, dtype, side and step."""
        if self.broken is not None:
            return f"at risk: forecast: {self.broken}, within --train-steps {self.train_steps}"
        if self.warmup is not None:
            return None  # what the warm-up grew is no trend: the forecast cannot tell
        first = self.crossing()
        return None if first is None else f"at risk: forecast: {first[1]}"

    @property
    def outcome(self) -> Outcome:
        if self.at_risk() is not None:
            return Outcome.AT_RISK
        return Outcome.CANNOT_TELL if self._unclear() else Outcome.CLEAR

    def _unclear(self) -> str | None:
        if self.warmup is not None:
            return self.warmup
        for h in self.layers:
            if h.outcome == Outcome.CANNOT_TELL:
                return f"{h.layer} ({h.dtype}): {h.why}"
        if self.scale is not None and self.scale.why:
            return f"the loss scale: {self.scale.why}"
        return None

    def cannot_tell(self) -> str | None:
        """Why the forecast cannot tell whether the run holds (None: it can, or it is at
        risk). It never makes a trial infeasible: the trial is extended, or the finalists
        confirmed at the run's length (``path``)."""
        if self.at_risk() is not None:
            return None
        why = self._unclear()
        if why is None:
            return None
        done = f"; {self.path}" if self.path else ""
        return f"cannot tell: forecast: {why}{done}"

    def metrics(self) -> dict[str, float]:
        """What MLflow holds per trial: the least headroom now and at the run's length (to
        the largest value and to the smallest normal), the first crossings where there are
        some, whether the forecast could tell, and the steps a trial was extended by."""
        values: dict[str, float] = {}
        if self.min_headroom_now_bits is not None:
            values["headroom_now_bits"] = self.min_headroom_now_bits
        if self.min_headroom_bits is not None:
            values["forecast_min_headroom_bits"] = self.min_headroom_bits
        first = self.first_crossing
        if first is not None and first.crossing_step is not None:
            values["forecast_crossing_step"] = float(first.crossing_step)
        if self.min_underflow_now_bits is not None:
            values["underflow_headroom_now_bits"] = self.min_underflow_now_bits
        if self.min_underflow_bits is not None:
            values["forecast_min_underflow_bits"] = self.min_underflow_bits
        low = self.first_underflow
        if low is not None:
            step = min(
                s for s in (low.underflow_crossing_step, low.grad_crossing_step) if s is not None
            )
            values["forecast_underflow_crossing_step"] = float(step)
        if self.scale is not None and self.scale.crossing_step is not None:
            values["forecast_scale_crossing_step"] = float(self.scale.crossing_step)
        values["forecast_cannot_tell"] = 1.0 if self.cannot_tell() else 0.0
        values["forecast_extended_steps"] = float(self.extended_steps)
        return {k: v for k, v in values.items() if math.isfinite(v)}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = [json_floats(asdict(h)) for h in self.layers]
        data["scale"] = None if self.scale is None else json_floats(asdict(self.scale))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Forecast:
        known = {f.name for f in fields(Headroom)}
        layers = tuple(
            Headroom(**{k: v for k, v in restored_floats(layer).items() if k in known})
            for layer in data.get("layers", [])
        )
        scale = data.get("scale")
        return cls(
            int(data["train_steps"]),
            int(data["trial_steps"]),
            layers,
            data.get("series", {}),
            None if not scale else ScaleForecast(**restored_floats(scale)),
            data.get("warmup"),
            int(data.get("extended_steps") or 0),
            data.get("path"),
            data.get("broken"),
            data.get("broken_step"),
        )

    def with_path(self, path: str) -> Forecast:
        return replace(self, path=path)

    def with_broken(self, broken: str, step: int | None = None) -> Forecast:
        return replace(self, broken=broken, broken_step=step)


def json_floats(values: dict[str, Any]) -> dict[str, Any]:
    """Infinite floats as strings, so that JSON stores (Optuna, summary.json) keep them."""
    return {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in values.items()}


def restored_floats(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(v) if v in ("inf", "-inf") else v) for k, v in values.items()}


def _bits(limit: float, log2_value: float) -> float:
    return math.log2(limit) - log2_value


def _within(step: int | None, horizon: int) -> int | None:
    return step if step is not None and step <= horizon else None


def headroom(
    layer: str,
    dtype: str,
    steps: Sequence[int],
    amax: Sequence[float],
    train_steps: int,
    trial_steps: int | None = None,
    start_step: float = 0.0,
) -> Headroom:
    """One layer's activation headroom now and at ``train_steps`` in ``dtype``, toward
    its largest value and toward its smallest normal (fitted from ``start_step`` at the
    earliest)."""
    largest, smallest = dtype_range(dtype)
    top, bottom = math.log2(largest), math.log2(smallest)
    finite = [v for v in amax if math.isfinite(v) and v > 0]
    observed = max(finite, default=0.0)
    if observed <= 0:
        return Headroom(layer, dtype, 0.0, math.inf, math.inf, None, str(TrendKind.INSUFFICIENT))
    up = fit_trend(
        steps, amax, trial_steps, log2_limit=top, horizon=train_steps, start_step=start_step
    )
    down = fit_trend(
        steps,
        amax,
        trial_steps,
        direction=Direction.DOWN,
        log2_limit=bottom,
        horizon=train_steps,
        start_step=start_step,
    )
    now = _bits(largest, math.log2(observed))
    at_n = _bits(largest, up.log2_at(train_steps))
    low_level = down.level_log2 if math.isfinite(down.level_log2) else math.log2(min(finite))
    low_now = low_level - bottom
    low_at_n = min(low_now, down.log2_at(train_steps) - bottom)
    unclear = [t for t in (up, down) if t.kind == TrendKind.UNCERTAIN]
    crossing = _within(up.first_step_reaching(top), train_steps)
    why = _why(unclear[0]) if unclear else None
    if why is None and crossing is None and up.grows and at_n < LEVEL_MARGIN_BITS:
        why = (
            f"its growth ({up.kind}) comes within {at_n:.1f} bits of {largest:g} by step "
            f"{train_steps}: inside the {LEVEL_MARGIN_BITS:g}-bit margin a projected level "
            "needs"
        )
    return Headroom(
        layer,
        dtype,
        observed,
        now,
        min(now, at_n),
        crossing,
        str(up.kind),
        slope=up.slope,
        intercept=up.intercept,
        noise_log2=up.noise_log2,
        level_log2=up.level_log2 if math.isfinite(up.level_log2) else 0.0,
        last_step=up.last_step,
        exponent=up.exponent,
        transient=up.transient,
        underflow_now_bits=low_now,
        underflow_bits_at_n=low_at_n,
        underflow_crossing_step=_within(down.first_step_reaching(bottom), train_steps),
        underflow_trend=str(down.kind),
        low_slope=down.slope,
        low_intercept=down.intercept,
        low_noise_log2=down.noise_log2,
        low_level_log2=low_level,
        low_exponent=down.exponent,
        low_transient=down.transient,
        why=why,
    )


def _why(trend: Trend) -> str:
    way = "growth" if trend.direction == Direction.UP else "shrinking"
    return f"its {way} {trend.why or 'fits no trend'}"


def _follows_the_loss(
    steps: Sequence[int], gradients: Sequence[float], losses: Sequence[float], trial_steps: int
) -> bool:
    """Whether gradients shrink only as the loss does (a model converging: its gradients
    are due to vanish, and their flushing to zero costs nothing): their ratio to the loss on
    the same steps does not drift down."""
    if not losses:
        return False
    ratio = [
        (s, g / losses[s])
        for s, g in zip(steps, gradients, strict=True)
        if 0 <= s < len(losses) and math.isfinite(losses[s]) and losses[s] > 0
    ]
    start = TRANSIENT_FRACTION * trial_steps
    window = [(s, math.log2(r)) for s, r in ratio if s >= start and math.isfinite(r) and r > 0]
    if len(window) < MIN_POINTS:
        return False
    xs, ys = [float(s) for s, _ in window], [y for _, y in window]
    return not _drifts(xs, ys, Direction.DOWN)


def _with_gradients(
    room: Headroom,
    series: RangeSeries,
    train_steps: int,
    trial_steps: int | None,
    losses: Sequence[float] = (),
    start_step: float = 0.0,
    scaling: tuple[Sequence[float], float] | None = None,
) -> Headroom:
    """``room`` with its layer's gradient headroom: the largest |gradient| against the
    dtype's largest value now, and shrinking against its smallest normal (now, at
    ``train_steps`` and its crossing), and a low quantile against the smallest normal.
    ``scaling``: the loss scale of each step and the least it can fall to (1 without
    scaling): the largest unscaled |gradient| growing past the dtype's largest value over
    that floor is a scale that must collapse (``grad_overflow_step``)."""
    steps = series.grad_steps.get(room.layer)
    if not steps:
        return room
    largest, smallest = dtype_range(room.dtype)
    gmax = max((v for v in series.grad_max[room.layer] if math.isfinite(v)), default=0.0)
    lows = [v for v in series.grad_low[room.layer] if math.isfinite(v) and v > 0]
    underflow_now = underflow_at_n = None
    if lows:
        underflow_now = math.log2(min(lows) / smallest)
        shrink = fit_trend(
            steps,
            series.grad_low[room.layer],
            trial_steps,
            direction=Direction.DOWN,
            start_step=start_step,
        )
        underflow_at_n = min(underflow_now, shrink.log2_at(train_steps) - math.log2(smallest))
    flush = element_limits()[room.dtype].smallest_subnormal
    largest_shrink = fit_trend(
        steps,
        series.grad_max[room.layer],
        trial_steps,
        direction=Direction.DOWN,
        log2_limit=math.log2(flush),
        horizon=train_steps,
        start_step=start_step,
        near_horizon=1.0,  # a flush past the run is no failure within it, nor near one
    )
    if largest_shrink.kind != TrendKind.FLAT and _follows_the_loss(
        steps, series.grad_max[room.layer], losses, trial_steps or max(steps)
    ):
        largest_shrink = replace(largest_shrink, kind=TrendKind.FLAT, why=None)
    crossing = None
    if gmax > 0:
        crossing = _within(largest_shrink.first_step_reaching(math.log2(flush)), train_steps)
    why = room.why
    if why is None and largest_shrink.kind == TrendKind.UNCERTAIN:
        why = f"its gradients' shrinking {largest_shrink.why}"
    overflow_step, overflow_trend, unscaled_now = None, "flat", None
    if scaling is not None:
        scales, floor = scaling
        unscaled = [
            g / scales[step] if 0 <= step < len(scales) and scales[step] > 0 else math.nan
            for step, g in zip(steps, series.grad_max[room.layer], strict=True)
        ]
        limit = math.log2(largest / max(floor, 1.0))
        growth = fit_trend(
            steps,
            unscaled,
            trial_steps,
            log2_limit=limit,
            horizon=train_steps,
            start_step=start_step,
        )
        seen = [v for v in unscaled if math.isfinite(v) and v > 0]
        unscaled_now = seen[-1] if seen else None
        if growth.grows:
            overflow_step = _within(growth.first_step_reaching(limit), train_steps)
        overflow_trend = str(growth.kind)
        if why is None and growth.kind == TrendKind.UNCERTAIN:
            why = f"its gradients' growth {growth.why}"
    return replace(
        room,
        grad_overflow_step=overflow_step,
        grad_overflow_trend=overflow_trend,
        grad_unscaled_max=unscaled_now,
        grad_max=gmax,
        grad_headroom_now_bits=_bits(largest, math.log2(gmax)) if gmax > 0 else None,
        grad_underflow_now_bits=underflow_now,
        grad_underflow_bits_at_n=underflow_at_n,
        grad_crossing_step=crossing,
        grad_trend=str(largest_shrink.kind),
        why=why,
    )


def _with_subnormals(room: Headroom, series: RangeSeries) -> Headroom:
    """``room`` that cannot tell where a growing share of its outputs sits in the subnormal
    band (at least ``SUBNORMAL_SHARE`` over the trial's last third, more than over its
    first): values shrinking toward a flush to zero that the largest |activation| does not
    show (a normalised kernel's rows whose every value flushes, a softmax's tail). What
    they break when they flush is in no range."""
    shares = series.act_subnormal.get(room.layer) or []
    third = len(shares) // 3
    if third < 2 or room.why is not None or _reference_sides(room.dtype)[1]:
        return room  # fp32's smallest normal (fp32's, bf16's) fails the baseline alike
    first, last = statistics.fmean(shares[:third]), statistics.fmean(shares[-third:])
    if last < SUBNORMAL_SHARE or last <= first:
        return room
    _, smallest = dtype_range(room.dtype)
    return replace(
        room,
        subnormal_share=last,
        why=(
            f"{last:.0%} of its outputs are subnormal (nonzero, below {smallest:g}), up from "
            f"{first:.1%} early in the trial: values shrinking toward a flush to zero"
        ),
    )


def _reference_sides(dtype: str) -> tuple[bool, bool]:
    """Whether ``dtype``'s range is as wide as fp32's toward its largest value and toward
    its smallest normal: fp32's own, fp64's, and bf16's (its largest within a bit of
    fp32's, its smallest normal fp32's)."""
    largest, smallest = dtype_range(dtype)
    reference = formats.reference().limits
    return largest >= reference.largest / 2, smallest <= reference.smallest_normal


def _beyond_the_reference(room: Headroom) -> Headroom:
    """``room`` without the crossings of a limit fp32 shares: every accuracy is measured
    against fp32 trained the same way, so a limit as far as fp32's fails the baseline as it
    fails the policy, and is no risk of the policy's precision (a layer in fp32 whose
    gradients sit below 2**-126, an attention saturated from its first steps, trains as
    in the baseline). A range fp32's on both sides is not judged, nor extended."""
    up, down = _reference_sides(room.dtype)
    if down:
        room = replace(room, underflow_crossing_step=None, grad_crossing_step=None)
    if up:
        room = replace(room, crossing_step=None, grad_overflow_step=None)
    return replace(room, why=None) if up and down else room


def _with_outcome(room: Headroom) -> Headroom:
    """``room`` with its verdict: at risk where a crossing breaks the run within it;
    cannot tell where its gradients are forecast to flush to zero (the layer stops
    learning there, and whether the run holds without what it had left to learn is in no
    range: the zoo's gradient-underflow task holds through its flush, while tiny-t5's
    forecast flush never came), or where a trend cannot be told; else clear."""
    room = _beyond_the_reference(room)
    if room.first_crossing is not None:
        return replace(room, outcome=str(Outcome.AT_RISK))
    if room.grad_crossing_step is not None and room.why is None:
        room = replace(
            room,
            why=(
                f"its gradients flush to zero at step ~{room.grad_crossing_step} "
                f"(the largest |gradient| at the loss scale shrinking, {room.grad_trend}): "
                "whether the run holds once the layer stops learning is in no range"
            ),
        )
    if room.why is not None:
        return replace(room, outcome=str(Outcome.CANNOT_TELL))
    return replace(room, outcome=str(Outcome.CLEAR))


def scale_forecast(
    loss_scales: Sequence[float],
    floor: float,
    train_steps: int,
    trial_steps: int,
    start_step: float = 0.0,
) -> ScaleForecast | None:
    """The dynamic loss scale's trend (one value per step) toward ``floor``."""
    if not loss_scales:
        return None
    floor = max(floor, 1.0)
    trend = fit_trend(
        range(len(loss_scales)),
        loss_scales,
        trial_steps,
        direction=Direction.DOWN,
        log2_limit=math.log2(floor),
        horizon=train_steps,
        noise_floor_bits=0.5,  # a dynamic scale moves in halvings
        start_step=start_step,
    )
    now = float(loss_scales[-1])
    at_n = min(math.log2(max(now, 1e-300)), trend.log2_at(train_steps))
    crossing = _within(trend.first_step_reaching(math.log2(floor)), train_steps)
    if crossing is not None and now <= floor:
        crossing = None  # at its floor already: the trial's own skips judge it
    return ScaleForecast(
        floor,
        now,
        crossing,
        str(trend.kind),
        math.log2(max(now, 1e-300)) - math.log2(floor),
        at_n - math.log2(floor),
        f"its trend {trend.why}" if trend.kind == TrendKind.UNCERTAIN else None,
    )


def warmup_end(learning_rates: Sequence[float]) -> int | None:
    """The step at which the learning rate's warm-up ends (its first step at its largest
    value, where it rose to it by more than ``WARMUP_RISE``); None without a warm-up."""
    if len(learning_rates) < 5:
        return None
    peak = max(learning_rates)
    first = learning_rates[0]
    if not peak > 0 or (first > 0 and peak <= WARMUP_RISE * first):
        return None
    return next(i for i, lr in enumerate(learning_rates) if lr == peak)


def warmup_note(
    learning_rates: Sequence[float],
    trial_steps: int,
    planned_peak: tuple[int, float] | None = None,
) -> str | None:
    """Why the forecast cannot tell when the learning rate is still warming up at the
    trial's end, ended its warm-up too late in it to see what follows, or (``planned_peak``:
    the first step at the schedule's largest rate within the run, and that rate) rises past
    the rates trained so far after them, as a constant warm-up's step up does: what grows
    from its peak on is not in the trial yet, and what grew during it is no trend."""
    if len(learning_rates) < 5:
        return None
    end = warmup_end(learning_rates)
    seen = len(learning_rates)
    if end is not None and (1 - TRANSIENT_FRACTION) * seen <= end < seen - 1:
        return (
            f"the learning rate's warm-up ended at step {end}, too late in the trial (to "
            f"step {seen}) to see what follows it"
        )
    trained = max(learning_rates)
    if planned_peak is not None and trained > 0:
        peak_step, peak_lr = planned_peak
        if peak_step >= seen - 1 and peak_lr > WARMUP_RISE * trained:
            return (
                f"the learning rate rises to {peak_lr:.3g} at step {peak_step} of the "
                f"schedule, past the {seen} steps trained (at {trained:.3g} at most): what "
                "grows at that rate is not in the trial yet"
            )
    earlier = learning_rates[int((1 - TRANSIENT_FRACTION) * (len(learning_rates) - 1))]
    last = learning_rates[-1]
    if earlier > 0 and last > WARMUP_RISE * earlier and last >= trained:
        return (
            f"the learning rate is still warming up at the trial's end (step {trial_steps}, "
            f"{last:.3g}, from {earlier:.3g} a fifth earlier): what grows after its peak is "
            "not in the trial yet"
        )
    return None


def forecast(
    series: RangeSeries,
    train_steps: int,
    trial_steps: int,
    *,
    loss_scales: Sequence[float] = (),
    scale_floor: float | None = None,
    learning_rates: Sequence[float] = (),
    planned_peak: tuple[int, float] | None = None,
    losses: Sequence[float] = (),
    extended_steps: int = 0,
) -> Forecast:
    """Every layer of ``series`` projected to ``train_steps`` (see the module's
    docstring), the first to cross first, then the least headroom; ties keep the order in
    which the layers completed their forwards (an origin before the parents that only pass
    its values on). ``loss_scales`` (one per step) and ``scale_floor`` (None: no dynamic
    scaling): the scale's own trend; ``learning_rates`` (one per step): whether the warm-up
    has ended within the trial, and ``planned_peak`` (the schedule's first step at its
    largest rate within ``train_steps``, and that rate): whether it rises after the trial;
    ``losses`` (one per step): gradients that shrink only as
    the loss does are a model converging, not underflowing."""
    rooms = []
    start = float(warmup_end(learning_rates) or 0)  # trends start when the warm-up ends
    # The start-up transient is the first fifth of every step trained, the extension's
    # too: an extended trial's trend is fitted to its later steps, where the run is going.
    trained = trial_steps + extended_steps
    scaling = None
    if loss_scales:  # the floor: the dynamic scaler's, else the scale it holds (1: none)
        scaling = (loss_scales, scale_floor if scale_floor is not None else min(loss_scales))
    held = element_limits()
    for layer, steps in series.steps.items():
        dtype = series.dtypes.get(layer)
        if dtype is None or dtype not in held:
            continue
        amax = series.act_max[layer]
        room = headroom(layer, dtype, steps, amax, train_steps, trained, start)
        room = _with_gradients(room, series, train_steps, trained, losses, start, scaling)
        room = _with_subnormals(room, series)
        rooms.append(_with_outcome(room))
    order = {room.layer: i for i, room in enumerate(rooms)}

    def first(h: Headroom) -> float:
        crossing = h.first_crossing
        return math.inf if crossing is None else crossing[0]

    rooms.sort(key=lambda h: (first(h), h.forecast_bits_at_n, order[h.layer]))
    kept = {
        h.layer: {
            "steps": [float(s) for s in series.steps[h.layer]],
            "amax": series.act_max[h.layer],
        }
        for h in rooms[:STORED_LAYERS]
    }
    scale = None
    if scale_floor is not None:
        scale = scale_forecast(loss_scales, scale_floor, train_steps, trained, start)
    narrow = scale is not None or any(not all(_reference_sides(h.dtype)) for h in rooms)
    # A warm-up that has not ended leaves only ranges fp32's could never cross unjudged.
    warmup = warmup_note(learning_rates, trained, planned_peak) if narrow else None
    return Forecast(train_steps, trial_steps, tuple(rooms), kept, scale, warmup, extended_steps)


def default_train_steps(trial_steps: int) -> int:
    """--train-steps' default: ``FORECAST_MULTIPLE`` times the trial's steps."""
    return FORECAST_MULTIPLE * trial_steps


def forecast_brief(data: dict[str, Any]) -> dict[str, Any] | None:
    """What summary.json keeps of a trial's forecast: the run's length, the least
    headroom (to the largest value and to the smallest normal), the first crossing of
    each side, the outcome and what was done when it cannot tell, the loss scale's trend,
    the layers with the least headroom and their series."""
    if not data:
        return None
    ahead = Forecast.from_dict(data)
    first = ahead.first_crossing
    low = ahead.first_underflow
    low_step = None
    if low is not None:
        low_step = min(
            s for s in (low.underflow_crossing_step, low.grad_crossing_step) if s is not None
        )
    return {
        "train_steps": ahead.train_steps,
        "trial_steps": ahead.trial_steps,
        "outcome": str(ahead.outcome),
        "min_headroom_now_bits": _finite_number(ahead.min_headroom_now_bits),
        "min_headroom_bits": _finite_number(ahead.min_headroom_bits),
        "crossing_step": None if first is None else first.crossing_step,
        "crossing_layer": None if first is None else first.layer,
        "min_underflow_now_bits": _finite_number(ahead.min_underflow_now_bits),
        "min_underflow_bits": _finite_number(ahead.min_underflow_bits),
        "underflow_crossing_step": low_step,
        "underflow_crossing_layer": None if low is None else low.layer,
        "scale": None if ahead.scale is None else json_floats(asdict(ahead.scale)),
        "cannot_tell": ahead.cannot_tell(),
        "extended_steps": ahead.extended_steps,
        "path": ahead.path,
        "layers": [json_floats(asdict(h)) for h in ahead.layers[:STORED_LAYERS]],
        "series": ahead.series,
    }


def _finite_number(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


HEADROOM_COLUMNS = (
    "dtype",
    "headroom_now_bits",
    "forecast_bits_at_n",
    "crossing_step",
    "trend",
    "underflow_now_bits",
    "underflow_bits_at_n",
    "underflow_crossing_step",
    "underflow_trend",
    "grad_crossing_step",
    "outcome",
)


def with_headroom(rows: list[dict[str, Any]], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-layer telemetry rows (by ``name``) with each layer's headroom columns, for
    the table a trial's MLflow run holds; empty cells where a layer has no forecast."""
    rooms = {h["layer"]: h for h in (data or {}).get("layers", [])}
    return [
        {**row, **{c: rooms.get(row.get("name"), {}).get(c) for c in HEADROOM_COLUMNS}}
        for row in rows
    ]
