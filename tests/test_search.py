"""A small real search against real sqlite stores, read back as a user would."""

from __future__ import annotations

import json

import optuna
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

import autoprec
from autoprec.tracking import BEST_TAG
from tests.conftest import make_tiny_task

DOCUMENTED_METRICS = {
    "accuracy",
    "accuracy_drop",
    "step_time_ms",
    "peak_memory_mb",
    "overflow_steps",
    "nonfinite_steps",
    "grad_underflow_ratio",
    "final_loss",
}


def test_outputs_exist_and_agree(finished):
    folder, result = finished
    assert (folder / "runs/tiny/best_policy.yaml").is_file()
    summary = json.loads((folder / "runs/tiny/summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert summary["baseline"]["metrics"]["accuracy_drop"] == 0.0
    assert len(summary["trials"]) == 5
    assert summary["pareto_front"] and "baseline" in [
        t["number"] for t in [summary["baseline"], *summary["trials"]]
    ]
    anchors = {t["anchor"] for t in summary["trials"]}
    assert {"uniform-fp16", "uniform-bf16"} <= anchors
    for trial in summary["trials"]:
        assert trial["state"] in ("complete", "pruned", "failed")
        assert "policy" in trial and "params" in trial
        if trial["state"] == "complete":
            assert set(trial["metrics"]) >= DOCUMENTED_METRICS
            assert trial["feasible"] == (
                trial["metrics"]["accuracy_drop"] <= summary["accuracy_tolerance"] + 1e-12
            )
    best = summary["best"]
    assert best["feasible"]
    # The fastest feasible policies were re-timed side by side with the baseline, and
    # the speedup compares those re-timings.
    confirmed = summary["step_times_confirmed"]
    assert "baseline" in confirmed and 2 <= len(confirmed) <= 4
    entries = {str(t["number"]): t for t in [summary["baseline"], *summary["trials"]]}
    assert all("confirmed_step_time_ms" in entries[k]["metrics"] for k in confirmed)
    if str(best["number"]) in confirmed:
        assert best["speedup_vs_fp32"] == (
            summary["baseline"]["metrics"]["confirmed_step_time_ms"]
            / best["metrics"]["confirmed_step_time_ms"]
        )
    assert autoprec.load_policy(folder / "runs/tiny/best_policy.yaml").to_dict() == best["policy"]


def test_optuna_study_holds_the_trials(finished):
    folder, _ = finished
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{folder}/runs/optuna.db")
    done = [t for t in study.trials if "duplicate_of" not in t.user_attrs and t.state.is_finished()]
    assert len(done) == 5
    assert study.user_attrs["baseline"]["result"]["state"] == "complete"
    complete = [t for t in done if t.state == optuna.trial.TrialState.COMPLETE]
    assert complete and all(len(t.values) == 3 for t in complete)
    for t in complete:  # feasible exactly when the constraint is at most zero
        record = t.user_attrs["autoprec"]
        assert (t.constraints["accuracy_drop"] <= 1e-12) == record["feasible"]


def test_mlflow_holds_one_parent_and_a_child_per_trial(finished):
    folder, _ = finished
    client = MlflowClient(f"sqlite:///{folder}/runs/mlflow.db")
    experiment = client.get_experiment_by_name("tiny")
    assert experiment.artifact_location.startswith((folder / "runs").resolve().as_uri())
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("autoprec.role") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 6  # 5 trials and the baseline
    parent = parents[0]
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children)
    assert parent.data.tags[BEST_TAG] in {c.info.run_id for c in children}
    assert parent.data.params["task"] == "tiny"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"best_policy.yaml", "summary.json"} <= artifacts
    param_keys = {frozenset(c.data.params) for c in children}
    assert len(param_keys) == 1  # the same param names on every child
    metric_keys = {frozenset(c.data.metrics) for c in children}
    assert len(metric_keys) == 1 and next(iter(metric_keys)) >= DOCUMENTED_METRICS
    assert [c.data.tags["best"] for c in children].count("true") == 1
    assert {c.data.tags["pareto"] for c in children} <= {"true", "false"}
    for child in children:
        assert child.data.tags["state"] in ("complete", "pruned", "failed")
        artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"policy.yaml", "telemetry_layers.csv"} <= artifacts
        history = client.get_metric_history(child.info.run_id, "loss_scale")
        assert len(history) == int(child.data.metrics["steps_run"])  # the trajectory
        if child.data.tags["state"] == "complete":
            assert set(child.data.metrics) >= DOCUMENTED_METRICS


