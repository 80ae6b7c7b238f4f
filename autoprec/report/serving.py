"""The report's view of a serving study: the practitioner's benchmark at the scenario's
batch size, latency and memory against accuracy, where the best choice flips across
batch sizes, the chosen policy, every trial and the settings."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from autoprec.report.gains import speed_words
from autoprec.report.modes import SERVING_DTYPE_COLOURS
from autoprec.report.page import (
    cell,
    html_table,
    images,
    layers_section,
    notes,
    outcome_cells,
    settings_section,
    text_rows,
    trials_section,
    verdict_cells,
)
from autoprec.report.plots import plot_dtype_map, plot_front, saved
from autoprec.report.text import fmt, text_table
from autoprec.selection import TIME_TIE
from autoprec.serving.scenarios import SCENARIOS
from autoprec.space import policy_label
from autoprec.study.serving_summary import Serving
from autoprec.study.summary_schema import CONFIRMED_TIME, Entry, Summary, as_summary

# The rows of the practitioner's benchmark besides fp32 (the baseline): the uniform anchors
# and the classic recipe, in that order, as a serving study names them.
SERVING_ANCHORS = (
    ("fp16", "uniform-fp16"),
    ("bf16", "uniform-bf16"),
    ("int8", "uniform-int8"),
    ("fp16 body, fp32 head", "fp16-body-fp32-head"),
)
SERVING_METRIC_HEADER = [
    "policy",
    "state",
    "accuracy",
    "drop",
    "top-1 agreement",
    "max rel. deviation",
    "latency ms",
    "memory MB",
    "weight MB",
    "low prec.",
    "feasible",
    "Pareto",
    "dtypes",
    "reason",
]
TableRows = tuple[list[str], list[list[str]], list[str]]  # header, rows, each row's class


def _serving(summary: Summary) -> Serving:
    """The serving study's own part of its summary (an empty one where it has none)."""
    part = summary.part
    return part if isinstance(part, Serving) else Serving(scenario=None, batch_sizes=[])


def benchmark_rows(summary: Summary | dict[str, Any]) -> list[tuple[str, Entry]]:
    """A serving study's entries as the practitioner's benchmark lists them, by short name:
    fp32 (the baseline), each uniform anchor measured, the fp16 body with an fp32 head, and
    the chosen policy where it is none of those."""
    summary = as_summary(summary)
    anchors = {t.anchor: t for t in summary.trials if t.anchor}
    rows: list[tuple[str, Entry]] = [("fp32", summary.baseline)]
    rows += [(name, anchors[anchor]) for name, anchor in SERVING_ANCHORS if anchor in anchors]
    best = summary.best
    if all(entry.key != best.key for _, entry in rows):
        rows.append((f"chosen (trial {best.number})", best))
    return rows


def point_names(summary: Summary) -> dict[str, str]:
    """Every entry's benchmark name (fp32, int8, chosen ...), else its trial number."""
    names = {e.key: f"trial {e.key}" for e in summary.entries}
    names.update({entry.key: name for name, entry in benchmark_rows(summary)})
    return names


def _versus_fp32(entry: Entry, baseline: Entry) -> str:
    """Latency against fp32's: the side-by-side re-timings where both have one (+)."""
    if entry.is_baseline:
        return "1.00x"
    confirmed = entry.confirmed_time_ms is not None and baseline.confirmed_time_ms is not None
    key = CONFIRMED_TIME if confirmed else "latency_p50_ms"
    own, base = entry.metrics.get(key), baseline.metrics.get(key)
    if not own or not base:
        return "-"
    return _ratio_words(base / own) + ("+" if confirmed else "")


def _ratio_words(speedup: float) -> str:
    return "1.00x" if round(speedup, 2) == 1.0 else speed_words(speedup)


def _precision(name: str, entry: Entry, summary: Summary) -> str:
    if name.startswith("chosen"):
        return f"chosen: {policy_label(entry.params)}"
    method = _serving(summary).int8
    label = {"fp32": "fp32 (baseline)", "int8": f"int8 ({method})" if method else "int8"}
    chosen = " - chosen" if entry.key == summary.best.key else ""
    return label.get(name, name) + chosen


