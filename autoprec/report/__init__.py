"""Views of a finished search, all made from its typed `Summary` (or summary.json's
mapping): the console text (`text`: the front table; `gains`: the gains line), the PNG
plots (`plots`), the page shell (`page`), and one view per mode (`training`, `serving`),
chosen by the summary's mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoprec.report.gains import gains_line, speed_words
from autoprec.report.modes import DTYPE_COLOURS, SERVING_DTYPE_COLOURS
from autoprec.report.page import render_comparison, render_page, setting_text
from autoprec.report.plots import ANCHOR_ORDER, front_figure, plot_dtype_map, plot_front
from autoprec.report.serving import (
    SERVING_ANCHORS,
    batch_latencies,
    batch_size_notes,
    batch_size_table,
    batch_size_text,
    benchmark_notes,
    benchmark_rows,
    benchmark_table,
    benchmark_text,
    plot_latency_by_batch,
    serving_view,
)
from autoprec.report.text import front_table, text_table
from autoprec.report.training import training_view
from autoprec.study.summary_schema import Summary, as_summary
from autoprec.trials import mode_named

__all__ = [
    "ANCHOR_ORDER",
    "DTYPE_COLOURS",
    "SERVING_ANCHORS",
    "SERVING_DTYPE_COLOURS",
    "batch_latencies",
    "batch_size_notes",
    "batch_size_table",
    "batch_size_text",
    "benchmark_notes",
    "benchmark_rows",
    "benchmark_table",
    "benchmark_text",
    "front_figure",
    "front_table",
    "gains_line",
    "plot_batch_latency",
    "plot_dtype_map",
    "plot_front",
    "render_comparison",
    "render_report",
    "serving_batch_size",
    "serving_view",
    "setting_text",
    "speed_words",
    "text_table",
    "time_metric",
    "training_view",
]


plot_batch_latency = plot_latency_by_batch  # its name before the report was split


def render_report(
    summary: Summary | dict[str, Any], out_dir: Path, within: Path | None = None
) -> list[Path]:
    """Write report.html (self-contained: plots embedded) and the PNG plots beside it, in
    the view of the study's mode. No folder below ``within`` (the runs folder, where the
    CLI writes) is followed where it is a link (see `autoprec._util.files`)."""
    typed = as_summary(summary)
    return render_page(typed, out_dir, mode_named(typed.mode).report_view(), within)


def serving_batch_size(summary: Summary | dict[str, Any]) -> int | None:
    """The batch size a serving study chose by (its scenario's, the first measured)."""
    return as_summary(summary).batch_size


def time_metric(summary: Summary | dict[str, Any]) -> str:
    """The metric a study's time is: the latency served, or the training step's."""
    return as_summary(summary).time_metric