def test_load_best_policy_matches_the_file_and_trains(finished):
    folder, _ = finished
    policy = autoprec.load_best_policy("tiny", tracking_uri=f"sqlite:///{folder}/runs/mlflow.db")
    assert policy == autoprec.load_policy(folder / "runs/tiny/best_policy.yaml")

    # Apply it in a plain training loop, as the README shows.
    task = make_tiny_task()
    torch.manual_seed(0)
    model = task.model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    prec = policy.apply(model, device="cpu")
    losses = []
    for _, (x, y) in zip(range(30), task.train_data(0), strict=False):
        optimizer.zero_grad()
        with prec.autocast():
            out = model(x)
        loss = task.loss(out.float(), y)
        prec.backward(loss)
        prec.step(optimizer)
        losses.append(loss.item())
    assert sum(losses[-5:]) < sum(losses[:5])
    assert set(prec.state_dict()) == {"loss_scaler"}


def test_continuing_a_study_runs_only_what_is_missing(finished, monkeypatch):
    folder, first = finished
    monkeypatch.chdir(folder)
    again = autoprec.search(make_tiny_task(), trials=5, steps=12, study="tiny", device="cpu")
    assert [t["number"] for t in again.summary["trials"]] == [
        t["number"] for t in first.summary["trials"]
    ]
    more = autoprec.search(make_tiny_task(), trials=6, steps=12, study="tiny", device="cpu")
    assert len(more.summary["trials"]) == 6
    client = MlflowClient(f"sqlite:///{folder}/runs/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert sum(r.data.tags.get("autoprec.role") == "parent" for r in runs) == 1
    assert sum("mlflow.parentRunId" in r.data.tags for r in runs) == 7


def test_continuing_with_other_settings_is_refused(finished, monkeypatch):
    folder, _ = finished
    monkeypatch.chdir(folder)
    with pytest.raises(autoprec.AutoprecError, match="steps=12"):
        autoprec.search(make_tiny_task(), trials=6, steps=20, study="tiny", device="cpu")


def test_best_policy_file_is_plain_yaml(finished):
    folder, _ = finished
    data = yaml.safe_load((folder / "runs/tiny/best_policy.yaml").read_text())
    assert set(data) >= {"default", "rules", "loss_scale"}


def test_ctrl_c_keeps_what_was_measured_and_the_study_continues(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = make_tiny_task()
    build = task.model
    trials_built = []

    class Armed(autoprec.Callbacks):  # counts models built once the trials begin
        def trials_start(self, progress):
            trials_built.append(0)

    def model_then_ctrl_c():
        if trials_built:  # two trials build their models; Ctrl-C in the third
            trials_built[0] += 1
            if trials_built[0] == 3:
                raise KeyboardInterrupt
        return build()

    task.model = model_then_ctrl_c
    with pytest.raises(autoprec.SearchInterrupted) as caught:
        autoprec.search(task, trials=4, steps=12, study="cc", device="cpu", callbacks=Armed())
    summary = json.loads((tmp_path / "runs/cc/summary.json").read_text())
    assert summary["interrupted"] is True
    # The two measured, and the one cut off: listed as failed, not counted.
    assert [t["counted"] for t in summary["trials"]] == [True, True, False]
    assert caught.value.result.summary_path.resolve() == tmp_path / "runs/cc/summary.json"
    assert (tmp_path / "runs/cc/best_policy.yaml").is_file()
    study = optuna.load_study(study_name="cc", storage=f"sqlite:///{tmp_path}/runs/optuna.db")
    cut = [t for t in study.trials if t.user_attrs.get("interrupted")]
    assert len(cut) == 1 and cut[0].state == optuna.trial.TrialState.FAIL
    listed = summary["trials"][-1]
    assert listed["number"] == cut[0].number and listed["state"] == "failed"
    assert "interrupted" in listed["reason"]
    anchor = cut[0].user_attrs["anchor"]

    task.model = build  # continue: only what is missing runs, the cut anchor included
    again = autoprec.search(task, trials=4, steps=12, study="cc", device="cpu")
    assert sum(t["counted"] for t in again.summary["trials"]) == 4
    assert len(again.summary["trials"]) == 5 and again.summary["interrupted"] is False
    assert anchor in {t["anchor"] for t in again.summary["trials"]}
