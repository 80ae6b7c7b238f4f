"""The report, the MLflow UI's data as a server hands it out, and the page in a browser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request

import pytest
from PIL import Image

from autoprec.cli import main
from tests.servers import mlflow_server

PNGS = ("front_step_time.png", "front_memory.png", "dtype_map.png")


@pytest.fixture(scope="module")
def report(finished):
    folder, _ = finished
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        assert main(["report", "--study", "tiny"]) == 0
    finally:
        os.chdir(cwd)
    summary = json.loads((folder / "runs/tiny/summary.json").read_text())
    return folder, summary


def test_report_names_every_trial_and_the_chosen_policy(report):
    folder, summary = report
    page = (folder / "runs/tiny/report.html").read_text()
    assert "fp32 baseline" in page
    for trial in summary["trials"]:
        assert f"trial {trial['number']}" in page
    best = summary["best"]
    for layer in best["layers"]:  # the chosen policy, layer by layer
        assert f"<td>{layer['name']}</td>" in page
    assert 'class="best"' in page
    assert 'src="data:image/png;base64,' in page  # self-contained
    assert 'src="front' not in page


def test_plots_are_valid_images_of_sensible_size(report):
    folder, _ = report
    for name in PNGS:
        with Image.open(folder / "runs/tiny" / name) as image:
            image.verify()
        with Image.open(folder / "runs/tiny" / name) as image:
            width, height = image.size
            assert image.format == "PNG"
            assert 300 <= width <= 3000 and 200 <= height <= 3000


def test_parent_run_lists_the_report_files(report):
    from mlflow.tracking import MlflowClient

    folder, summary = report
    client = MlflowClient(f"sqlite:///{folder}/runs/mlflow.db")
    listed = {a.path for a in client.list_artifacts(summary["mlflow_parent_run_id"], "report")}
    # the headroom chart is drawn where the trials forecast their ranges (long enough)
    charts = (*PNGS, "headroom.png") if (folder / "runs/tiny/headroom.png").exists() else PNGS
    assert listed == {f"report/{name}" for name in ("report.html", *charts)}


def test_compare_two_studies(report, tmp_path):
    folder, summary = report
    other = tmp_path / "runs" / "other"
    other.mkdir(parents=True)
    (other / "summary.json").write_text(json.dumps({**summary, "study": "other"}))
    shutil.copytree(folder / "runs/tiny", tmp_path / "runs/tiny")
    out = tmp_path / "cmp.html"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["compare", "--study", "tiny", "--study", "other", "--out", str(out)]) == 0
    finally:
        os.chdir(cwd)
    page = out.read_text()
    assert "tiny" in page and "other" in page and "base64," in page


def _get(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _post(base: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{base}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_a_real_mlflow_server_serves_the_search(finished):
    folder, _ = finished
    with mlflow_server(f"sqlite:///{folder}/runs/mlflow.db") as base:
        experiment = _get(base, "/api/2.0/mlflow/experiments/get-by-name", experiment_name="tiny")[
            "experiment"
        ]
        runs = _post(
            base,
            "/api/2.0/mlflow/runs/search",
            {"experiment_ids": [experiment["experiment_id"]], "max_results": 1000},
        )["runs"]

    def tags(run):
        return {t["key"]: t["value"] for t in run["data"].get("tags", [])}

    parents = [r for r in runs if tags(r).get("autoprec.role") == "parent"]
    children = [r for r in runs if "mlflow.parentRunId" in tags(r)]
    assert len(parents) == 1
    parent_id = parents[0]["info"]["run_id"]
    assert children and all(tags(c)["mlflow.parentRunId"] == parent_id for c in children)
    best_id = tags(parents[0])["autoprec.best_run_id"]
    assert best_id in {c["info"]["run_id"] for c in children}
    assert [tags(c)["best"] for c in children].count("true") == 1
    for child in children:
        if tags(child)["state"] == "complete":
            metrics = {m["key"] for m in child["data"]["metrics"]}
            assert {
                "accuracy",
                "accuracy_drop",
                "step_time_ms",
                "peak_memory_mb",
                "grad_underflow_ratio",
            } <= metrics


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_report_opens_in_headless_chromium(report, tmp_path):
    folder, summary = report
    page = (folder / "runs/tiny/report.html").resolve().as_uri()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
    ]
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", page], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "autoprec report: tiny" in dom.stdout
    assert f"trial {summary['trials'][0]['number']}" in dom.stdout
    assert "Uncaught" not in dom.stderr
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1200,900", page],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with Image.open(shot) as image:
        assert image.size == (1200, 900)
