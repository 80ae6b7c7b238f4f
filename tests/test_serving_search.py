"""The serving search, end to end on the command line: `autoprec search --mode serving`
trains (or loads) the fp32 model once, converts it per policy, measures it, and hands back
the chosen policy, an MLflow model of it, and with `autoprec export` a model to serve.

The tasks are the small built-in ones; what is checked is what a user relies on: the
scenarios finish, the critical one never disagrees with fp32, the exported model reproduces
the trial's accuracy, the fp32 checkpoint is never overwritten, and bad input is one line
and exit status 2 with the stores untouched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import mlflow
import optuna
import pytest
import torch
from torch import nn

from autoprec import Policy, SearchConfig, load_policy, load_served_model, search
from autoprec.cli import main
from autoprec.errors import AutoprecError
from autoprec.tasks import load_task
from tests import npu_standin

TASK = "digits-mlp"
STEPS = "60"


def _search(folder, monkeypatch, *args):
    monkeypatch.chdir(folder)
    code = main(["search", "--task", TASK, "--steps", STEPS, "--no-progress", *args])
    assert code == 0
    return folder / "runs"


def _summary(runs, study):
    return json.loads((runs / study / "summary.json").read_text())


def _snapshot(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _accuracy(task, model):
    """The task's metric over its validation data, as a serving trial scores it."""
    scores, sizes = [], []
    with torch.inference_mode():
        for raw in task.val_data():
            batch = task.batch(raw)
            scores.append(task.score(batch.run(model), batch.targets) * batch.size)
            sizes.append(batch.size)
    return sum(scores) / sum(sizes)


def _fingerprint(path):
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """An edge search (batch 1, memory first, int8 included) that ran 6 trials, then was
    continued to 8; and the fp32 checkpoint's digest and time after the first run."""
    folder = tmp_path_factory.mktemp("edge")
    args = ("--mode", "serving", "--scenario", "edge")
    with pytest.MonkeyPatch.context() as monkeypatch:
        runs = _search(folder, monkeypatch, *args, "--trials", "6")
        first = _fingerprint(runs / f"{TASK}-edge" / "fp32.pt")
        _search(folder, monkeypatch, *args, "--trials", "8")
    return folder, runs, _summary(runs, f"{TASK}-edge"), first


def test_the_edge_search_finishes_and_chooses_a_feasible_policy(edge):
    _, runs, summary, _ = edge
    assert summary["mode"] == "serving"
    assert summary["serving"]["scenario"] == "edge"
    assert summary["serving"]["batch_sizes"] == [1]
    assert summary["prefer"] == "memory"
    assert len(summary["trials"]) == 8
    best = summary["best"]
    assert best["feasible"] and best["metrics"]["batch_size"] == 1
    assert best["metrics"]["peak_memory_mb"] <= summary["baseline"]["metrics"]["peak_memory_mb"]
    dtypes = {row["dtype"] for row in best["layers"]}
    assert dtypes & {"fp16", "bf16", "int8"}, "memory first: the edge choice is below fp32"
    assert (runs / f"{TASK}-edge" / "fp32.pt").is_file()
    # optuna-dashboard names the Pareto plot's axes after the study's objectives.
    study = optuna.load_study(study_name=f"{TASK}-edge", storage=f"sqlite:///{runs}/optuna.db")
    assert study.metric_names == ["accuracy", "peak_memory_mb", "latency_p50_ms"]


