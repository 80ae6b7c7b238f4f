"""What a serving search prints and writes, read as a user reads it: the real path of the
fp32 checkpoint it keeps, and serving policies without loss scaling (nothing is trained)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

import autoprec
from autoprec import load_served_model
from autoprec.policy import load_policy
from autoprec.serving.conversion import convert, default_int8_method
from autoprec.tasks import load_task
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
        *("search", "--task", "task.py:factory", "--mode", "serving", "--scenario", "edge"),
        *("--trials", "3", "--steps", "20", "--study", STUDY, "--no-progress"),
    )
    return folder, done


def test_the_start_line_names_the_checkpoint_it_keeps(served):
    folder, done = served
    assert "<study>" not in done.stderr
    kept = f"runs/{STUDY}/fp32.pt"
    assert f"training the fp32 model once (kept as {kept}) ..." in done.stderr
    assert (folder / kept).is_file()


@pytest.mark.slow  # a whole search end to end: the everyday subset skips it
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
    assert not policy.writes_loss_scale and not policy.loss_scale.enabled
    assert policy.to_yaml() == best_file.read_text()


def test_a_training_policy_keeps_its_loss_scale(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("default: fp16\nloss_scale: {mode: dynamic}\n")
    policy = load_policy(path)
    assert policy.writes_loss_scale
    assert policy.to_dict()["loss_scale"]["mode"] == "dynamic"
    path.write_text("default: bf16\nloss_scale: {mode: none}\n")
    assert load_policy(path).to_dict()["loss_scale"] == {"mode": "none"}


# Every Linear but the head in int8 or fp32, the head in fp32: one policy besides fp32's.
INT8_SPACE = """\
name: body-int8
dtypes: [fp32, int8]
groups:
  - {name: body, patterns: [fc1, fc2], dtypes: [fp32, int8]}
  - {name: head, patterns: [head], dtypes: [fp32]}
"""


@pytest.fixture(scope="module")
def int8_study(tmp_path_factory):
    """A serving study whose int8 method (torchao's dynamic one) is not the CPU's default
    (torch's dynamic quantization)."""
    pytest.importorskip("torchao", reason="the method that is not the default is torchao's")
    folder = tmp_path_factory.mktemp("int8")
    (folder / "space.yaml").write_text(INT8_SPACE)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(folder)
        result = autoprec.search(
            "digits-mlp",
            str(folder / "space.yaml"),
            mode="serving",
            scenario="edge",
            int8="torchao-dynamic",
            accuracy_tolerance=1.0,
            trials=2,
            steps=20,
            study="int8-method",
            device="cpu",
        )
    return folder / "runs" / "int8-method", result


def test_the_best_policy_alone_serves_what_the_trial_measured(int8_study):
    folder, result = int8_study
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["serving"]["int8"] == "torchao-dynamic" != default_int8_method("cpu")
    best_file = folder / "best_policy.yaml"
    assert yaml.safe_load(best_file.read_text())["quantization"] == {"int8": "torchao-dynamic"}
    policy = load_policy(best_file)
    task = load_task("digits-mlp")
    fp32 = task.model()
    fp32.load_state_dict(torch.load(folder / "fp32.pt", weights_only=True))
    assert set(policy.resolve_served(fp32).values()) == {"int8", "fp32"}
    # The trial's model: the fp32 weights converted with the study's method.
    measured = convert(fp32, policy.resolve_served(fp32), "cpu", summary["serving"]["int8"])
    served = load_served_model(fp32, policy)  # the policy file alone
    default = convert(fp32, policy.resolve_served(fp32), "cpu", default_int8_method("cpu"))
    batch = task.first_val_batch()
    with torch.inference_mode():
        expected, got, other = (batch.run(m) for m in (measured, served, default))
    assert torch.equal(got, expected)
    assert not torch.equal(other, expected)  # the device's default serves another model
    scores = []
    for raw in task.val_data():
        val = task.batch(raw)
        with torch.inference_mode():
            scores.append((task.score(val.run(served), val.targets), val.size))
    accuracy = sum(s * n for s, n in scores) / sum(n for _, n in scores)
    assert accuracy == summary["best"]["metrics"]["accuracy"]
    assert result.best_policy == policy


def test_the_mlflow_model_records_the_method_of_the_policy(int8_study):
    folder, _ = int8_study
    summary = json.loads((folder / "summary.json").read_text())
    logged = summary["serving"]["mlflow_model"]
    assert logged["logged"], logged
    metadata = yaml.safe_load((folder / "mlflow_model" / "MLmodel").read_text())["metadata"]
    assert metadata["int8"] == "torchao-dynamic"
    assert metadata["autoprec_policy"]["quantization"] == {"int8": "torchao-dynamic"}
    requirements = (folder / "mlflow_model" / "requirements.txt").read_text()
    assert "torchao==" in requirements