def benchmark_table(summary: Summary | dict[str, Any]) -> TableRows:
    """The header, the rows (plain text) and each row's class ("best" for the chosen) of
    the practitioner's benchmark: precision, accuracy, agreement with fp32, memory and
    latency at the scenario's batch size."""
    summary = as_summary(summary)
    size = summary.batch_size
    estimate = "~" if summary.peak_memory_is_estimate else ""
    header = [
        "precision",
        "trial",
        "accuracy",
        "drop",
        "top-1 agreement",
        f"memory MB{estimate}",
        "weight MB",
        f"p50 ms @{size}",
        f"p90 ms @{size}",
        "samples/s",
        "vs fp32",
        "feasible",
    ]
    rows, classes = [], []
    for name, entry in benchmark_rows(summary):
        m = entry.metrics
        rows.append(
            [
                _precision(name, entry, summary),
                entry.key,
                fmt(entry.accuracy, ".4f"),
                fmt(entry.accuracy_drop, "+.4f"),
                fmt(m.get("top1_agreement"), ".2%"),
                fmt(entry.peak_memory_mb, ".3f"),
                fmt(m.get("weight_mb"), ".3f"),
                fmt(m.get("latency_p50_ms"), ".3f"),
                fmt(m.get("latency_p90_ms"), ".3f"),
                fmt(m.get("throughput_sps"), ".0f"),
                _versus_fp32(entry, summary.baseline),
                "yes" if entry.feasible else "no",
            ]
        )
        classes.append("best" if entry.key == summary.best.key else "")
    return header, rows, classes


def benchmark_notes(summary: Summary | dict[str, Any]) -> list[str]:
    """What the benchmark table's marks mean, and which of its rows are missing and why."""
    summary = as_summary(summary)
    found = [
        f"latency: median (p50) and 90th percentile of one forward at batch "
        f"{summary.batch_size}; samples/s over the timed forwards"
    ]
    rows = benchmark_rows(summary)
    if any(_versus_fp32(entry, summary.baseline).endswith("+") for _, entry in rows):
        found.append("+ re-timed side by side with fp32, in alternating blocks")
    if summary.peak_memory_is_estimate:
        found.append(
            "~ CPU memory is an estimate: weights plus the peak of live activations "
            "(a lower bound: kernels' scratch memory is not counted)"
        )
    measured = {entry.anchor for _, entry in rows}
    for name, anchor in SERVING_ANCHORS:
        if anchor not in measured:
            why = (
                "int8 is off, or has no kernels on this device"
                if anchor == "uniform-int8" and not _serving(summary).int8
                else "the device or the model's layers do not take it, or the budget ended first"
            )
            found.append(f"{name}: not measured ({why})")
    for name, entry in rows:
        if not entry.complete:
            found.append(f"{name}: {entry.state}: {entry.reason or 'no reason given'}")
    return found


def benchmark_text(summary: Summary | dict[str, Any]) -> str:
    """The practitioner's benchmark of a serving study as an aligned text table; a long
    chosen policy is spelled out below it."""
    summary = as_summary(summary)
    header, rows, classes = benchmark_table(summary)
    lines = ["* chosen policy", *benchmark_notes(summary)]
    for row in rows:
        if row[0].startswith("chosen: ") and len(row[0]) > 48:
            lines.insert(1, f"chosen (trial {row[1]}): {row[0].removeprefix('chosen: ')}")
            row[0] = "chosen, mixed (see below)"
    marked = [["*" if c == "best" else "", *row] for row, c in zip(rows, classes, strict=True)]
    return "\n".join([text_table([["", *header], *marked]), *lines])


def batch_latencies(summary: Summary | dict[str, Any]) -> dict[str, dict[int, float]]:
    """Median latency (ms) at each batch size measured, by entry (trial number as text).

    From each entry's ``latency_by_batch_ms`` where the summary holds it; else from what
    it does hold: every entry's latency at the scenario's batch size, and fp32's and each
    batch size's best one at every size (`autoprec.study.summary.by_batch_size`)."""
    summary = as_summary(summary)
    main = summary.batch_size
    found: dict[str, dict[int, float]] = {}
    for entry in summary.entries:
        own = entry.metrics.get("latency_p50_ms")
        if entry.latency_by_batch_ms is not None:
            found[entry.key] = {k: float(v) for k, v in entry.latency_by_batch_ms.items()}
        elif own is not None and main is not None:
            found[entry.key] = {main: own}
    for row in _serving(summary).by_batch_size:
        if row.fp32_latency_ms is not None:
            found.setdefault("baseline", {}).setdefault(row.batch_size, row.fp32_latency_ms)
        found.setdefault(str(row.best), {}).setdefault(row.batch_size, row.latency_ms)
    return found