def test_the_exported_model_reproduces_the_trials_accuracy(edge, monkeypatch, capsys):
    folder, runs, summary, _ = edge
    monkeypatch.chdir(folder)
    assert main(["export", "--study", f"{TASK}-edge", "--out", "served"]) == 0
    written = {line.split("/")[-1] for line in capsys.readouterr().out.split()}
    assert {"fp32.pt", "served.pt", "policy.yaml", "load_model.py"} <= written
    task = load_task(TASK)
    spec = importlib.util.spec_from_file_location("load_model", folder / "served/load_model.py")
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    expected = summary["best"]["metrics"]["accuracy"]
    assert _accuracy(task, loader.rebuilt()) == pytest.approx(expected, abs=1e-9)
    if "program.pt2" in written:
        assert _accuracy(task, loader.exported()) == pytest.approx(expected, abs=1e-9)
    # load_served_model, on the kept fp32 weights, computes what the trial computed.
    model = task.model()
    model.load_state_dict(torch.load(runs / f"{TASK}-edge" / "fp32.pt"))
    policy = load_policy(runs / f"{TASK}-edge" / "best_policy.yaml")
    served = load_served_model(model, policy, int8=summary["serving"]["int8"])
    assert _accuracy(task, served) == pytest.approx(expected, abs=1e-9)


def test_the_chosen_model_is_an_mlflow_model(edge):
    folder, _, summary, _ = edge
    logged = summary["serving"]["mlflow_model"]
    assert logged["logged"], logged
    mlflow.set_tracking_uri(f"sqlite:///{folder}/runs/mlflow.db")  # MLflow caches by URI
    # Loading it unpickles nothing (pt2, or dynamic int8 rebuilt), and the parent says so.
    assert logged["format"] in ("pt2", "autoprec-rebuilt") and logged["unpickles"] is False
    tags = mlflow.MlflowClient().get_run(summary["mlflow_parent_run_id"]).data.tags
    assert tags["autoprec.model_format"] == logged["format"]
    assert tags["autoprec.model_unpickles"] == "false"
    model = mlflow.pyfunc.load_model(logged["uri"])
    assert model.metadata.metadata["autoprec_policy"] == summary["best"]["policy"]
    task = load_task(TASK)
    batch = task.batch(next(iter(task.val_data())))
    predicted = model.predict(batch.args[0][:5].numpy())
    fp32 = task.model()
    fp32.load_state_dict(torch.load(folder / "runs" / f"{TASK}-edge" / "fp32.pt"))
    policy = load_policy(folder / "runs" / f"{TASK}-edge" / "best_policy.yaml")
    served = load_served_model(fp32, policy, "cpu", summary["serving"]["int8"])
    with torch.inference_mode():
        expected = served(batch.args[0][:5]).numpy()
    assert predicted.shape == expected.shape == (5, 10)
    assert (predicted == expected).all()


def test_the_fp32_checkpoint_is_never_overwritten(edge):
    # The second run of the study served the weights the first one trained and kept.
    _, runs, _, first = edge
    assert _fingerprint(runs / f"{TASK}-edge" / "fp32.pt") == first


def test_a_given_checkpoint_is_served_and_not_copied(tmp_path, monkeypatch, edge):
    _, runs, _, _ = edge
    mine = tmp_path / "mine.pt"
    mine.write_bytes((runs / f"{TASK}-edge" / "fp32.pt").read_bytes())
    digest = hashlib.sha256(mine.read_bytes()).hexdigest()
    out = _search(
        tmp_path,
        monkeypatch,
        *("--mode", "serving", "--scenario", "edge", "--trials", "3"),
        *("--checkpoint", str(mine), "--study", "mine"),
    )
    assert not (out / "mine" / "fp32.pt").exists()
    assert hashlib.sha256(mine.read_bytes()).hexdigest() == digest
    summary = _summary(out, "mine")
    assert summary["settings"]["checkpoint"] == str(mine.resolve())
    assert digest.startswith(summary["settings"]["checkpoint_sha256"])
    # The same weights: the baseline scores what the first study's baseline scored.
    first = _summary(runs, f"{TASK}-edge")["baseline"]["metrics"]["accuracy"]
    assert summary["baseline"]["metrics"]["accuracy"] == pytest.approx(first, abs=1e-9)


