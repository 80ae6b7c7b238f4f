"""The report's page shell: the HTML tables, sections and style every view shares, the
page around a view's body (`render_report`), and the page comparing studies."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from autoprec._util.files import make_folder, write_atomic
from autoprec.precision.emulation import emulated_mark, emulated_note
from autoprec.report.gains import gains_line
from autoprec.report.modes import mode_text
from autoprec.space import policy_label
from autoprec.study.summary_schema import Best, Entry, Summary, as_summary

# A view: a mode's plots and the report's body, written into the folder given.
View = Callable[[Summary, Path], tuple[list[Path], str]]

STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f4}tr.best{background:#fff3c4}tr.front td:first-child{font-weight:600}
.note{color:#666;font-size:.85em}img{max-width:100%;border:1px solid #eee;margin:.4em}
.fp32{color:#4c72b0}.bf16{color:#55a868}.fp16{color:#dd8452}
"""


def render_page(
    summary: Summary, out_dir: Path, view: View, within: Path | None = None
) -> list[Path]:
    """Write report.html (self-contained: plots embedded) around ``view``'s body, and the
    view's PNG plots beside it. No folder below ``within`` (the runs folder, where the
    CLI writes) may be a link (see `autoprec._util.files`)."""
    make_folder(out_dir, within)
    plots, body = view(summary, out_dir)
    study = html.escape(summary.study)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>autoprec report: {study}</title><style>{STYLE + mode_text(summary).style}</style></head>
<body>
<h1>autoprec report: {study}</h1>
<p><b>{html.escape(gains_line(summary))}</b></p>
{_emulated(summary)}{body}
</body></html>
"""
    report = out_dir / "report.html"
    write_atomic(report, page, within)
    return [report, *plots]


def _emulated(summary: Summary) -> str:
    """The page's note on figures that ran emulated (marked in the trials tables)."""
    note = emulated_note(summary.settings.emulated, (e.emulated for e in summary.entries))
    return "" if note is None else f'<p class="note"><b>{html.escape(note)}</b></p>\n'


def cell(value: Any, spec: str = "") -> str:
    """A table cell's HTML: yes/no, a number formatted, else the value escaped."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and spec:
        return format(value, spec)
    return html.escape("-" if value is None else str(value))


def html_table(header: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        f'<tr class="{classes[i] if classes else ""}">'
        + "".join(f"<td>{c}</td>" for c in row)
        + "</tr>"
        for i, row in enumerate(rows)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def text_rows(rows: list[list[str]]) -> list[list[str]]:
    """Plain-text rows as HTML cells."""
    return [[html.escape(c) for c in row] for row in rows]


def notes(lines: list[str]) -> str:
    return f'<p class="note">{"<br>".join(html.escape(n) for n in lines)}</p>'


def outcome_cells(entry: Entry) -> list[str]:
    """The first cells of every trials table: the trial, its state, accuracy and drop."""
    return [
        html.escape(entry.label + emulated_mark(entry.emulated)),
        cell(entry.state),
        cell(entry.accuracy, ".4f"),
        cell(entry.accuracy_drop, "+.4f"),
    ]


def verdict_cells(entry: Entry) -> list[str]:
    """The last cells of every trials table: share, verdicts, dtypes and reason."""
    return [
        cell(entry.metrics.get("low_precision_share"), ".0%"),
        cell(entry.feasible),
        cell(entry.pareto),
        html.escape(policy_label(entry.params)),
        html.escape("; ".join(filter(None, [entry.reason, entry.retried]))),
    ]


def images(plots: list[Path]) -> str:
    return "".join(
        f'<img alt="{p.stem}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}">'
        for p in plots
    )


def layers_section(best: Best) -> str:
    layer_rows = [
        [
            html.escape(r.name),
            html.escape(r.type),
            str(r.params),
            f'<span class="{html.escape(r.dtype)}">{html.escape(r.dtype)}</span>',
        ]
        for r in best.layers
    ]
    table = (
        html_table(["module", "type", "params", "dtype"], layer_rows)
        if layer_rows
        else '<p class="note">No layer table in this summary.</p>'
    )
    return f"""<h2>The chosen policy, layer by layer</h2>
{table}
<pre>{html.escape(yaml.safe_dump(best.policy, sort_keys=False))}</pre>"""


def trials_section(
    summary: Summary, header: list[str], metric_row: Callable[[Summary, Entry], list[str]]
) -> str:
    entries = summary.entries
    best = summary.best.key
    classes = ["best" if e.key == best else ("front" if e.pareto else "") for e in entries]
    return f"""<h2>All trials</h2>
{html_table(header, [metric_row(summary, e) for e in entries], classes)}"""


def settings_section(summary: Summary) -> str:
    setting_rows = [
        [html.escape(str(k)), html.escape(setting_text(str(k), v))]
        for k, v in summary.settings.values.items()
    ]
    return f"""<h2>Settings</h2>
{html_table(["setting", "value"], setting_rows)}"""


_UNITS = {"_s": "s", "_ms": "ms", "_mb": "MB"}


def setting_text(name: str, value: Any) -> str:
    """A setting as a person reads it: ``635 s`` (rounded, the unit its name ends with),
    ``none``, ``yes``/``no``, a list joined with commas."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(setting_text("", v) for v in value) or "none"
    if isinstance(value, int | float):
        unit = next((u for suffix, u in _UNITS.items() if name.endswith(suffix)), "")
        number = str(value) if isinstance(value, int) else f"{value:.4g}"
        return f"{number} {unit}".strip()
    return str(value)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


