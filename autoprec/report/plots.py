"""The report's PNG plots: accuracy against time or memory with the Pareto front, and the
dtype of each layer group by policy (a mode's own plots are its view's)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from autoprec._util.files import write_atomic
from autoprec.report.modes import mode_text
from autoprec.study.summary_schema import Entry, Summary, as_summary

ANCHOR_ORDER = (
    "uniform-fp16",
    "uniform-fp16-noscale",
    "uniform-bf16",
    "uniform-fp8",
    "uniform-int8",
    "fp16-body-fp32-head",
)


def anchor_rank(entry: Entry) -> int:
    """Where an anchor sits in the report's tables and plots: the ANCHOR_ORDER."""
    return ANCHOR_ORDER.index(entry.anchor) if entry.anchor in ANCHOR_ORDER else 9


def plot_front(
    summary: Summary | dict[str, Any],
    x_metric: str,
    path: Path,
    point_names: dict[str, str] | None = None,
) -> Path:
    """Accuracy against the study's time (its `Summary.time_metric`: ``step_time_ms``,
    ``latency_p50_ms`` at the serving study's batch size, ...) or another metric (peak
    memory: ``peak_memory_mb``); the Pareto front highlighted."""
    return saved(front_figure(summary, x_metric, point_names), path)


def front_figure(
    summary: Summary | dict[str, Any], x_metric: str, point_names: dict[str, str] | None = None
) -> Any:
    """The figure of `plot_front`. The legend lists only what is drawn; trials that
    measured no accuracy (pruned, failed) cannot be placed and are counted in a note;
    point labels stay inside the axes. ``point_names`` (by entry key) name the points
    with short, staggered names, as a serving view does where policies tie in accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    summary = as_summary(summary)
    timed = x_metric == summary.time_metric

    def measured_x(entry: Entry) -> float | None:
        return summary.time_ms(entry) if timed else entry.metrics.get(x_metric)

    placed = {
        e.key: (x, e.accuracy)
        for e in summary.entries
        if e.complete and (x := measured_x(e)) is not None and e.accuracy is not None
    }
    complete = [e for e in summary.entries if e.key in placed]

    def x_of(entry: Entry) -> float:
        return placed[entry.key][0]

    def y_of(entry: Entry) -> float:
        return placed[entry.key][1]

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for feasible, marker, name in (
        (True, "o", "feasible"),
        (False, "x", "infeasible (accuracy drop past tolerance)"),
    ):
        points = [e for e in complete if e.feasible == feasible and not e.pareto]
        if points:
            ax.scatter(
                [x_of(e) for e in points],
                [y_of(e) for e in points],
                marker=marker,
                c="#999999",
                label=name,
            )
    front = sorted((e for e in complete if e.pareto), key=x_of)
    # The front is over three objectives: in a 2-D view its points need not form a line.
    ax.scatter(
        [x_of(e) for e in front],
        [y_of(e) for e in front],
        c="#c44e52",
        label="Pareto front (3 objectives)",
    )
    best = next(e for e in complete if e.key == summary.best.key)
    ax.scatter(
        [x_of(best)], [y_of(best)], s=180, facecolors="none", edgecolors="black", label="chosen"
    )
    ax.margins(x=0.08, y=0.12)
    unit = (
        f"{mode_text(summary).time_at(summary)} (ms)"
        if timed
        else "peak memory (MB)" + (", CPU estimate" if summary.peak_memory_is_estimate else "")
    )
    ax.set_xlabel(unit)
    ax.set_ylabel("accuracy")
    ax.set_title(f"{summary.study}: accuracy against {unit.split(' (')[0]}")
    fig.tight_layout()  # the axes' final size, before labels are placed in it
    _label_points(summary, ax, [(e, x_of(e), y_of(e)) for e in complete], point_names)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    unplaced = _unplaced_note(summary)
    if unplaced:
        ax.text(0.01, 0.01, unplaced, transform=ax.transAxes, fontsize=7, color="#666666")
    return fig


def _label_points(
    summary: Summary,
    ax: Any,
    points: list[tuple[Entry, float, float]],
    point_names: dict[str, str] | None,
) -> None:
    """Names of the baseline, the anchors and the chosen policy beside their points
    (entry, x, y). Each label takes the first of a few places around its point, moving
    out step by step, where it overlaps no label already placed and no other point and
    stays inside the axes (and off the title); a label set away from its point gets a
    thin line to it. ``point_names`` give short names by entry key."""
    named = [p for p in points if p[0].is_baseline or p[0].key == summary.best.key or p[0].anchor]
    named.sort(key=lambda p: (p[1], p[2]))
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    title = ax.title.get_window_extent(renderer)
    dots = [ax.transData.transform((x, y)) for _, x, y in points]
    taken: list[Any] = []
    for entry, x, y in named:
        text = entry.label if point_names is None else point_names.get(entry.key, entry.label)
        own = ax.transData.transform((x, y))
        label = None
        # The first clear place inside the axes; where none is, the first inside.
        for tries, (dx, dy) in enumerate([*_LABEL_PLACES, *_LABEL_PLACES], 1):
            if label is not None:
                label.remove()
            label = ax.annotate(
                text,
                (x, y),
                fontsize=7,
                xytext=(dx, dy),
                textcoords="offset points",
                ha="left" if dx >= 0 else "right",
                va="bottom" if dy >= 0 else "top",
                annotation_clip=True,
                clip_on=True,
                arrowprops=None
                if abs(dy) <= _NEAR_PT
                else {"arrowstyle": "-", "color": "#888888", "lw": 0.5, "shrinkA": 0},
            )
            box = _text_box(label, renderer).expanded(1.04, 1.1)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1
            inside = inside and frame.y0 <= box.y0 and box.y1 <= frame.y1
            inside = inside and not box.overlaps(title)
            if inside and (tries > len(_LABEL_PLACES) or _clear(box, taken, dots, own)):
                break
        assert label is not None
        taken.append(_text_box(label, renderer))


def _text_box(label: Any, renderer: Any) -> Any:
    """A label's text alone (an annotation's own extent includes its line to the point)."""
    from matplotlib.text import Text

    label.update_positions(renderer)
    return Text.get_window_extent(label, renderer)


def _clear(box: Any, taken: list[Any], dots: list[Any], own: Any) -> bool:
    """Whether a label's box overlaps no label placed and no point but its own."""
    if any(box.overlaps(other) for other in taken):
        return False
    return not any(
        box.x0 - 3 <= px <= box.x1 + 3 and box.y0 - 3 <= py <= box.y1 + 3
        for px, py in dots
        if abs(px - own[0]) + abs(py - own[1]) > 1
    )


