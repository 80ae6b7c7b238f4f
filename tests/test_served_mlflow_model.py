"""The MLflow model of torch's dynamic int8 loads without unpickling.

torch.export cannot take torch's dynamic int8, so that model has no pt2; it is saved as data
(the fp32 weights, the policy, the task's name) and rebuilt at load by autoprec, and loaded
here with real MLflow. Only a task without a name is pickled, and its metadata says so.
"""

from __future__ import annotations

import pickle

import mlflow
import pytest
import torch
import yaml

from autoprec import Policy, load_served_model
from autoprec.serving.mlflow_model import save_mlflow_model
from autoprec.tasks import load_task
from tests.planted import plant

TASK = "digits-mlp"


@pytest.fixture
def dynamic_int8():
    task = load_task(TASK)
    model = task.model().eval()
    batch = task.batch(next(iter(task.val_data())))
    policy = Policy.uniform("int8")
    return model, batch, policy, load_served_model(model, policy, "cpu", "dynamic")


def test_dynamic_int8_is_rebuilt_at_load_not_unpickled(tmp_path, dynamic_int8):
    model, batch, policy, served = dynamic_int8
    path = tmp_path / "model"
    assert save_mlflow_model(served, batch, policy, path, "dynamic", model, TASK) == (
        "autoprec-rebuilt"
    )
    described = yaml.safe_load((path / "MLmodel").read_text())
    assert set(described["flavors"]) == {"python_function"}  # no PyTorch pickle flavour
    assert described["flavors"]["python_function"]["loader_module"] == (
        "autoprec.serving.mlflow_rebuilt"
    )
    assert described["metadata"]["unpickles"] is False
    assert not [p for p in path.rglob("*") if p.suffix in (".pkl", ".pth", ".pickle")]

    loaded = mlflow.pyfunc.load_model(str(path))
    images = batch.args[0][:7]
    with torch.inference_mode():
        expected = served(images).numpy()
    assert (loaded.predict(images.numpy()) == expected).all()

    # The weights are read with weights_only=True: a planted pickle runs nothing.
    marker = tmp_path / "PWNED"
    data = path / described["flavors"]["python_function"]["data"]
    plant(data / "fp32.pt", marker)
    with pytest.raises(pickle.UnpicklingError):
        mlflow.pyfunc.load_model(str(path))
    assert not marker.exists()


def test_a_task_without_a_name_is_pickled_and_says_so(tmp_path, dynamic_int8):
    _, batch, policy, served = dynamic_int8
    path = tmp_path / "model"
    assert save_mlflow_model(served, batch, policy, path, "dynamic") == "pickle"
    loaded = mlflow.pyfunc.load_model(str(path))
    assert loaded.metadata.metadata["unpickles"] is True
    assert loaded.metadata.metadata["serialization"] == "pickle"


@pytest.mark.slow  # a serving search: about 40 s
def test_a_search_given_a_task_object_warns_that_its_model_is_pickled(in_tmp, caplog):
    from autoprec import search
    from tests.contract_tasks import make_tiny_task

    result = search(
        make_tiny_task(),
        trials=3,
        steps=20,
        study="t",
        device="cpu",
        mode="serving",
        scenario="edge",
    )
    best = Policy.from_dict(result.summary["best"]["policy"])
    assert "int8" in best.resolve_served(make_tiny_task().model()).values(), (
        "edge (memory first) chose int8 on the tiny task: torch's dynamic int8, which only "
        "pickle can hold without a task name"
    )
    logged = result.summary["serving"]["mlflow_model"]
    assert logged["format"] == "pickle" and logged["unpickles"] is True
    warned = [r.getMessage() for r in caplog.records if "pickle" in r.getMessage()]
    assert len(warned) == 1 and "no one else can write" in warned[0]
    mlflow.set_tracking_uri(f"sqlite:///{in_tmp}/runs/mlflow.db")
    tags = mlflow.MlflowClient().get_run(result.summary["mlflow_parent_run_id"]).data.tags
    assert tags["autoprec.model_format"] == "pickle"
    assert tags["autoprec.model_unpickles"] == "true"
