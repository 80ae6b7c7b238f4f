"""Views of a finished search, all made from summary.json: the text table of the Pareto
front and the chosen policy's gains, and the HTML report with its PNG plots."""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from autoprec.gains import gains_line, speed_words
from autoprec.inference.scenarios import SCENARIOS
from autoprec.selection import TIME_TIE
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


def serving_batch_size(summary: dict[str, Any]) -> int | None:
    """The batch size a serving study chose by (its scenario's, the first measured)."""
    sizes = summary.get("inference", {}).get("batch_sizes") or [None]
    found = sizes[0] or summary["baseline"]["metrics"].get("batch_size")
    return None if found is None else int(found)


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
    at = f"{what} at batch {serving_batch_size(summary)}" if serving(summary) else what
    notes = [
        f"* chosen policy; rows: the Pareto front (accuracy, memory, {at}) and the fp32 baseline"
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


# -- the HTML report and its plots ------------------------------------------------------

DTYPE_COLOURS = {"fp32": "#4c72b0", "bf16": "#55a868", "fp16": "#dd8452"}
SERVING_DTYPE_COLOURS = {**DTYPE_COLOURS, "int8": "#8172b3"}
ANCHOR_ORDER = (
    "uniform-fp16",
    "uniform-fp16-noscale",
    "uniform-bf16",
    "uniform-int8",
    "fp16-body-fp32-head",
)


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
    """Accuracy against step time (``step_time_ms``), latency (``latency_p50_ms``, at the
    serving study's batch size) or peak memory; the Pareto front highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    timed = x_metric in ("step_time_ms", "latency_p50_ms")

    def x_of(row: dict[str, Any]) -> float | None:
        return _step_ms(row) if timed else row["metrics"].get(x_metric)

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
    named = [
        r
        for r in complete
        if r["number"] in ("baseline", summary["best"]["number"]) or r.get("anchor")
    ]
    if serving(summary):  # short names, staggered: served policies often tie in accuracy
        named.sort(key=x_of)
    for index, row in enumerate(named):
        ax.annotate(
            _name_of(summary, str(row["number"])) if serving(summary) else _label(row),
            (x_of(row), row["metrics"]["accuracy"]),
            fontsize=7,
            xytext=(4, (4, -11, 15, -22)[index % 4] if serving(summary) else 4),
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
    unit = {
        "step_time_ms": "step time (ms)",
        "latency_p50_ms": f"latency at batch {serving_batch_size(summary)} (ms)",
    }.get(x_metric, "peak memory (MB)")
    if x_metric == "peak_memory_mb" and summary.get("peak_memory_is_estimate"):
        unit += ", CPU estimate"
    ax.set_xlabel(unit)
    ax.set_ylabel("accuracy")
    ax.set_title(f"{summary['study']}: accuracy against {unit.split(' (')[0]}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _saved(fig, path)


def _saved(fig: Any, path: Path) -> Path:
    """Lay the figure out, write it to ``path`` and free it."""
    import matplotlib.pyplot as plt

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
    colours = SERVING_DTYPE_COLOURS if serving(summary) else DTYPE_COLOURS
    codes = {dtype: code for code, dtype in enumerate(colours)}
    grid = [[codes[r["params"][f"dtype.{g}"]] for g in groups] for r in rows]
    from matplotlib.colors import ListedColormap

    width_in = max(5.5, 3.0 + 0.9 * len(groups))
    height_in = max(2.5, 0.9 + 0.38 * len(rows))
    fig, ax = plt.subplots(figsize=(width_in, height_in), dpi=110)
    cmap = ListedColormap(list(colours.values()))
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(colours) - 1, aspect="auto")
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    labels = [_label(r) + (" *" if r["number"] == best else "") for r in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.legend(
        handles=[Patch(color=c, label=d) for d, c in colours.items()],
        bbox_to_anchor=(1.02, 1),
        loc="upper left",
        fontsize=8,
    )
    ax.set_title("dtype by layer group (* chosen)", fontsize=9)
    return _saved(fig, path)


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


def _outcome_cells(row: dict[str, Any]) -> list[str]:
    """The first cells of every trials table: the trial, its state, accuracy and drop."""
    m = row["metrics"]
    return [
        html.escape(_label(row)),
        _cell(row["state"]),
        _cell(m.get("accuracy"), ".4f"),
        _cell(m.get("accuracy_drop"), "+.4f"),
    ]


def _metric_row(row: dict[str, Any]) -> list[str]:
    m = row["metrics"]
    return [
        *_outcome_cells(row),
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
    """Write report.html (self-contained: plots embedded) and the PNG plots beside it; a
    serving study's report has its own view (see `serving_view`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    view = serving_view if serving(summary) else training_view
    plots, body = view(summary, out_dir)
    style = _STYLE + (_SERVING_STYLE if serving(summary) else "")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>autoprec report: {html.escape(summary["study"])}</title><style>{style}</style></head>
<body>
<h1>autoprec report: {html.escape(summary["study"])}</h1>
<p><b>{html.escape(gains_line(summary))}</b></p>
{body}
</body></html>
"""
    report = out_dir / "report.html"
    report.write_text(page)
    return [report, *plots]


def training_view(summary: dict[str, Any], out_dir: Path) -> tuple[list[Path], str]:
    """A training study's plots and the report's body: the baseline, the anchors and the
    chosen policy side by side, the trade-offs, every trial and the gradients' advice."""
    plots = [
        plot_front(summary, "step_time_ms", out_dir / "front_step_time.png"),
        plot_front(summary, "peak_memory_mb", out_dir / "front_memory.png"),
        plot_dtype_map(summary, out_dir / "dtype_map.png"),
    ]
    best = summary["best"]
    side = [summary["baseline"]]
    side += sorted(
        (t for t in summary["trials"] if t.get("anchor")),
        key=lambda t: ANCHOR_ORDER.index(t["anchor"]) if t["anchor"] in ANCHOR_ORDER else 9,
    )
    if best["number"] != "baseline":
        side += [t for t in summary["trials"] if t["number"] == best["number"] and t not in side]
    advice = "".join(f"<li>{html.escape(w)}</li>" for w in summary.get("advice", []))
    memory_note = (
        "Peak memory on the CPU is an estimate: parameters, gradients, optimizer state and "
        "tensors saved for backward."
        if summary.get("peak_memory_is_estimate")
        else "Peak memory is the device allocator's peak."
    )
    note = html.escape(memory_note)
    body = f"""<p class="note">{note} Where the fastest policies were re-timed side by
side with the baseline, their step times are those re-timings. Feasible: accuracy drop within
{summary["accuracy_tolerance"]:g}. Preference: {html.escape(str(summary["prefer"]))}.</p>
<h2>Baseline, anchors and the chosen policy</h2>
{_html_table(METRIC_HEADER, [_metric_row(r) for r in side])}
<h2>Trade-offs</h2>
{_images(plots)}
{_layers_section(best)}
{_trials_section(summary, METRIC_HEADER, _metric_row)}
<h2>Advice from the fp32 baseline's gradients</h2>
<ul>{advice or "<li>none: no layer would lose gradients or overflow in fp16</li>"}</ul>
{_settings_section(summary)}"""
    return plots, body


def _images(plots: list[Path]) -> str:
    return "".join(
        f'<img alt="{p.stem}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}">'
        for p in plots
    )


def _layers_section(best: dict[str, Any]) -> str:
    layer_rows = [
        [
            html.escape(r["name"]),
            html.escape(r["type"]),
            str(r["params"]),
            f'<span class="{r["dtype"]}">{r["dtype"]}</span>',
        ]
        for r in best.get("layers", [])
    ]
    table = (
        _html_table(["module", "type", "params", "dtype"], layer_rows)
        if layer_rows
        else '<p class="note">No layer table in this summary.</p>'
    )
    return f"""<h2>The chosen policy, layer by layer</h2>
{table}
<pre>{html.escape(yaml.safe_dump(best["policy"], sort_keys=False))}</pre>"""


def _trials_section(
    summary: dict[str, Any],
    header: list[str],
    metric_row: Callable[[dict[str, Any]], list[str]],
) -> str:
    rows = _rows(summary)
    best = summary["best"]["number"]
    classes = [
        "best" if r["number"] == best else ("front" if r.get("pareto") else "") for r in rows
    ]
    return f"""<h2>All trials</h2>
{_html_table(header, [metric_row(r) for r in rows], classes)}"""


def _settings_section(summary: dict[str, Any]) -> str:
    setting_rows = [
        [html.escape(str(k)), html.escape(str(v))] for k, v in summary.get("settings", {}).items()
    ]
    return f"""<h2>Settings</h2>
{_html_table(["setting", "value"], setting_rows)}"""


def render_comparison(summaries: list[dict[str, Any]], path: Path) -> Path:
    """One page comparing studies (e.g. one model on two devices): baseline and chosen
    policy of each, and their fronts in one plot. A serving study's time is its latency
    at its batch size, a training study's its step time."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    kinds = {"latency" if serving(s) else "step time" for s in summaries}
    time_name = kinds.pop() if len(kinds) == 1 else "step time or latency"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for summary in summaries:
        front = sorted((r for r in _rows(summary) if r.get("pareto")), key=lambda r: _step_ms(r))
        for ax, x_metric in zip(axes, ("step_time_ms", "peak_memory_mb"), strict=True):
            xs = [
                _step_ms(r) if x_metric == "step_time_ms" else r["metrics"][x_metric] for r in front
            ]
            ax.scatter(xs, [r["metrics"]["accuracy"] for r in front], label=summary["study"])
    axes[0].set_xlabel(f"{time_name} (ms)")
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
                    html.escape(summary["study"])
                    + (
                        f" (serving, batch {serving_batch_size(summary)})"
                        if serving(summary)
                        else ""
                    ),
                    html.escape(str(settings.get("device_name", settings.get("device", "?")))),
                    html.escape(_label(row)),
                    _cell(m.get("accuracy"), ".4f"),
                    _cell(_step_ms(row), ".3f"),
                    _cell(m.get("peak_memory_mb"), ".3f"),
                    html.escape(policy_label(row["params"])),
                ]
            )
    image = base64.b64encode(png.read_bytes()).decode()
    time_header = {"step time": "step ms", "latency": "latency ms"}.get(time_name, "time ms")
    path.write_text(f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autoprec comparison</title>
<style>{_STYLE}</style></head><body>
<h1>autoprec comparison: {html.escape(", ".join(s["study"] for s in summaries))}</h1>
{_html_table(["study", "device", "policy", "accuracy", time_header, "memory MB", "dtypes"], rows)}
<img alt="fronts" src="data:image/png;base64,{image}">
</body></html>
""")
    return path


