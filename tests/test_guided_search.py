"""`autoprec profile` and the guided search, end to end on real stores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import autoprec
from autoprec.tasks import load_task
from autoprec.tracking import mlflow_client

ROOT = Path(__file__).resolve().parent.parent

CLI = "import sys; from autoprec.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.slow
def test_profile_command_ranks_writes_and_logs(in_tmp):
    done = subprocess.run(
        [sys.executable, "-c", CLI, "profile", "--task", "digits-overflow", "--top", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout.splitlines()
    assert table[0].startswith("profile of digits-overflow on cpu")
    assert table[2].split()[:2] == ["1", "features"]  # the layer that overflows, first
    data = json.loads((in_tmp / "runs/digits-overflow/profile.json").read_text())
    assert data["modules"][0]["name"] == "features" and data["modules"][0]["risk"] == "inf"
    client = mlflow_client(f"sqlite:///{in_tmp}/runs/mlflow.db")
    experiment = client.get_experiment_by_name("digits-overflow")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["autoprec.role"] == "profile"
    assert run.data.tags["risk.1"].startswith("features: fp16: output non-finite")
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["profile.json"]


def test_profile_command_refuses_bad_input(in_tmp):
    done = subprocess.run(
        [sys.executable, "-c", CLI, "profile", "--task", "no_such_file.py:task"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (in_tmp / "runs").exists()


@pytest.mark.slow
def test_guided_search_keeps_the_overflowing_layer_and_lowers_the_rest(in_tmp):
    # The task's shipped space with the optimizer's states held in fp32: --prefer memory
    # would search them too, and this test follows the layers.
    shipped = (ROOT / "search_spaces" / "digits-overflow.yaml").read_text()
    space = in_tmp / "layers.yaml"
    space.write_text(
        shipped
        + "optimizer_states:\n  groups:\n    - {name: all, patterns: ['*'], states: [fp32]}\n"
    )
    result = autoprec.search(
        "digits-overflow", space, trials=6, steps=40, device="cpu", prefer="memory", confirm_top=0
    )
    summary = result.summary
    assert summary["profile"][0]["module"] == "features"
    trials = {t["number"]: t for t in summary["trials"]}
    guided = [t for t in trials.values() if t["guided"]]
    assert guided and guided[0]["guided"] == "bisect"
    # The first bisection step keeps the riskiest group (features) in fp32, the rest fp16.
    # On the CPU the LayerNorm behind it runs in the dtype it is given: in fp16 it gets
    # the features' values past 65504 and overflows. The second step keeps it too, and
    # trains as well as fp32: the two layers that must stay are found in two trials.
    first, second = guided[0]["params"], guided[1]["params"]
    assert first["dtype.features"] == "fp32"
    assert first["dtype.hidden"] == first["dtype.head"] == first["dtype.norms"] == "fp16"
    assert not guided[0]["feasible"] and "norm_in" in guided[0]["reason"]
    assert second["dtype.features"] == second["dtype.norms"] == "fp32"
    assert second["dtype.hidden"] == second["dtype.head"] == "fp16"
    assert guided[1]["guided"] == "bisect" and guided[1]["feasible"]
    # The uniform fp16 anchors overflow in `features`; the profile said so before.
    assert all(
        "overflow" in t["reason"] for t in trials.values() if t["anchor"] and "fp16" in t["anchor"]
    )
    assert summary["best"]["feasible"] and summary["best"]["metrics"]["low_precision_share"] > 0.9
    # The profile is kept on the search's parent run (children are trials only).
    client = mlflow_client(f"sqlite:///{in_tmp}/runs/mlflow.db")
    parent = client.get_run(summary["mlflow_parent_run_id"])
    assert parent.data.tags["risk.1"].startswith("features: ")
    assert "profile.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}


@pytest.mark.slow
def test_a_resnet_with_150_modules_gets_a_feasible_guided_policy(in_tmp):
    task = load_task("digits-resnet")
    assert len(list(task.model().named_modules())) >= 100
    # 20 steps leave the ResNet at about 66% accuracy, where a low-precision policy's drop
    # against fp32 is 1-2 points of noise that moves with the CPU's bf16 kernels (AMX or
    # not) and its thread count: the tolerance is set above that noise, so that what is
    # tested is the guided groups, not the machine.
    result = autoprec.search(
        task,
        trials=8,
        steps=20,
        device="cpu",
        prefer="memory",
        confirm_top=0,
        accuracy_tolerance=0.03,
    )
    summary = result.summary
    assert len(summary["trials"]) == 8
    groups = [k for k in summary["trials"][0]["params"] if k.startswith("dtype.")]
    assert 3 < len(groups) <= 12  # automatic groups keep the space small
    assert summary["best"]["feasible"] and summary["best"]["number"] != "baseline"
    assert summary["best"]["metrics"]["low_precision_share"] > 0.5
