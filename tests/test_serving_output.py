"""What a serving search prints and writes, read as a user reads it: the real path of the
fp32 checkpoint it keeps, and serving policies without loss scaling (nothing is trained)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from autoprec.policy import load_policy
from tests.test_cli import TASK_FILE

STUDY = "served-out"


def _cli(folder, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "autoprec.cli", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    (folder / "task.py").write_text(TASK_FILE)
    done = _cli(
        folder,
        *("search", "--task", "task.py:factory", "--mode", "inference", "--scenario", "edge"),
        *("--trials", "3", "--steps", "20", "--study", STUDY, "--no-progress"),
    )
    return folder, done


def test_the_start_line_names_the_checkpoint_it_keeps(served):
    folder, done = served
    assert "<study>" not in done.stderr
    kept = f"runs/{STUDY}/fp32.pt"
    assert f"training the fp32 model once (kept as {kept}) ..." in done.stderr
    assert (folder / kept).is_file()


def test_serving_policies_are_written_and_shown_without_loss_scale(served):
    folder, _ = served
    best_file = folder / "runs" / STUDY / "best_policy.yaml"
    assert "loss_scale" not in yaml.safe_load(best_file.read_text())
    assert "rules" in yaml.safe_load(best_file.read_text())
    summary = json.loads((folder / "runs" / STUDY / "summary.json").read_text())
    for row in [summary["baseline"], *summary["trials"], summary["best"]]:
        assert "loss_scale" not in row["policy"]
    printed = _cli(folder, "best", "--study", STUDY).stdout
    assert "loss_scale" not in printed and yaml.safe_load(printed)["rules"]
    printed_json = json.loads(_cli(folder, "best", "--study", STUDY, "--json").stdout)
    assert "loss_scale" not in printed_json
    resolved = _cli(folder, "resolve", "--policy", str(best_file), "--task", "task.py:factory")
    assert "served;" in resolved.stdout and "loss scale" not in resolved.stdout
    client = mlflow.MlflowClient(f"sqlite:///{folder / 'runs/mlflow.db'}")
    experiment = client.get_experiment_by_name(STUDY)
    child = client.search_runs(
        [experiment.experiment_id], filter_string="tags.`autoprec.role` = 'trial'"
    )[0]
    artifact = client.download_artifacts(child.info.run_id, "policy.yaml", str(folder))
    assert "loss_scale" not in yaml.safe_load(Path(artifact).read_text())
    # Read back, the policy is the same serving policy, and is written the same way again.
    policy = load_policy(best_file)
    assert policy.serving and not policy.loss_scale.enabled
    assert policy.to_yaml() == best_file.read_text()


def test_a_training_policy_keeps_its_loss_scale(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("default: fp16\nloss_scale: {mode: dynamic}\n")
    policy = load_policy(path)
    assert not policy.serving
    assert policy.to_dict()["loss_scale"]["mode"] == "dynamic"
    path.write_text("default: bf16\nloss_scale: {mode: none}\n")
    assert load_policy(path).to_dict()["loss_scale"] == {"mode": "none"}
