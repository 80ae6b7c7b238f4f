"""Views of a finished search, all made from summary.json: the text table of the Pareto
front and the chosen policy's gains, and the HTML report with its PNG plots."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

import yaml

from autoprec.space import policy_label


def text_table(rows: list[list[str]]) -> str:
    """Rows of strings as left-aligned columns, the first row being the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _fmt(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, int | float) else format(value, spec)


def serving(summary: dict[str, Any]) -> bool:
    """Whether the summary is a serving (inference) study's."""
    return summary.get("mode") == "inference"


def time_metric(summary: dict[str, Any]) -> str:
    """The metric a study's time is: the latency served, or the training step's."""
    return "latency_p50_ms" if serving(summary) else "step_time_ms"


def front_table(summary: dict[str, Any]) -> str:
    """The Pareto front (and the baseline) as an aligned text table; the best is marked."""
    best = summary["best"]["number"]
    rows = [summary["baseline"], *summary["trials"]]
    front = [r for r in rows if r["pareto"] or r["number"] in (best, "baseline")]
    memory_label = "memory MB" + ("~" if summary.get("peak_memory_is_estimate") else "")
    time_label = "latency ms" if serving(summary) else "step ms"
    header = ["", "trial", "accuracy", "drop", time_label, memory_label, "feasible", "policy"]
    lines = [header]
    for r in front:
        m = r["metrics"]
        lines.append(
            [
                "*" if r["number"] == best else "",
                str(r["number"]),
                _fmt(m.get("accuracy"), ".4f"),
                _fmt(m.get("accuracy_drop"), "+.4f"),
                _fmt(m.get("confirmed_step_time_ms", m.get(time_metric(summary))), ".2f")
                + ("+" if "confirmed_step_time_ms" in m else ""),
                _fmt(m.get("peak_memory_mb"), ".2f"),
                "yes" if r["feasible"] else "no",
                policy_label(r["params"]),
            ]
        )
    text = [text_table(lines)]
    what = "latency" if serving(summary) else "step time"
    notes = [
        f"* chosen policy; rows: the Pareto front (accuracy, memory, {what}) and the fp32 baseline"
    ]
    if summary.get("step_times_confirmed"):
        notes.append(f"+ {what} re-measured side by side with the fp32 baseline")
    if summary.get("peak_memory_is_estimate"):
        counted = (
            "weights plus the peak of live activations"
            if serving(summary)
            else "parameters, gradients, optimizer state and saved activations"
        )
        notes.append(f"~ CPU memory is an estimate: {counted}")
    return "\n".join(text + notes)


def gains_line(summary: dict[str, Any]) -> str:
    """E.g. ``best: trial 7 - 1.90x faster, 48% less memory, accuracy -0.2 pt vs fp32``."""
    best = summary["best"]
    if best["number"] == "baseline":
        return "best: the fp32 baseline - no policy in this search beat it under the preference"
    speedup = best["speedup_vs_fp32"]
    saving = best["memory_saving_vs_fp32"]
    drop_pt = 100.0 * best["metrics"].get("accuracy_drop", 0.0)
    speed = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    memory = f"{abs(saving) * 100:.0f}% {'less' if saving >= 0 else 'more'} memory"
    change_pt = -drop_pt + 0.0  # no "-0.0"
    return f"best: trial {best['number']} - {speed}, {memory}, accuracy {change_pt:+.1f} pt vs fp32"


# -- the HTML report and its plots ------------------------------------------------------

DTYPE_COLOURS = {"fp32": "#4c72b0", "bf16": "#55a868", "fp16": "#dd8452"}
ANCHOR_ORDER = ("uniform-fp16", "uniform-fp16-noscale", "uniform-bf16")


def _rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [summary["baseline"], *summary["trials"]]


def _step_ms(row: dict[str, Any]) -> float | None:
    metrics = row["metrics"]
    time = metrics.get("step_time_ms", metrics.get("latency_p50_ms"))
    return metrics.get("confirmed_step_time_ms", time)


def _label(row: dict[str, Any]) -> str:
    if row["number"] == "baseline":
        return "fp32 baseline"
    return f"trial {row['number']}" + (f" ({row['anchor']})" if row.get("anchor") else "")