@pytest.mark.slow
def test_the_server_search_measures_each_batch_size(tmp_path, monkeypatch):
    runs = _search(
        tmp_path,
        monkeypatch,
        *("--mode", "serving", "--scenario", "server", "--trials", "6"),
        *("--batch-sizes", "1,64"),
    )
    summary = _summary(runs, f"{TASK}-server")
    assert summary["serving"]["batch_sizes"] == [8, 1, 64]
    rows = {row["batch_size"]: row for row in summary["serving"]["by_batch_size"]}
    assert set(rows) == {8, 1, 64}
    for row in rows.values():
        assert row["latency_ms"] > 0 and row["fp32_latency_ms"] > 0
        assert row["speedup_vs_fp32"] == pytest.approx(row["fp32_latency_ms"] / row["latency_ms"])
    # Each child run carries the latency at every batch size under its documented name.
    mlflow.set_tracking_uri(f"sqlite:///{runs}/mlflow.db")
    children = mlflow.search_runs(
        experiment_names=[f"{TASK}-server"], filter_string="tags.`autoprec.role` = 'trial'"
    )
    assert len(children) == 6
    for size in (8, 1, 64):
        assert children[f"metrics.latency_p50_ms.batch_{size}"].notna().any()
    for name in ("top1_agreement", "max_rel_deviation", "throughput_sps", "weight_mb"):
        assert children[f"metrics.{name}"].notna().any()


@pytest.mark.slow
def test_the_critical_search_never_disagrees_with_fp32(tmp_path, monkeypatch):
    runs = _search(
        tmp_path, monkeypatch, "--mode", "serving", "--scenario", "critical", "--trials", "8"
    )
    summary = _summary(runs, f"{TASK}-critical")
    assert summary["serving"]["min_top1_agreement"] == 1.0
    feasible = [e for e in [summary["baseline"], *summary["trials"]] if e["feasible"]]
    assert summary["best"]["feasible"]
    for entry in [*feasible, summary["best"]]:
        assert entry["metrics"]["top1_agreement"] == 1.0
        assert entry["metrics"]["max_rel_deviation"] <= 0.01
    disagreeing = [e for e in summary["trials"] if e["metrics"].get("top1_agreement", 1.0) < 1.0]
    assert all(not e["feasible"] for e in disagreeing)


# -- bad input ----------------------------------------------------------------------------