_COMPARE_NOTE = (
    "step time: one training step (training studies); latency: one batch served (serving "
    "studies); each re-timed side by side with fp32 where its study re-timed it."
)


def _ms(summary: Summary, entry: Entry) -> float:
    return _or_nan(summary.time_ms(entry))


def render_comparison(
    summaries: Sequence[Summary | dict[str, Any]], path: Path, within: Path | None = None
) -> Path:
    """One page comparing studies (e.g. one model on two devices): the fp32 baseline and the
    chosen policy of each (one row where fp32 was chosen, the chosen row marked), and their
    fronts in one plot. A training study's time is its step time, a serving study's its
    latency at its batch size: each in a column of its own. No folder below ``within`` may
    be a link (see `autoprec._util.files`)."""
    import matplotlib

    from autoprec.report.plots import png_bytes

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    typed = [as_summary(s) for s in summaries]
    time_words = list(dict.fromkeys(mode_text(s).time_words for s in typed))
    time_name = " or ".join(time_words)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for summary in typed:
        front = sorted((e for e in summary.entries if e.pareto), key=lambda e: _ms(summary, e))
        for ax, timed in zip(axes, (True, False), strict=True):
            xs = [_ms(summary, e) if timed else _or_nan(e.peak_memory_mb) for e in front]
            dots = ax.scatter(xs, [_or_nan(e.accuracy) for e in front], label=summary.study)
            chosen = _ms(summary, summary.best) if timed else _or_nan(summary.best.peak_memory_mb)
            ax.scatter(
                [chosen],
                [_or_nan(summary.best.accuracy)],
                marker="*",
                s=220,
                color=dots.get_facecolor()[0],
                edgecolors="black",
                zorder=3,
            )
    axes[0].set_xlabel(f"{time_name} (ms)")
    axes[1].set_xlabel("peak memory (MB)")
    for ax in axes:
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Pareto fronts (star: each study's chosen policy)")
    fig.tight_layout()
    drawn = png_bytes(fig)
    write_atomic(path.with_name(f"{path.stem}-fronts.png"), drawn, within)
    rows, classes = [], []
    for summary in typed:
        size = summary.batch_size
        own = time_words.index(mode_text(summary).time_words)
        chosen_fp32 = summary.best.key == summary.baseline.key
        for entry in (summary.baseline,) if chosen_fp32 else (summary.baseline, summary.best):
            chosen = entry is summary.best or chosen_fp32
            times = ["" for _ in time_words]
            times[own] = cell(summary.time_ms(entry), ".3f")
            rows.append(
                [
                    html.escape(summary.study)
                    + ("" if size is None else f" ({summary.mode}, batch {size})"),
                    html.escape(summary.settings.device_name),
                    html.escape(entry.label),
                    "&#9733; chosen" if chosen else "",
                    cell(entry.accuracy, ".4f"),
                    *times,
                    cell(entry.peak_memory_mb, ".3f"),
                    html.escape(policy_label(entry.params)),
                ]
            )
            classes.append("best" if chosen else "")
    image = base64.b64encode(drawn).decode()
    studies = html.escape(", ".join(s.study for s in typed))
    header = ["study", "device", "policy", "chosen", "accuracy"]
    header += [f"{words} ms" for words in time_words] + ["memory MB", "dtypes"]
    write_atomic(
        path,
        f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autoprec comparison</title>
<style>{STYLE}</style></head><body>
<h1>autoprec comparison: {studies}</h1>
<p class="note">{_COMPARE_NOTE}</p>
{html_table(header, rows, classes)}
<img alt="fronts" src="data:image/png;base64,{image}">
</body></html>
""",
        within,
    )
    return path
