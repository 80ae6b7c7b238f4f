"""The report as a person reads it: plots whose legend says what is drawn and whose
labels stay inside the axes, and settings written for people, on a small real search."""

from __future__ import annotations

import copy
import json

import pytest

from autoprec.report import front_figure, render_report


@pytest.fixture(scope="module")
def summary(finished):
    folder, _ = finished
    return json.loads((folder / "runs/tiny/summary.json").read_text())


def _legend_and_texts(figure):
    ax = figure.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    return ax, legend, [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("x_metric", ["step_time_ms", "peak_memory_mb"])
def test_point_labels_stay_inside_the_axes(summary, x_metric):
    figure = front_figure(summary, x_metric)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    ax = figure.axes[0]
    box = ax.get_window_extent(renderer)
    labels = [t for t in ax.texts if t.get_text().startswith(("trial", "fp32"))]
    assert labels  # the baseline and the anchors are named
    for label in labels:
        extent = label.get_window_extent(renderer)
        assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, label.get_text()
        assert box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1, label.get_text()
        assert not extent.overlaps(ax.title.get_window_extent(renderer)), label.get_text()


def _text_boxes(figure):
    from matplotlib.text import Text

    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    ax = figure.axes[0]
    labels = [t for t in ax.texts if t.get_text().startswith(("trial", "fp32"))]
    return ax, renderer, {t.get_text(): Text.get_window_extent(t, renderer) for t in labels}


@pytest.mark.parametrize("x_metric", ["step_time_ms", "peak_memory_mb"])
def test_point_labels_overlap_no_other_label_even_where_the_points_crowd(summary, x_metric):
    """The search's own points, then the same with every trial placed a hair apart (as
    policies of one speed are): each label still stands clear of the others."""
    crowded = copy.deepcopy(summary)
    for index, row in enumerate(crowded["trials"]):
        row["metrics"]["accuracy"] = crowded["baseline"]["metrics"]["accuracy"]
        row["metrics"][x_metric] = crowded["baseline"]["metrics"][x_metric] * (1 + 0.01 * index)
        row["metrics"].pop("confirmed_step_time_ms", None)  # the plot's time: this one
    crowded["baseline"]["metrics"].pop("confirmed_step_time_ms", None)
    for case in (summary, crowded):
        ax, renderer, boxes = _text_boxes(front_figure(case, x_metric))
        assert len(boxes) >= 2
        frame = ax.get_window_extent(renderer)
        names = sorted(boxes)
        for i, name in enumerate(names):
            assert frame.x0 - 1 <= boxes[name].x0 and boxes[name].x1 <= frame.x1 + 1, name
            for other in names[i + 1 :]:
                assert not boxes[name].overlaps(boxes[other]), (name, other)


def test_the_legend_lists_only_what_is_drawn(summary):
    _, legend, texts = _legend_and_texts(front_figure(summary, "step_time_ms"))
    drawn_infeasible = any(
        not r["feasible"] and not r["pareto"] and r["state"] == "complete"
        for r in summary["trials"]
    )
    assert any(e.startswith("infeasible") for e in legend) == drawn_infeasible
    # A trial pruned in this search (its metrics are NaN, as Optuna records them) is
    # not placeable: the plot counts it instead of hiding it.
    pruned = copy.deepcopy(summary)
    row = next(t for t in pruned["trials"] if t["number"] != pruned["best"]["number"])
    row.update(state="pruned", feasible=False, pareto=False, reason="overflow: test")
    row["metrics"] = {k: None for k in row["metrics"]}
    _, legend, texts = _legend_and_texts(front_figure(pruned, "step_time_ms"))
    assert "not drawn (no accuracy measured): 1 pruned" in texts


def test_settings_are_written_for_people(summary, tmp_path):
    readable = copy.deepcopy(summary)
    readable["settings"].update(trial_timeout_s=635.0023337750031, checkpoint=None)
    render_report(readable, tmp_path)
    page = (tmp_path / "report.html").read_text()
    settings = page[page.index("<h2>Settings</h2>") :]
    assert "<td>trial_timeout_s</td><td>635 s</td>" in settings
    assert "<td>checkpoint</td><td>none</td>" in settings
    assert "<td>devices</td><td>cpu</td>" in settings
    assert "None" not in settings and "['" not in settings and "635.00" not in settings