def batch_size_table(summary: Summary | dict[str, Any]) -> TableRows:
    """Where the best choice flips: for each batch size measured (ascending), the fastest
    feasible policy there against fp32's latency, and each benchmark row's latency there.
    The scenario's batch size is marked (class "best")."""
    summary = as_summary(summary)
    latencies = batch_latencies(summary)
    names = point_names(summary)
    others = benchmark_rows(summary)[1:]
    header = [
        "batch size",
        "best there",
        "its dtypes",
        "latency ms",
        "fp32 ms",
        "vs fp32",
        *(f"{name} ms" for name, _ in others),
    ]
    main = summary.batch_size
    rows, classes = [], []
    for row in sorted(_serving(summary).by_batch_size, key=lambda r: r.batch_size):
        size, key = row.batch_size, str(row.best)
        rows.append(
            [
                f"{size}" + (" (scenario)" if size == main else ""),
                names.get(key, f"trial {key}"),
                _dtypes_unless_named(summary, summary.entry(key)),
                fmt(row.latency_ms, ".3f"),
                fmt(row.fp32_latency_ms, ".3f"),
                _ratio_words(row.speedup_vs_fp32) if row.speedup_vs_fp32 else "-",
                *(fmt(latencies.get(e.key, {}).get(size), ".3f") for _, e in others),
            ]
        )
        classes.append("best" if size == main else "")
    return header, rows, classes


def _dtypes_unless_named(summary: Summary, entry: Entry | None) -> str:
    """A policy's dtypes, where its name (fp32, int8, ...) does not already say them."""
    if entry is None:
        return "-"
    named = point_names(summary)[entry.key]
    return "as named" if not named.startswith(("trial", "chosen")) else policy_label(entry.params)


def batch_size_notes(summary: Summary | dict[str, Any]) -> list[str]:
    """How the best at each batch size was picked, and what the summary lacks."""
    summary = as_summary(summary)
    found = [
        "best there: the feasible policy with the lowest median latency at that batch size, "
        f"by the trials' own timings (within {TIME_TIE:.0%} a tie, to less memory); the "
        "study's choice is made at the scenario's batch size, under its preference"
    ]
    if any(entry.latency_by_batch_ms is None for entry in summary.entries):
        found.append(
            "this summary holds each policy's latency at the scenario's batch size only, "
            "fp32's and the best one's at every size: '-' where it holds none"
        )
    return found


def batch_size_text(summary: Summary | dict[str, Any]) -> str:
    """`batch_size_table` as aligned text, the scenario's batch size marked ``*``."""
    summary = as_summary(summary)
    header, rows, classes = batch_size_table(summary)
    lines = batch_size_notes(summary)
    for row in rows:
        if len(row[2]) > 48:  # a long policy is spelled out below the table
            lines.append(f"{row[1]}: {row[2]}")
            row[2] = "see below"
    marked = [["*" if c == "best" else "", *row] for row, c in zip(rows, classes, strict=True)]
    return "\n".join([text_table([["", *header], *marked]), *lines])


def plot_latency_by_batch(summary: Summary | dict[str, Any], path: Path) -> Path:
    """Latency per forward against batch size for fp32, each uniform anchor and the chosen
    policy, with the best at each batch size starred and named: where the choice flips."""
    summary = as_summary(summary)
    latencies = batch_latencies(summary)
    series = [(name, latencies.get(e.key, {})) for name, e in benchmark_rows(summary)]
    return _plot_batch_latency(summary, series, point_names(summary), path)


def _series_style(name: str) -> dict[str, Any]:
    if name.startswith("chosen"):
        return {"color": "#222222", "linestyle": "--"}
    return {"color": SERVING_DTYPE_COLOURS.get(name, "#937860")}


