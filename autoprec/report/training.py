"""The report's view of a training study: the baseline, the anchors and the chosen
policy side by side, the trade-offs, every trial and the gradients' advice. It is also
the view of a mode that names none of its own (`autoprec.trials.Mode.view`): its time
is the mode's (`Summary.time_metric`), named in the mode's words (`mode_text`)."""

from __future__ import annotations

import html
from pathlib import Path

from autoprec.report.confirmation import confirmation_section
from autoprec.report.headroom import headroom_section, plot_headroom
from autoprec.report.memory import memory_section
from autoprec.report.modes import mode_text
from autoprec.report.page import (
    cell,
    html_table,
    images,
    layers_section,
    outcome_cells,
    settings_section,
    trials_section,
    verdict_cells,
)
from autoprec.report.plots import anchor_rank, plot_dtype_map, plot_front
from autoprec.report.states import states_section
from autoprec.study.summary_schema import Entry, Summary


def metric_header(summary: Summary) -> list[str]:
    """The trials tables' header, the time named in the mode's words (``step ms``)."""
    return [
        "policy",
        "state",
        "accuracy",
        "drop",
        mode_text(summary).time_column,
        "memory MB",
        "low prec.",
        "feasible",
        "Pareto",
        "dtypes and loss scale",
        "reason",
    ]


def metric_row(summary: Summary, entry: Entry) -> list[str]:
    return [
        *outcome_cells(entry),
        cell(summary.time_ms(entry), ".3f"),
        cell(entry.peak_memory_mb, ".3f"),
        *verdict_cells(entry),
    ]


def training_view(summary: Summary, out_dir: Path) -> tuple[list[Path], str]:
    """A training study's plots and the report's body."""
    time_metric = summary.time_metric
    plots = [
        plot_front(summary, time_metric, out_dir / f"front_{time_metric.removesuffix('_ms')}.png"),
        plot_front(summary, "peak_memory_mb", out_dir / "front_memory.png"),
        plot_dtype_map(summary, out_dir / "dtype_map.png"),
    ]
    headroom_chart = plot_headroom(summary, out_dir / "headroom.png")
    best = summary.best
    side = [summary.baseline, *sorted((t for t in summary.trials if t.anchor), key=anchor_rank)]
    if not best.is_baseline:
        side += [t for t in summary.trials if t.key == best.key and t not in side]
    advice = "".join(f"<li>{html.escape(w)}</li>" for w in summary.advice)
    memory_note = (
        "Peak memory on the CPU is an estimate: parameters, gradients, optimizer state and "
        "tensors saved for backward."
        if summary.peak_memory_is_estimate
        else "Peak memory is the device allocator's peak."
    )
    note, prefer = html.escape(memory_note), html.escape(str(summary.prefer))
    times, header = html.escape(mode_text(summary).time_words), metric_header(summary)
    body = f"""<p class="note">{note} Where the fastest policies were re-timed side by
side with the baseline, their {times}s are those re-timings. Feasible: accuracy drop within
{summary.accuracy_tolerance:g}. Preference: {prefer}.</p>
<h2>Baseline, anchors and the chosen policy</h2>
{html_table(header, [metric_row(summary, e) for e in side])}
{memory_section(side)}
{states_section(summary, side)}
<h2>Trade-offs</h2>
{images(plots)}
{layers_section(best)}
{headroom_section(summary, headroom_chart)}
{trials_section(summary, header, metric_row)}
{confirmation_section(summary)}
<h2>Advice from the fp32 baseline's gradients</h2>
<ul>{advice or "<li>none: no layer would lose gradients or overflow in fp16</li>"}</ul>
{settings_section(summary)}"""
    return plots + ([headroom_chart] if headroom_chart else []), body
