"""The typed summary: summary.json as today's code wrote it (tests/data, written before the
schema had a version) loads, reads by field and writes back the same shape; and the best
at each batch size agrees with the choice where the choice used side-by-side re-timings."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from autoprec.errors import AutoprecError
from autoprec.policy import Policy
from autoprec.report import front_table, gains_line, render_report
from autoprec.serving.measure import ServingResult
from autoprec.study._records import TrialRecord
from autoprec.study._summary_file import read_header, read_summary
from autoprec.study.serving_summary import Serving, by_batch_size
from autoprec.study.summary import best_record, write_outputs
from autoprec.study.summary_schema import SCHEMA_VERSION, Summary, finite

DATA = Path(__file__).parent / "data"
WRITTEN_BEFORE_THE_VERSION = ["summary_v0_training.json", "summary_v0_serving.json"]


def _copy(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / "runs" / "old"
    folder.mkdir(parents=True)
    return Path(shutil.copy(DATA / name, folder / "summary.json"))


def _current_names(old: dict) -> dict:
    """An old summary as it reads now: ``inference``, the serving mode's earlier name, is
    ``serving``, in the mode and as the key of the mode's own part (same order)."""
    if old["mode"] != "inference":
        return old
    return {
        ("serving" if key == "inference" else key): ("serving" if key == "mode" else value)
        for key, value in old.items()
    }


@pytest.mark.parametrize("name", WRITTEN_BEFORE_THE_VERSION)
def test_an_old_summary_loads_and_round_trips(tmp_path, name):
    old = json.loads((DATA / name).read_text())
    summary = read_summary(_copy(tmp_path, name), "old")
    assert summary.schema_version == 0  # as written, before the version was recorded
    again = finite(summary.to_json())
    assert again.pop("schema_version") == SCHEMA_VERSION
    # The same shape, key for key, value for value, the serving mode under its one name.
    assert again == _current_names(old)
    # Written by the new code and read back: the same summary.
    write_outputs(summary, Policy.from_dict(summary.best.policy or {}), tmp_path / "new")
    written = json.loads((tmp_path / "new" / "summary.json").read_text())
    assert written["schema_version"] == SCHEMA_VERSION
    assert Summary.from_json(written).to_json() == summary.to_json() | {
        "schema_version": SCHEMA_VERSION
    }


@pytest.mark.parametrize("name", WRITTEN_BEFORE_THE_VERSION)
def test_fields_read_what_the_keys_held(tmp_path, name):
    old = json.loads((DATA / name).read_text())
    summary = read_summary(_copy(tmp_path, name), "old")
    assert summary.mode == _current_names(old)["mode"] and summary.study == old["study"]
    assert summary.best.key == str(old["best"]["number"])
    assert summary.best.speedup_vs_fp32 == old["best"]["speedup_vs_fp32"]
    assert [layer.name for layer in summary.best.layers] == [
        row["name"] for row in old["best"]["layers"]
    ]
    assert [e.key for e in summary.entries] == [
        str(e["number"]) for e in [old["baseline"], *old["trials"]]
    ]
    assert summary.settings.task_spec == old["settings"]["task_spec"]
    assert summary.settings.device == old["settings"]["device"]
    for entry, row in zip(summary.entries, [old["baseline"], *old["trials"]], strict=True):
        assert entry.accuracy == row["metrics"]["accuracy"]
        assert summary.time_ms(entry) == row["metrics"].get(
            "confirmed_step_time_ms", row["metrics"][summary.time_metric]
        )
    header = read_header(_copy(tmp_path / "header", name), "old")
    assert header.mode == _current_names(old)["mode"]
    assert header.settings.int8 == old["settings"].get("int8")
    if old["mode"] in ("inference", "serving"):
        assert isinstance(summary.part, Serving)
        assert summary.batch_size == old["inference"]["batch_sizes"][0]
        by_size = {r.batch_size: r.best for r in summary.part.by_batch_size}
        assert by_size == {r["batch_size"]: r["best"] for r in old["inference"]["by_batch_size"]}
        assert summary.part.mlflow_model is not None
        assert summary.part.mlflow_model.logged == old["inference"]["mlflow_model"]["logged"]
    else:
        assert summary.part is None and summary.batch_size is None


@pytest.mark.parametrize("name", WRITTEN_BEFORE_THE_VERSION)
def test_the_report_reads_an_old_summary(tmp_path, name):
    summary = read_summary(_copy(tmp_path, name), "old")
    assert f"* {summary.best.key}" in front_table(summary).replace("*  ", "* ")
    assert gains_line(summary).startswith("best: ")
    files = render_report(summary, tmp_path / "report")
    assert files[0].name == "report.html" and all(p.stat().st_size > 0 for p in files)
    assert f"autoprec report: {summary.study}" in files[0].read_text()