# Where a label may go, in points from its point: beside it first, then further above or
# below it (with a line to it), right of it before left of it.
_NEAR_PT = 4
_LABEL_PLACES = [
    (dx, sign * dy) for dy in (_NEAR_PT, 12, 20, 28, 36, 44) for sign in (1, -1) for dx in (5, -5)
]


def _unplaced_note(summary: Summary) -> str:
    """Trials not in the plot because they measured no accuracy, counted by state."""
    counts: dict[str, int] = {}
    for entry in summary.entries:
        if not entry.complete or entry.accuracy is None:
            counts[entry.state] = counts.get(entry.state, 0) + 1
    if not counts:
        return ""
    listed = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    return f"not drawn (no accuracy measured): {listed}"


def saved(fig: Any, path: Path) -> Path:
    """Lay the figure out, write it to ``path`` and free it. It is drawn into memory and
    written by `write_atomic`, since ``savefig`` given a path writes through a link."""
    fig.tight_layout()
    return write_atomic(path, png_bytes(fig))


def png_bytes(fig: Any) -> bytes:
    """The figure drawn as a PNG, in memory; the figure is freed."""
    import matplotlib.pyplot as plt

    drawn = io.BytesIO()
    try:
        fig.savefig(drawn, format="png")
    finally:
        plt.close(fig)
    return drawn.getvalue()


def plot_dtype_map(summary: Summary | dict[str, Any], path: Path, top: int = 8) -> Path:
    """Rows: the baseline, the anchors, the chosen policy and the best feasible others;
    columns: the searched groups; colour: dtype."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    summary = as_summary(summary)
    rows = [summary.baseline]
    rows += sorted((t for t in summary.trials if t.anchor), key=anchor_rank)
    feasible = sorted(
        (t for t in summary.trials if t.feasible and not t.anchor),
        key=lambda t: summary.time_ms(t) or float("inf"),
    )
    best = summary.best.key
    chosen = [t for t in summary.trials if t.key == best and not t.anchor]
    rows += chosen + [t for t in feasible if t.key != best][: max(0, top - len(chosen))]
    groups = summary.baseline.groups
    colours = mode_text(summary).colours
    codes = {dtype: code for code, dtype in enumerate(colours)}
    grid = [[codes[r.dtype_of(g)] for g in groups] for r in rows]
    width_in = max(5.5, 3.0 + 0.9 * len(groups))
    height_in = max(2.5, 0.9 + 0.38 * len(rows))
    fig, ax = plt.subplots(figsize=(width_in, height_in), dpi=110)
    cmap = ListedColormap(list(colours.values()))
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(colours) - 1, aspect="auto")
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    labels = [r.label + (" *" if r.key == best else "") for r in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    drawn = {r.dtype_of(g) for r in rows for g in groups}  # every format has a colour
    ax.legend(
        handles=[Patch(color=c, label=d) for d, c in colours.items() if d in drawn],
        bbox_to_anchor=(1.02, 1),
        loc="upper left",
        fontsize=8,
    )
    ax.set_title("dtype by layer group (* chosen)", fontsize=9)
    return saved(fig, path)