def plot_front(summary: dict[str, Any], x_metric: str, path: Path) -> Path:
    """Accuracy against step time or peak memory; the Pareto front highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    def x_of(row: dict[str, Any]) -> float | None:
        return _step_ms(row) if x_metric == "step_time_ms" else row["metrics"].get(x_metric)

    complete = [
        r
        for r in _rows(summary)
        if r["state"] == "complete" and x_of(r) is not None and "accuracy" in r["metrics"]
    ]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for feasible, marker, name in ((True, "o", "feasible"), (False, "x", "infeasible")):
        points = [r for r in complete if r["feasible"] == feasible and not r["pareto"]]
        ax.scatter(
            [x_of(r) for r in points],
            [r["metrics"]["accuracy"] for r in points],
            marker=marker,
            c="#999999",
            label=name,
        )
    front = sorted((r for r in complete if r["pareto"]), key=x_of)
    # The front is over three objectives: in a 2-D view its points need not form a line.
    ax.scatter(
        [x_of(r) for r in front],
        [r["metrics"]["accuracy"] for r in front],
        c="#c44e52",
        label="Pareto front (3 objectives)",
    )
    for row in complete:
        if row["number"] in ("baseline", summary["best"]["number"]) or row.get("anchor"):
            ax.annotate(
                _label(row),
                (x_of(row), row["metrics"]["accuracy"]),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
    best = next(r for r in complete if r["number"] == summary["best"]["number"])
    ax.scatter(
        [x_of(best)],
        [best["metrics"]["accuracy"]],
        s=180,
        facecolors="none",
        edgecolors="black",
        label="chosen",
    )
    unit = "step time (ms)" if x_metric == "step_time_ms" else "peak memory (MB)"
    if x_metric == "peak_memory_mb" and summary.get("peak_memory_is_estimate"):
        unit += ", CPU estimate"
    ax.set_xlabel(unit)
    ax.set_ylabel("accuracy")
    ax.set_title(f"{summary['study']}: accuracy against {unit.split(' (')[0]}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_dtype_map(summary: dict[str, Any], path: Path, top: int = 8) -> Path:
    """Rows: the baseline, the anchors, the chosen policy and the best feasible others;
    columns: the searched groups; colour: dtype."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    rows = [summary["baseline"]]
    rows += sorted(
        (t for t in summary["trials"] if t.get("anchor")),
        key=lambda t: ANCHOR_ORDER.index(t["anchor"]) if t["anchor"] in ANCHOR_ORDER else 9,
    )
    feasible = sorted(
        (t for t in summary["trials"] if t["feasible"] and not t.get("anchor")),
        key=lambda t: _step_ms(t) or float("inf"),
    )
    best = summary["best"]["number"]
    chosen = [t for t in summary["trials"] if t["number"] == best and not t.get("anchor")]
    rows += chosen + [t for t in feasible if t["number"] != best][: max(0, top - len(chosen))]
    groups = [
        k.removeprefix("dtype.") for k in summary["baseline"]["params"] if k.startswith("dtype.")
    ]
    codes = {"fp32": 0, "bf16": 1, "fp16": 2}
    grid = [[codes[r["params"][f"dtype.{g}"]] for g in groups] for r in rows]
    from matplotlib.colors import ListedColormap

    width_in = max(5.5, 3.0 + 0.9 * len(groups))
    height_in = max(2.5, 0.9 + 0.38 * len(rows))
    fig, ax = plt.subplots(figsize=(width_in, height_in), dpi=110)
    ax.imshow(
        grid, cmap=ListedColormap(list(DTYPE_COLOURS.values())), vmin=0, vmax=2, aspect="auto"
    )
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    labels = [_label(r) + (" *" if r["number"] == best else "") for r in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.legend(
        handles=[Patch(color=c, label=d) for d, c in DTYPE_COLOURS.items()],
        bbox_to_anchor=(1.02, 1),
        loc="upper left",
        fontsize=8,
    )
    ax.set_title("dtype by layer group (* chosen)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _cell(value: Any, spec: str = "") -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and spec:
        return format(value, spec)
    return html.escape("-" if value is None else str(value))


def _html_table(header: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        f'<tr class="{classes[i] if classes else ""}">'
        + "".join(f"<td>{c}</td>" for c in row)
        + "</tr>"
        for i, row in enumerate(rows)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _metric_row(row: dict[str, Any]) -> list[str]:
    m = row["metrics"]
    return [
        html.escape(_label(row)),
        _cell(row["state"]),
        _cell(m.get("accuracy"), ".4f"),
        _cell(m.get("accuracy_drop"), "+.4f"),
        _cell(_step_ms(row), ".3f"),
        _cell(m.get("peak_memory_mb"), ".3f"),
        _cell(m.get("low_precision_share"), ".0%"),
        _cell(row["feasible"]),
        _cell(row.get("pareto", False)),
        html.escape(policy_label(row["params"])),
        html.escape(row.get("reason") or ""),
    ]


METRIC_HEADER = [
    "policy",
    "state",
    "accuracy",
    "drop",
    "step ms",
    "memory MB",
    "low prec.",
    "feasible",
    "Pareto",
    "dtypes and loss scale",
    "reason",
]

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f4}tr.best{background:#fff3c4}tr.front td:first-child{font-weight:600}
.note{color:#666;font-size:.85em}img{max-width:100%;border:1px solid #eee;margin:.4em}
.fp32{color:#4c72b0}.bf16{color:#55a868}.fp16{color:#dd8452}
"""


def render_report(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write report.html (self-contained: plots embedded) and the PNG plots beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [
        plot_front(summary, "step_time_ms", out_dir / "front_step_time.png"),
        plot_front(summary, "peak_memory_mb", out_dir / "front_memory.png"),
        plot_dtype_map(summary, out_dir / "dtype_map.png"),
    ]
    best = summary["best"]
    settings = summary.get("settings", {})
    rows = _rows(summary)
    side = [summary["baseline"]]
    side += sorted(
        (t for t in summary["trials"] if t.get("anchor")),
        key=lambda t: ANCHOR_ORDER.index(t["anchor"]) if t["anchor"] in ANCHOR_ORDER else 9,
    )
    if best["number"] != "baseline":
        side += [t for t in summary["trials"] if t["number"] == best["number"] and t not in side]
    images = "".join(
        f'<img alt="{p.stem}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}">'
        for p in plots
    )
    layers = best.get("layers", [])
    layer_rows = [
        [
            html.escape(r["name"]),
            html.escape(r["type"]),
            str(r["params"]),
            f'<span class="{r["dtype"]}">{r["dtype"]}</span>',
        ]
        for r in layers
    ]
    setting_rows = [[html.escape(str(k)), html.escape(str(v))] for k, v in settings.items()]
    advice = "".join(f"<li>{html.escape(w)}</li>" for w in summary.get("advice", []))
    memory_note = (
        "Peak memory on the CPU is an estimate: parameters, gradients, optimizer state and "
        "tensors saved for backward."
        if summary.get("peak_memory_is_estimate")
        else "Peak memory is the device allocator's peak."
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>autoprec report: {html.escape(summary["study"])}</title><style>{_STYLE}</style></head>
<body>
<h1>autoprec report: {html.escape(summary["study"])}</h1>
<p><b>{html.escape(gains_line(summary))}</b></p>
<p class="note">{html.escape(memory_note)} Where the fastest policies were re-timed side by
side with the baseline, their step times are those re-timings. Feasible: accuracy drop within
{summary["accuracy_tolerance"]:g}. Preference: {html.escape(str(summary["prefer"]))}.</p>
<h2>Baseline, anchors and the chosen policy</h2>
{_html_table(METRIC_HEADER, [_metric_row(r) for r in side])}
<h2>Trade-offs</h2>
{images}
<h2>The chosen policy, layer by layer</h2>
{
        _html_table(["module", "type", "params", "dtype"], layer_rows)
        if layer_rows
        else '<p class="note">No layer table in this summary.</p>'
    }
<pre>{html.escape(yaml.safe_dump(best["policy"], sort_keys=False))}</pre>
<h2>All trials</h2>
{
        _html_table(
            METRIC_HEADER,
            [_metric_row(r) for r in rows],
            [
                "best" if r["number"] == best["number"] else ("front" if r.get("pareto") else "")
                for r in rows
            ],
        )
    }
<h2>Advice from the fp32 baseline's gradients</h2>
<ul>{advice or "<li>none: no layer would lose gradients or overflow in fp16</li>"}</ul>
<h2>Settings</h2>
{_html_table(["setting", "value"], setting_rows)}
</body></html>
"""
    report = out_dir / "report.html"
    report.write_text(page)
    return [report, *plots]


def render_comparison(summaries: list[dict[str, Any]], path: Path) -> Path:
    """One page comparing studies (e.g. one model on two devices): baseline and chosen
    policy of each, and their fronts in one plot."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for summary in summaries:
        front = sorted((r for r in _rows(summary) if r.get("pareto")), key=lambda r: _step_ms(r))
        for ax, x_metric in zip(axes, ("step_time_ms", "peak_memory_mb"), strict=True):
            xs = [
                _step_ms(r) if x_metric == "step_time_ms" else r["metrics"][x_metric] for r in front
            ]
            ax.scatter(xs, [r["metrics"]["accuracy"] for r in front], label=summary["study"])
    axes[0].set_xlabel("step time (ms)")
    axes[1].set_xlabel("peak memory (MB)")
    for ax in axes:
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Pareto fronts")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    png = path.with_name(f"{path.stem}-fronts.png")
    fig.savefig(png)
    plt.close(fig)
    rows = []
    for summary in summaries:
        settings = summary.get("settings", {})
        for row in (summary["baseline"], summary["best"]):
            m = row["metrics"]
            rows.append(
                [
                    html.escape(summary["study"]),
                    html.escape(str(settings.get("device_name", settings.get("device", "?")))),
                    html.escape(_label(row)),
                    _cell(m.get("accuracy"), ".4f"),
                    _cell(_step_ms(row), ".3f"),
                    _cell(m.get("peak_memory_mb"), ".3f"),
                    html.escape(policy_label(row["params"])),
                ]
            )
    image = base64.b64encode(png.read_bytes()).decode()
    path.write_text(f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autoprec comparison</title>
<style>{_STYLE}</style></head><body>
<h1>autoprec comparison: {html.escape(", ".join(s["study"] for s in summaries))}</h1>
{_html_table(["study", "device", "policy", "accuracy", "step ms", "memory MB", "dtypes"], rows)}
<img alt="fronts" src="data:image/png;base64,{image}">
</body></html>
""")
    return path
