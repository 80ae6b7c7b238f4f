"""The range forecast in the search's views (issue 21): the console lines under the
front table, and the report's headroom chart per layer (observed, projected to the
run's length, the dtype's limit) with the trials at risk."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from autoprec.numerics.forecast import (
    FORECAST_MULTIPLE,
    MOVING,
    Forecast,
    Headroom,
    dtype_range,
)
from autoprec.report.plots import saved
from autoprec.study.summary_schema import Entry, Summary, as_summary

MAX_CHARTS = 6  # layers charted
MAX_LINES = 5  # trials at risk named on the console


def _brief(entry: Entry) -> dict[str, Any] | None:
    brief = (entry.telemetry or {}).get("forecast")
    return brief if isinstance(brief, dict) and brief.get("train_steps") else None


def _rooms(brief: dict[str, Any]) -> dict[str, Headroom]:
    return {h.layer: h for h in Forecast.from_dict({**brief, "series": {}}).layers}


def horizon_text(summary: Summary | dict[str, Any]) -> str | None:
    """``forecast to step 2000 (default: 10x the trial's 200 steps)``."""
    summary = as_summary(summary)
    brief = next((b for e in summary.entries if (b := _brief(e))), None)
    if brief is None:
        return None
    given = summary.settings.values.get("train_steps_asked")
    how = (
        "--train-steps"
        if given
        else f"default: {FORECAST_MULTIPLE}x the trial's {brief['trial_steps']} steps"
    )
    return f"forecast to step {brief['train_steps']} ({how})"


def at_risk(summary: Summary) -> list[tuple[Entry, str]]:
    """The trials whose forecast crosses within the run, with the reason."""
    return [
        (e, reason)
        for e in summary.entries
        if (reason := (e.telemetry or {}).get("at_risk")) and isinstance(reason, str)
    ]


def cannot_tell(summary: Summary) -> list[tuple[Entry, str]]:
    """The trials whose forecast cannot tell, with why and the path taken (they stay
    feasible)."""
    return [
        (e, reason)
        for e in summary.entries
        if (reason := (e.telemetry or {}).get("cannot_tell")) and isinstance(reason, str)
    ]


def forecast_lines(summary: Summary | dict[str, Any]) -> list[str]:
    """The console's lines: the horizon, the trials at risk, those it cannot tell and what
    was done about them, the chosen one's headroom."""
    summary = as_summary(summary)
    horizon = horizon_text(summary)
    if horizon is None:
        return []
    warns = summary.settings.values.get("forecast") == "warn"
    risky = at_risk(summary)
    verdict = "warned of (--forecast warn)" if warns else "infeasible"
    lines = [f"{horizon}: {len(risky)} trial(s) at risk, {verdict}" if risky else horizon]
    for entry, reason in risky[:MAX_LINES]:
        lines.append(f"  {entry.label}: {reason.removeprefix('at risk: forecast: ')}")
    unclear = cannot_tell(summary)
    if unclear:
        lines.append(f"{len(unclear)} trial(s) the forecast cannot tell (kept feasible):")
        for entry, reason in unclear[:MAX_LINES]:
            lines.append(f"  {entry.label}: {reason.removeprefix('cannot tell: forecast: ')}")
    brief = _brief(summary.best)
    if brief is not None and brief.get("min_headroom_bits") is not None:
        layer = (brief.get("layers") or [{}])[0].get("layer", "?")
        lines.append(
            f"chosen policy: least headroom at step {brief['train_steps']}: "
            f"{brief['min_headroom_bits']:.1f} bits ({layer})"
        )
    return lines


def guard_line(summary: Summary | dict[str, Any]) -> str | None:
    """The console's closing line of a search for a guarded run (``--guard``; None
    without): the user's run is the confirmation, unless one was asked for too."""
    summary = as_summary(summary)
    if not summary.settings.guard:
        return None
    where = "guard: on (best_policy.yaml's guard: section)"
    confirmed = summary.confirmation
    if confirmed is not None:
        return f"{where}; confirmed at {confirmed.steps} steps as asked"
    return f"{where}; your guarded run is the confirmation"


def _charted(summary: Summary) -> list[tuple[Entry, dict[str, Any]]]:
    """The chosen policy and the trials at risk that cross first (at most two), with
    their forecasts."""
    chosen = [(summary.best, b)] if (b := _brief(summary.best)) else []
    risky = [(e, b) for e, _ in at_risk(summary) if (b := _brief(e)) and e.key != summary.best.key]
    risky.sort(key=lambda pair: pair[1].get("crossing_step") or math.inf)
    return chosen + risky[:2]


def plot_headroom(summary: Summary | dict[str, Any], path: Path) -> Path | None:
    """One panel per layer (those with the least headroom): each charted policy's largest
    |activation| as observed on the trial's steps, its projection to the run's length,
    and the limit of the dtype it runs in."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    summary = as_summary(summary)
    charted = _charted(summary)
    layers: list[str] = []
    for _, brief in reversed(charted):  # the crossing layers of the risky trials first
        for layer in brief.get("series", {}):
            if layer not in layers:
                layers.append(layer)
    layers = layers[:MAX_CHARTS]
    if not layers:
        return None
    columns = min(3, len(layers))
    rows = math.ceil(len(layers) / columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(4.2 * columns, 3.0 * rows), dpi=110, squeeze=False
    )
    colours = ("#222222", "#dd8452", "#c44e52")
    for ax, layer in zip(axes.flat, layers, strict=False):
        limits: set[str] = set()
        floors: set[str] = set()
        for (entry, brief), colour in zip(charted, colours, strict=False):
            series = brief.get("series", {}).get(layer)
            room = _rooms(brief).get(layer)
            if not series or room is None:
                continue
            name = "chosen" if entry.key == summary.best.key else entry.label
            ax.plot(series["steps"], series["amax"], ".", color=colour, ms=4, label=name)
            horizon = int(brief["train_steps"])
            ahead = [room.last_step + (horizon - room.last_step) * i / 40 for i in range(41)]
            ax.plot(ahead, [room.projected_amax(int(s)) for s in ahead], "--", color=colour)
            if room.crossing_step is not None:
                ax.axvline(room.crossing_step, color=colour, lw=0.8, ls=":")
            if room.underflow_crossing_step is not None:
                ax.axvline(room.underflow_crossing_step, color=colour, lw=0.8, ls=":")
            limits.add(room.dtype)
            if room.underflow_trend in MOVING or room.underflow_crossing_step is not None:
                floors.add(room.dtype)
        for dtype in sorted(limits):
            ax.axhline(dtype_range(dtype)[0], color="#c44e52", lw=1.0)
            ax.annotate(
                f"{dtype} max",
                (0.01, dtype_range(dtype)[0]),
                fontsize=7,
                color="#c44e52",
                xycoords=("axes fraction", "data"),
                va="bottom",
            )
        for dtype in sorted(floors):  # the underflow side: the smallest normal
            ax.axhline(dtype_range(dtype)[1], color="#4c72b0", lw=1.0)
            ax.annotate(
                f"{dtype} smallest normal",
                (0.01, dtype_range(dtype)[1]),
                fontsize=7,
                color="#4c72b0",
                xycoords=("axes fraction", "data"),
                va="top",
            )
        ax.set_yscale("log")
        ax.set_title(layer, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("largest |activation|", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(layers) :]:
        ax.axis("off")
    fig.suptitle(
        "headroom per layer: observed (dots), projected (dashed), dtype's largest value (red) "
        "and smallest normal (blue)",
        fontsize=9,
    )
    return saved(fig, path)


def headroom_section(summary: Summary, chart: Path | None) -> str:
    """The report's forecast section: the horizon, the trials at risk, the chart."""
    from autoprec.report.page import cell, html_table, images

    horizon = horizon_text(summary)
    if horizon is None:
        return ""
    rows = [[cell(e.label), cell(reason)] for e, reason in at_risk(summary)]
    table = html_table(["policy", "why at risk"], rows) if rows else "<p>No trial at risk.</p>"
    unclear_rows = [[cell(e.label), cell(reason)] for e, reason in cannot_tell(summary)]
    unclear = html_table(["policy", "why it cannot tell"], unclear_rows) if unclear_rows else ""
    shown = images([chart]) if chart is not None else ""
    return f"""<h2>Forecast to the run's length</h2>
<p class="note">{html.escape(horizon)}. A trial is at risk when a layer's largest |activation|,
fitted over the trial after its start-up (a model that predicts the trial's own last part)
and projected, passes its dtype's largest value within the run, or shrinks below its
smallest normal (activations, gradients), or the loss scale falls to its floor. Where no
model predicts the last part the forecast cannot tell: the trial stays feasible, and is
extended or confirmed at the run's length.</p>
{table}{unclear}
{shown}"""


def forecast_of(entry: Entry) -> Forecast | None:
    """An entry's forecast brief as a typed `Forecast` (its stored layers only)."""
    brief = _brief(entry)
    if brief is None:
        return None
    layers = tuple(_rooms(brief).values())
    return Forecast(int(brief["train_steps"]), int(brief["trial_steps"]), layers, brief["series"])