def _plot_batch_latency(
    summary: Summary,
    series: list[tuple[str, dict[int, float]]],
    point_names: dict[str, str],
    path: Path,
) -> Path:
    """Latency per forward against batch size for each named series (fp32, each uniform
    anchor, the chosen policy), with the best at each batch size starred and named:
    where the choice flips."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter, NullLocator

    info = _serving(summary)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, latencies in series:
        points = sorted(latencies.items())
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=name, **_series_style(name))
    flips = info.by_batch_size
    ax.scatter(
        [r.batch_size for r in flips],
        [r.latency_ms for r in flips],
        marker="*",
        s=260,
        facecolors="none",
        edgecolors="black",
        label="best at this batch size",
        zorder=3,
    )
    for row in flips:
        ax.annotate(
            point_names.get(str(row.best), f"trial {row.best}"),
            (row.batch_size, row.latency_ms),
            fontsize=7,
            xytext=(6, -10),
            textcoords="offset points",
        )
    sizes = sorted({r.batch_size for r in flips} | set(info.batch_sizes))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("batch size")
    ax.set_ylabel("latency per forward, p50 (ms)")
    ax.set_title(f"{summary.study}: latency by batch size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return saved(fig, path)


def serving_view(summary: Summary, out_dir: Path) -> tuple[list[Path], str]:
    """A serving study's plots and the report's body."""
    names = point_names(summary)
    plots = [
        plot_front(summary, "latency_p50_ms", out_dir / "front_latency.png", names),
        plot_front(summary, "peak_memory_mb", out_dir / "front_memory.png", names),
        plot_dtype_map(summary, out_dir / "dtype_map.png"),
    ]
    flips = ""
    if len(_serving(summary).batch_sizes) > 1:
        plots.append(plot_latency_by_batch(summary, out_dir / "latency_by_batch.png"))
        header, rows, classes = batch_size_table(summary)
        flips = f"""<h2>Where the best choice flips: each batch size measured</h2>
{html_table(header, text_rows(rows), classes)}
{notes(batch_size_notes(summary))}
{images(plots[3:])}"""
    header, rows, classes = benchmark_table(summary)
    body = f"""<p class="note">{html.escape(_serving_note(summary))}</p>
<h2>Precision, accuracy, memory and latency at batch {summary.batch_size}</h2>
{html_table(header, text_rows(rows), classes)}
{notes(benchmark_notes(summary))}
<h2>Trade-offs</h2>
{images(plots[:3])}
{flips}
{layers_section(summary.best)}
{trials_section(summary, SERVING_METRIC_HEADER, _serving_metric_row)}
{settings_section(summary)}"""
    return plots, body


def _serving_note(summary: Summary) -> str:
    """The scenario, what counts as feasible, how memory was measured, the int8 method
    and where the fp32 weights are kept."""
    info = _serving(summary)
    preset = SCENARIOS.get(info.scenario or "")
    about = f" ({preset.about})" if preset else ""
    bounds = [f"accuracy drop within {summary.accuracy_tolerance:g}"]
    if info.min_top1_agreement is not None:
        bounds.append(f"top-1 agreement with fp32 at least {info.min_top1_agreement:.2%}")
    if info.max_rel_deviation is not None:
        bounds.append(f"relative output deviation at most {info.max_rel_deviation:g}")
    memory = (
        "Peak memory on the CPU is an estimate: the weights plus the peak of live "
        "activations over one forward."
        if summary.peak_memory_is_estimate
        else "Peak memory is the device allocator's over one forward, weights and inputs in."
    )
    parts = [
        f"Scenario {info.scenario}{about}: served at batch "
        f"{summary.batch_size}, the choice preferring {summary.prefer}.",
        f"Feasible: {', '.join(bounds)}.",
        memory,
        f"int8: {info.int8}." if info.int8 else "int8: not searched.",
    ]
    if summary.step_times_confirmed:
        parts.append("The fastest were re-timed side by side with fp32; the choice uses that.")
    if info.fp32_checkpoint:
        parts.append(f"The fp32 weights every policy was converted from: {info.fp32_checkpoint}.")
    return " ".join(parts)


def _serving_metric_row(summary: Summary, entry: Entry) -> list[str]:
    m = entry.metrics
    return [
        *outcome_cells(entry),
        cell(m.get("top1_agreement"), ".2%"),
        cell(m.get("max_rel_deviation"), ".2e"),
        cell(summary.time_ms(entry), ".3f"),
        cell(entry.peak_memory_mb, ".3f"),
        cell(m.get("weight_mb"), ".3f"),
        *verdict_cells(entry),
    ]
