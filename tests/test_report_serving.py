"""The report of a serving search: the practitioner's benchmark table, where the best
choice flips across batch sizes, and the plots, from a small real search."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
from PIL import Image

import autoprec
from autoprec.cli import main
from autoprec.report import (
    batch_latencies,
    batch_size_table,
    batch_size_text,
    benchmark_table,
    benchmark_text,
    front_table,
    gains_line,
    render_comparison,
    render_report,
)

PNGS = ("front_latency.png", "front_memory.png", "dtype_map.png", "latency_by_batch.png")
pytestmark = pytest.mark.slow  # a real search: about 10 s on two busy cores


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serving")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        result = autoprec.search(
            "digits-mlp",
            mode="serving",
            scenario="batch",
            batch_sizes="1,64",
            trials=6,
            steps=40,
            device="cpu",
            confirm_top=0,
            study="served",
        )
    summary = result.summary
    for entry in [summary["baseline"], *summary["trials"], summary["best"]]:
        assert set(entry["latency_by_batch_ms"]) == {"64", "1"} or entry["state"] != "complete"
    render_report(summary, folder / "report")
    return folder, summary


def test_the_benchmark_table_has_fp32_the_uniform_anchors_and_the_chosen_policy(served):
    folder, summary = served
    header, rows, classes = benchmark_table(summary)
    assert header[:3] == ["precision", "trial", "accuracy"]
    assert "memory MB~" in header  # a CPU estimate
    assert {"top-1 agreement", "weight MB", "p50 ms @64", "p90 ms @64", "samples/s"} <= set(header)
    names = [row[0] for row in rows]
    assert names[0].startswith("fp32 (baseline)")
    assert [n.split(" - ")[0] for n in names[1:5]] == [
        "fp16",
        "bf16",
        "int8 (dynamic)",
        "fp16 body, fp32 head",
    ]
    assert classes.count("best") == 1
    chosen = rows[classes.index("best")]
    assert chosen[1] == str(summary["best"]["number"])
    best_p50 = summary["best"]["metrics"]["latency_p50_ms"]
    assert chosen[header.index("p50 ms @64")] == f"{best_p50:.3f}"
    assert rows[0][header.index("vs fp32")] == "1.00x"
    page = (folder / "report/report.html").read_text()
    for name in names:
        assert f"<td>{name}</td>" in page
    assert "fp32 (baseline)" in benchmark_text(summary)


def test_the_batch_size_table_says_where_the_best_choice_flips(served):
    _, summary = served
    header, rows, classes = batch_size_table(summary)
    assert header[:6] == [
        "batch size",
        "best there",
        "its dtypes",
        "latency ms",
        "fp32 ms",
        "vs fp32",
    ]
    assert [row[0] for row in rows] == ["1", "64 (scenario)"]
    assert classes == ["", "best"]
    latencies = batch_latencies(summary)
    feasible = {
        str(e["number"]) for e in [summary["baseline"], *summary["trials"]] if e["feasible"]
    }
    for row, size in zip(rows, (1, 64), strict=True):
        fastest = min(latencies[k][size] for k in feasible if size in latencies[k])
        assert float(row[3]) <= fastest * 1.06 + 1e-3  # the fastest, or tied with it
        assert row[4] == f"{latencies['baseline'][size]:.3f}"
        assert all(cell != "-" for cell in row[6:])  # every row's latency at every size
    assert "'-' where it holds none" not in batch_size_text(summary)


def test_plots_are_valid_images(served):
    folder, _ = served
    for name in PNGS:
        with Image.open(folder / "report" / name) as image:
            image.verify()
        with Image.open(folder / "report" / name) as image:
            assert image.format == "PNG"
            assert 300 <= image.size[0] <= 3000 and 200 <= image.size[1] <= 3000


def test_training_only_parts_are_left_out_and_the_text_reads_for_serving(served):
    folder, summary = served
    page = (folder / "report/report.html").read_text()
    assert "Advice from the fp32 baseline" not in page
    assert "loss scale" not in page and "step ms" not in page
    assert "Where the best choice flips" in page and 'src="data:image/png;base64,' in page
    assert "latency at batch 64" in front_table(summary)
    line = gains_line(summary)
    if summary["best"]["number"] != "baseline":
        assert "at batch 64" in line
        word = "faster" if summary["best"]["speedup_vs_fp32"] >= 1 else "slower"
        assert f"x {word} at batch 64" in line


def test_the_summary_as_written_reports_too(served):
    """Through the command, from summary.json as the search wrote it."""
    folder, _ = served
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        assert main(["report", "--study", "served"]) == 0
    finally:
        os.chdir(cwd)
    for name in ("report.html", *PNGS):
        assert (folder / "runs/served" / name).is_file()
    written = json.loads((folder / "runs/served/summary.json").read_text())
    _, rows, _ = batch_size_table(written)
    assert [row[0] for row in rows] == ["1", "64 (scenario)"]
    assert all(row[3] != "-" and row[4] != "-" for row in rows)


def test_missing_anchors_are_named_with_the_reason(served, tmp_path):
    """A study without int8 (the int8 anchor's trial taken out, as when int8 is off): if
    the search had chosen that trial, fp32 is the choice the study would have made."""
    _, summary = served
    summary = copy.deepcopy(summary)
    summary["trials"] = [t for t in summary["trials"] if t.get("anchor") != "uniform-int8"]
    summary["serving"]["int8"] = None
    if summary["best"]["anchor"] == "uniform-int8":
        summary["best"] = {**summary["best"], **summary["baseline"], "speedup_vs_fp32": 1.0}
        summary["best"]["memory_saving_vs_fp32"] = 0.0
    text = benchmark_text(summary)
    assert "int8: not measured (int8 is off, or has no kernels on this device)" in text
    assert "int8 (" not in text
    files = render_report(summary, tmp_path)
    assert all(Path(f).is_file() for f in files)


def test_compare_two_serving_studies(served, tmp_path):
    _, summary = served
    out = render_comparison([summary, {**summary, "study": "other"}], tmp_path / "cmp.html")
    page = out.read_text()
    assert "<th>latency ms</th>" in page and "(serving, batch 64)" in page