# -- the serving view -------------------------------------------------------------------

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
_SERVING_STYLE = ".int8{color:#8172b3}\n"


def _inference(summary: dict[str, Any]) -> dict[str, Any]:
    return summary.get("inference") or {}


def benchmark_rows(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A serving study's entries as the practitioner's benchmark lists them, by short name:
    fp32 (the baseline), each uniform anchor measured, the fp16 body with an fp32 head, and
    the chosen policy where it is none of those."""
    anchors = {t["anchor"]: t for t in summary["trials"] if t.get("anchor")}
    rows = [("fp32", summary["baseline"])]
    rows += [(name, anchors[anchor]) for name, anchor in SERVING_ANCHORS if anchor in anchors]
    best = summary["best"]
    if all(entry["number"] != best["number"] for _, entry in rows):
        rows.append((f"chosen (trial {best['number']})", best))
    return rows


def _versus_fp32(entry: dict[str, Any], baseline: dict[str, Any]) -> str:
    """Latency against fp32's: the side-by-side re-timings where both have one (+)."""
    if entry["number"] == "baseline":
        return "1.00x"
    own, base = entry["metrics"], baseline["metrics"]
    confirmed = "confirmed_step_time_ms" in own and "confirmed_step_time_ms" in base
    key = "confirmed_step_time_ms" if confirmed else "latency_p50_ms"
    if not own.get(key) or not base.get(key):
        return "-"
    return _ratio_words(base[key] / own[key]) + ("+" if confirmed else "")


def _ratio_words(speedup: float) -> str:
    return "1.00x" if round(speedup, 2) == 1.0 else speed_words(speedup)


def _precision(name: str, entry: dict[str, Any], summary: dict[str, Any]) -> str:
    if name.startswith("chosen"):
        return f"chosen: {policy_label(entry['params'])}"
    method = _inference(summary).get("int8")
    label = {"fp32": "fp32 (baseline)", "int8": f"int8 ({method})" if method else "int8"}
    chosen = " - chosen" if entry["number"] == summary["best"]["number"] else ""
    return label.get(name, name) + chosen


def benchmark_table(summary: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """The header, the rows (plain text) and each row's class ("best" for the chosen) of
    the practitioner's benchmark: precision, accuracy, agreement with fp32, memory and
    latency at the scenario's batch size."""
    size = serving_batch_size(summary)
    estimate = "~" if summary.get("peak_memory_is_estimate") else ""
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
        m = entry["metrics"]
        rows.append(
            [
                _precision(name, entry, summary),
                str(entry["number"]),
                _fmt(m.get("accuracy"), ".4f"),
                _fmt(m.get("accuracy_drop"), "+.4f"),
                _fmt(m.get("top1_agreement"), ".2%"),
                _fmt(m.get("peak_memory_mb"), ".3f"),
                _fmt(m.get("weight_mb"), ".3f"),
                _fmt(m.get("latency_p50_ms"), ".3f"),
                _fmt(m.get("latency_p90_ms"), ".3f"),
                _fmt(m.get("throughput_sps"), ".0f"),
                _versus_fp32(entry, summary["baseline"]),
                "yes" if entry["feasible"] else "no",
            ]
        )
        classes.append("best" if entry["number"] == summary["best"]["number"] else "")
    return header, rows, classes


def benchmark_notes(summary: dict[str, Any]) -> list[str]:
    """What the benchmark table's marks mean, and which of its rows are missing and why."""
    size = serving_batch_size(summary)
    notes = [
        f"latency: median (p50) and 90th percentile of one forward at batch {size}; "
        "samples/s over the timed forwards"
    ]
    rows = benchmark_rows(summary)
    if any(_versus_fp32(entry, summary["baseline"]).endswith("+") for _, entry in rows):
        notes.append("+ re-timed side by side with fp32, in alternating blocks")
    if summary.get("peak_memory_is_estimate"):
        notes.append(
            "~ CPU memory is an estimate: weights plus the peak of live activations "
            "(a lower bound: kernels' scratch memory is not counted)"
        )
    measured = {entry.get("anchor") for _, entry in rows}
    for name, anchor in SERVING_ANCHORS:
        if anchor not in measured:
            why = (
                "int8 is off, or has no kernels on this device"
                if anchor == "uniform-int8" and not _inference(summary).get("int8")
                else "the device or the model's layers do not take it, or the budget ended first"
            )
            notes.append(f"{name}: not measured ({why})")
    for name, entry in rows:
        if entry["state"] != "complete":
            notes.append(f"{name}: {entry['state']}: {entry.get('reason') or 'no reason given'}")
    return notes


def benchmark_text(summary: dict[str, Any]) -> str:
    """The practitioner's benchmark of a serving study as an aligned text table; a long
    chosen policy is spelled out below it."""
    header, rows, classes = benchmark_table(summary)
    notes = ["* chosen policy", *benchmark_notes(summary)]
    for row in rows:
        if row[0].startswith("chosen: ") and len(row[0]) > 48:
            notes.insert(1, f"chosen (trial {row[1]}): {row[0].removeprefix('chosen: ')}")
            row[0] = "chosen, mixed (see below)"
    marked = [["*" if c == "best" else "", *row] for row, c in zip(rows, classes, strict=True)]
    return "\n".join([text_table([["", *header], *marked]), *notes])


def batch_latencies(summary: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Median latency (ms) at each batch size measured, by entry (trial number as text).

    From each entry's ``latency_by_batch_ms`` where the summary holds it; else from what
    it does hold: every entry's latency at the scenario's batch size, and fp32's and each
    batch size's best one at every size (`autoprec.search.summary.by_batch_size`)."""
    main = serving_batch_size(summary)
    found: dict[str, dict[int, float]] = {}
    for entry in _rows(summary):
        key = str(entry["number"])
        if "latency_by_batch_ms" in entry:
            found[key] = {int(k): float(v) for k, v in entry["latency_by_batch_ms"].items()}
        elif entry["metrics"].get("latency_p50_ms") is not None and main is not None:
            found[key] = {main: entry["metrics"]["latency_p50_ms"]}
    for row in _inference(summary).get("by_batch_size", []):
        size = row["batch_size"]
        if row.get("fp32_latency_ms") is not None:
            found.setdefault("baseline", {}).setdefault(size, row["fp32_latency_ms"])
        found.setdefault(str(row["best"]), {}).setdefault(size, row["latency_ms"])
    return found


def _name_of(summary: dict[str, Any], key: str) -> str:
    """An entry's benchmark name (fp32, int8, chosen ...), else its trial number."""
    names = {str(entry["number"]): name for name, entry in benchmark_rows(summary)}
    return names.get(key, f"trial {key}")


def batch_size_table(summary: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """Where the best choice flips: for each batch size measured (ascending), the fastest
    feasible policy there against fp32's latency, and each benchmark row's latency there.
    The scenario's batch size is marked (class "best")."""
    latencies = batch_latencies(summary)
    entries = {str(e["number"]): e for e in _rows(summary)}
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
    main = serving_batch_size(summary)
    rows, classes = [], []
    for row in sorted(_inference(summary).get("by_batch_size", []), key=lambda r: r["batch_size"]):
        size, key = row["batch_size"], str(row["best"])
        speedup = row.get("speedup_vs_fp32")
        rows.append(
            [
                f"{size}" + (" (scenario)" if size == main else ""),
                _name_of(summary, key),
                _dtypes_unless_named(summary, entries.get(key)),
                _fmt(row["latency_ms"], ".3f"),
                _fmt(row.get("fp32_latency_ms"), ".3f"),
                _ratio_words(speedup) if speedup else "-",
                *(_fmt(latencies.get(str(e["number"]), {}).get(size), ".3f") for _, e in others),
            ]
        )
        classes.append("best" if size == main else "")
    return header, rows, classes


def _dtypes_unless_named(summary: dict[str, Any], entry: dict[str, Any] | None) -> str:
    """A policy's dtypes, where its name (fp32, int8, ...) does not already say them."""
    if entry is None:
        return "-"
    named = _name_of(summary, str(entry["number"]))
    return (
        "as named" if not named.startswith(("trial", "chosen")) else policy_label(entry["params"])
    )


def batch_size_notes(summary: dict[str, Any]) -> list[str]:
    """How the best at each batch size was picked, and what the summary lacks."""
    notes = [
        "best there: the feasible policy with the lowest median latency at that batch size, "
        f"by the trials' own timings (within {TIME_TIE:.0%} a tie, to less memory); the "
        "study's choice is made at the scenario's batch size, under its preference"
    ]
    if any("latency_by_batch_ms" not in entry for entry in _rows(summary)):
        notes.append(
            "this summary holds each policy's latency at the scenario's batch size only, "
            "fp32's and the best one's at every size: '-' where it holds none"
        )
    return notes


def batch_size_text(summary: dict[str, Any]) -> str:
    """`batch_size_table` as aligned text, the scenario's batch size marked ``*``."""
    header, rows, classes = batch_size_table(summary)
    notes = batch_size_notes(summary)
    for row in rows:
        if len(row[2]) > 48:  # a long policy is spelled out below the table
            notes.append(f"{row[1]}: {row[2]}")
            row[2] = "see below"
    marked = [["*" if c == "best" else "", *row] for row, c in zip(rows, classes, strict=True)]
    return "\n".join([text_table([["", *header], *marked]), *notes])


def _series_style(name: str) -> dict[str, Any]:
    if name.startswith("chosen"):
        return {"color": "#222222", "linestyle": "--"}
    return {"color": SERVING_DTYPE_COLOURS.get(name, "#937860")}


def plot_batch_latency(summary: dict[str, Any], path: Path) -> Path:
    """Latency per forward against batch size for fp32, each uniform anchor and the chosen
    policy, with the best at each batch size starred and named: where the choice flips."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter, NullLocator

    latencies = batch_latencies(summary)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, entry in benchmark_rows(summary):
        points = sorted(latencies.get(str(entry["number"]), {}).items())
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=name, **_series_style(name))
    flips = _inference(summary).get("by_batch_size", [])
    ax.scatter(
        [r["batch_size"] for r in flips],
        [r["latency_ms"] for r in flips],
        marker="*",
        s=260,
        facecolors="none",
        edgecolors="black",
        label="best at this batch size",
        zorder=3,
    )
    for row in flips:
        ax.annotate(
            _name_of(summary, str(row["best"])),
            (row["batch_size"], row["latency_ms"]),
            fontsize=7,
            xytext=(6, -10),
            textcoords="offset points",
        )
    sizes = sorted({r["batch_size"] for r in flips} | set(_inference(summary)["batch_sizes"]))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("batch size")
    ax.set_ylabel("latency per forward, p50 (ms)")
    ax.set_title(f"{summary['study']}: latency by batch size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _saved(fig, path)


def serving_view(summary: dict[str, Any], out_dir: Path) -> tuple[list[Path], str]:
    """A serving study's plots and the report's body: the practitioner's benchmark at the
    scenario's batch size, latency and memory against accuracy, where the best choice
    flips across batch sizes, the chosen policy, every trial and the settings."""
    plots = [
        plot_front(summary, "latency_p50_ms", out_dir / "front_latency.png"),
        plot_front(summary, "peak_memory_mb", out_dir / "front_memory.png"),
        plot_dtype_map(summary, out_dir / "dtype_map.png"),
    ]
    flips = ""
    if len(_inference(summary).get("batch_sizes", [])) > 1:
        plots.append(plot_batch_latency(summary, out_dir / "latency_by_batch.png"))
        header, rows, classes = batch_size_table(summary)
        flips = f"""<h2>Where the best choice flips: each batch size measured</h2>
{_html_table(header, [[html.escape(c) for c in r] for r in rows], classes)}
<p class="note">{"<br>".join(html.escape(n) for n in batch_size_notes(summary))}</p>
{_images(plots[3:])}"""
    header, rows, classes = benchmark_table(summary)
    body = f"""<p class="note">{html.escape(_serving_note(summary))}</p>
<h2>Precision, accuracy, memory and latency at batch {serving_batch_size(summary)}</h2>
{_html_table(header, [[html.escape(c) for c in r] for r in rows], classes)}
<p class="note">{"<br>".join(html.escape(n) for n in benchmark_notes(summary))}</p>
<h2>Trade-offs</h2>
{_images(plots[:3])}
{flips}
{_layers_section(summary["best"])}
{_trials_section(summary, SERVING_METRIC_HEADER, _serving_metric_row)}
{_settings_section(summary)}"""
    return plots, body


def _serving_note(summary: dict[str, Any]) -> str:
    """The scenario, what counts as feasible, how memory was measured, the int8 method
    and where the fp32 weights are kept."""
    info = _inference(summary)
    preset = SCENARIOS.get(info.get("scenario") or "")
    about = f" ({preset.about})" if preset else ""
    bounds = [f"accuracy drop within {summary['accuracy_tolerance']:g}"]
    if info.get("min_top1_agreement") is not None:
        bounds.append(f"top-1 agreement with fp32 at least {info['min_top1_agreement']:.2%}")
    if info.get("max_rel_deviation") is not None:
        bounds.append(f"relative output deviation at most {info['max_rel_deviation']:g}")
    memory = (
        "Peak memory on the CPU is an estimate: the weights plus the peak of live "
        "activations over one forward."
        if summary.get("peak_memory_is_estimate")
        else "Peak memory is the device allocator's over one forward, weights and inputs in."
    )
    parts = [
        f"Scenario {info.get('scenario')}{about}: served at batch "
        f"{serving_batch_size(summary)}, the choice preferring {summary['prefer']}.",
        f"Feasible: {', '.join(bounds)}.",
        memory,
        f"int8: {info['int8']}." if info.get("int8") else "int8: not searched.",
    ]
    if summary.get("step_times_confirmed"):
        parts.append("The fastest were re-timed side by side with fp32; the choice uses that.")
    if info.get("fp32_checkpoint"):
        parts.append(
            f"The fp32 weights every policy was converted from: {info['fp32_checkpoint']}."
        )
    return " ".join(parts)


def _serving_metric_row(row: dict[str, Any]) -> list[str]:
    m = row["metrics"]
    return [
        *_outcome_cells(row),
        _cell(m.get("top1_agreement"), ".2%"),
        _cell(m.get("max_rel_deviation"), ".2e"),
        _cell(_step_ms(row), ".3f"),
        _cell(m.get("peak_memory_mb"), ".3f"),
        _cell(m.get("weight_mb"), ".3f"),
        _cell(m.get("low_precision_share"), ".0%"),
        _cell(row["feasible"]),
        _cell(row.get("pareto", False)),
        html.escape(policy_label(row["params"])),
        html.escape(row.get("reason") or ""),
    ]