def _bad(folder, monkeypatch, capsys, *args):
    monkeypatch.chdir(folder)
    before = _snapshot(folder)
    assert main(["search", "--task", TASK, "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert _snapshot(folder) == before
    return err


def test_a_checkpoint_that_does_not_fit_is_one_line(edge, monkeypatch, capsys):
    folder, _, _, _ = edge
    torch.save(nn.Linear(3, 3).state_dict(), folder / "wrong.pt")
    err = _bad(folder, monkeypatch, capsys, "--mode", "serving", "--checkpoint", "wrong.pt")
    assert "checkpoint wrong.pt" in err


def test_a_checkpoint_that_is_not_one_is_one_line(edge, monkeypatch, capsys):
    folder, _, _, _ = edge
    (folder / "notes.pt").write_text("not a checkpoint")
    err = _bad(folder, monkeypatch, capsys, "--mode", "serving", "--checkpoint", "notes.pt")
    assert "checkpoint notes.pt: not a torch checkpoint" in err
    err = _bad(folder, monkeypatch, capsys, "--mode", "serving", "--checkpoint", "gone.pt")
    assert "checkpoint gone.pt: no such file" in err


def test_an_unknown_scenario_is_one_line(edge, monkeypatch, capsys):
    folder, _, _, _ = edge
    monkeypatch.chdir(folder)
    before = _snapshot(folder)
    with pytest.raises(SystemExit) as stopped:
        main(["search", "--mode", "serving", "--scenario", "medical"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "invalid choice: 'medical'" in err
    with pytest.raises(AutoprecError, match="scenario 'medical'"):
        search(TASK, config=SearchConfig(mode="serving", scenario="medical"))
    assert _snapshot(folder) == before


def test_batch_sizes_that_are_not_are_one_line(edge, monkeypatch, capsys):
    folder, _, _, _ = edge
    err = _bad(folder, monkeypatch, capsys, "--mode", "serving", "--batch-sizes", "1,x")
    assert "--batch-sizes" in err
    err = _bad(folder, monkeypatch, capsys, "--mode", "serving", "--batch-size", "0")
    assert "--batch-size" in err


def test_int8_on_a_device_without_int8_kernels_is_one_line(edge):
    # The Ascend stand-in (tests/npu_standin) runs the real NPU backend code; neither
    # torch nor torchao has int8 kernels for the NPU.
    folder, _, _, _ = edge
    before = _snapshot(folder)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "autoprec.cli", "search", "--task", TASK),
            *("--device", "npu", "--mode", "serving", "--int8", "dynamic", "--no-progress"),
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        env=npu_standin.subprocess_env(PYTHONWARNINGS="ignore"),
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "int8 dynamic" in lines[0] and "CPU only" in lines[0], lines
    assert _snapshot(folder) == before


def test_export_of_a_training_study_refuses_the_serving_formats(tmp_path, monkeypatch, capsys):
    runs = _search(tmp_path, monkeypatch, "--trials", "2", "--study", "trained")
    capsys.readouterr()
    study = optuna.load_study(study_name="trained", storage=f"sqlite:///{runs}/optuna.db")
    assert study.metric_names == ["accuracy", "peak_memory_mb", "step_time_ms"]
    before = _snapshot(tmp_path)
    assert main(["export", "--study", "trained", "--format", "model"]) == 2
    err = capsys.readouterr().err
    assert "for serving studies" in err and len(err.strip().splitlines()) == 1
    assert _snapshot(tmp_path) == before
    assert main(["export", "--study", "trained"]) == 0  # yaml, the default for training
    assert load_policy(runs / "trained" / "export-yaml" / "policy.yaml") == load_policy(
        runs / "trained" / "best_policy.yaml"
    )


def test_export_without_a_task_name_asks_for_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.makedirs("runs/s")
    (tmp_path / "runs/s/summary.json").write_text(
        json.dumps({"mode": "serving", "settings": {"task_spec": None}})
    )
    Policy.uniform("fp16").save(tmp_path / "runs/s/best_policy.yaml")
    assert main(["export", "--study", "s"]) == 2
    assert "name it with --task" in capsys.readouterr().err


# -- the MLflow model of a transformers model ---------------------------------------------


def test_a_transformers_model_goes_to_mlflow_with_its_inputs_stacked(tmp_path):
    pytest.importorskip("transformers")
    from autoprec.serving.mlflow_model import save_mlflow_model

    task = load_task("tiny-bert")
    model = task.model().eval()
    batch = task.batch(next(iter(task.val_data())))
    policy = Policy.uniform("bf16")
    served = load_served_model(model, policy, "cpu")
    fmt = save_mlflow_model(served, batch, policy, tmp_path / "model", None)
    assert fmt == "pt2"  # loading needs torch alone
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    names = loaded.metadata.metadata["inputs"]
    assert names == ["input_ids", "attention_mask"]
    stacked = torch.stack([batch.kwargs[name][:7] for name in names], 1).numpy()
    with torch.inference_mode():
        expected = served(**{name: batch.kwargs[name][:7] for name in names}).logits.numpy()
    assert (loaded.predict(stacked) == expected).all()
    assert (tmp_path / "model" / "extra_files" / "policy.yaml").is_file()


def test_inputs_one_array_cannot_carry_are_said(tmp_path):
    from autoprec.serving.mlflow_model import save_mlflow_model
    from autoprec.tasks.base import Batch

    batch = Batch((), {"x": torch.zeros(4, 3), "mask": torch.zeros(4, 5)}, None, None)
    with pytest.raises(AutoprecError, match="several inputs of different shapes or dtypes"):
        save_mlflow_model(nn.Linear(3, 3), batch, Policy.uniform("fp32"), tmp_path / "m", None)
    assert not (tmp_path / "m").exists()