def test_a_summary_from_a_newer_autoprec_is_refused_in_one_line(tmp_path):
    path = _copy(tmp_path, WRITTEN_BEFORE_THE_VERSION[0])
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(AutoprecError, match=r"schema_version: .* newer than this autoprec"):
        read_summary(path, "old")


def test_non_finite_metrics_come_back_as_floats(tmp_path):
    path = _copy(tmp_path, WRITTEN_BEFORE_THE_VERSION[0])
    data = json.loads(path.read_text())
    data["trials"][0]["metrics"]["final_loss"] = "nan"
    path.write_text(json.dumps(data))
    summary = read_summary(path, "old")
    assert math.isnan(summary.trials[0].metrics["final_loss"])
    assert finite(summary.to_json())["trials"][0]["metrics"]["final_loss"] == "nan"


def _served(number, own_ms: dict[int, float], memory_mb: float) -> TrialRecord:
    """A feasible serving measurement with its own latencies at each batch size."""
    result = ServingResult(
        "complete",
        accuracy=0.9,
        accuracy_drop=0.0,
        latency_p50_ms=own_ms[8],
        peak_memory_mb=memory_mb,
        batch_size=8,
        latency_by_batch_ms={str(k): v for k, v in own_ms.items()},
    )
    return TrialRecord(number, Policy.from_dict({"default": "fp32"}), result, 0.0, True)


def test_the_best_at_the_scenario_batch_size_is_the_re_timed_choice():
    """Issue 18: the trials' first latencies are noisy. Here trial 1's first timing at
    batch 8 was slow (a busy machine), and side by side it is twice as fast as fp32: the
    choice takes trial 1, and so must the best at batch 8. Batch 1 was not re-timed."""
    baseline = _served("baseline", {8: 10.0, 1: 2.0}, memory_mb=4.0)
    trial = _served(1, {8: 12.0, 1: 1.0}, memory_mb=2.0)
    confirmed = {"baseline": 10.0, "1": 5.0}
    chosen = best_record([trial], baseline, "speed", confirmed)
    rows = {r.batch_size: r for r in by_batch_size([trial], baseline, [8, 1], confirmed)}
    assert rows[8].best == chosen.number == 1
    assert rows[8].latency_ms == confirmed["1"]
    assert rows[8].fp32_latency_ms == confirmed["baseline"]
    assert rows[8].speedup_vs_fp32 == pytest.approx(confirmed["baseline"] / confirmed["1"])
    assert rows[1].best == 1 and rows[1].latency_ms == 1.0  # its own timing, not re-timed
    # Nothing re-timed: each trial's own latencies, as before.
    unconfirmed = {r.batch_size: r.best for r in by_batch_size([trial], baseline, [8, 1])}
    assert unconfirmed == {8: "baseline", 1: 1}


@pytest.mark.parametrize("name", WRITTEN_BEFORE_THE_VERSION)
def test_an_old_summary_renders_as_it_did(tmp_path, name):
    """The report, its front table, its final line and its files, as the code before the
    mode object rendered them (tests/data/rendered, made at commit 02c1348): the same,
    character for character, but the embedded plots' bytes (matplotlib's to decide)."""
    summary = read_summary(_copy(tmp_path, name), "old")
    files = render_report(summary, tmp_path / "report")
    html = re.sub(
        r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:image/png;base64,...", files[0].read_text()
    )
    text = "\n".join([front_table(summary), gains_line(summary), *(p.name for p in files)]) + "\n"
    stem = DATA / "rendered" / name.removesuffix(".json")
    assert html == stem.with_suffix(".html").read_text()
    assert text == stem.with_suffix(".txt").read_text()


def test_a_training_summary_with_fp8_layers_reads(tmp_path):
    """fp8 is a training dtype (torchao's float8 layers): a training study that chose it
    is reported like any other."""
    path = _copy(tmp_path, WRITTEN_BEFORE_THE_VERSION[0])
    data = json.loads(path.read_text())
    key = next(k for k in data["trials"][0]["params"] if k.startswith("dtype."))
    data["trials"][0]["params"][key] = "fp8"
    path.write_text(json.dumps(data))
    assert read_summary(path, "old").trials[0].params[key] == "fp8"


@pytest.mark.parametrize("mode", [["training"], {"name": "serving"}, None, "counting"])
def test_a_mode_that_is_no_modes_name_is_refused_in_one_line(tmp_path, mode):
    path = _copy(tmp_path, WRITTEN_BEFORE_THE_VERSION[0])
    path.write_text(json.dumps({**json.loads(path.read_text()), "mode": mode}))
    with pytest.raises(AutoprecError, match=r"mode: expected training or serving, got "):
        read_summary(path, "old")
