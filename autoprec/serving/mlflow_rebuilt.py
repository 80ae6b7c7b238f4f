"""The served model as an MLflow pyfunc that is rebuilt at load time, not unpickled.

torch's own dynamic int8 (the CPU's default) packs its weights in objects ``torch.export``
cannot trace, so such a model has no ``pt2``; pickling it would let whoever can write the
artifact store plant code that runs on load. Instead the model folder holds data only:
``fp32.pt`` (the fp32 state dict, read with ``weights_only=True``), ``policy.yaml`` (read with
``yaml.safe_load``) and ``served.json`` (the task, the int8 method, how inputs are passed).
MLflow's pyfunc calls `_load_pyfunc` of this installed module, which builds the task's
model, loads the weights and converts them as the trial did.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoprec._util.files import atomic_file, write_atomic
from autoprec.policy import Policy
from autoprec.serving.logits_path import ServedModel

FORMAT = "autoprec-rebuilt"
WEIGHTS_FILE = "fp32.pt"
POLICY_FILE = "policy.yaml"
SETTINGS_FILE = "served.json"


def write_data(
    folder: Path,
    fp32_state: dict[str, torch.Tensor],
    policy: Policy,
    task_spec: str,
    int8: str | None,
    names: list[str],
    stacked: bool,
) -> Path:
    """The model's data folder: what `_load_pyfunc` rebuilds the served model from."""
    with atomic_file(folder / WEIGHTS_FILE) as out:  # no link followed (autoprec._util.files)
        torch.save(fp32_state, out)
    policy.save(folder / POLICY_FILE)
    settings = {"task": task_spec, "int8": int8, "inputs": names, "stacked": stacked}
    write_atomic(folder / SETTINGS_FILE, json.dumps(settings, indent=2) + "\n")
    return folder


class RebuiltModel:
    """What pyfunc predicts with: one array in (inputs stacked on dimension 1 where the
    settings say so), the served model's logits out, as a numpy array."""

    def __init__(self, served: torch.nn.Module) -> None:
        self.served = served

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> np.ndarray:
        inputs = torch.as_tensor(np.asarray(model_input))
        with torch.inference_mode():
            return self.served(inputs).float().numpy()


def _load_pyfunc(data_path: str) -> RebuiltModel:
    """MLflow's entry point: the served model rebuilt from the data folder, nothing
    unpickled."""
    from autoprec.policy import load_policy
    from autoprec.serving.load import load_served_model
    from autoprec.tasks import load_task

    folder = Path(data_path)
    settings = json.loads((folder / SETTINGS_FILE).read_text())
    model = load_task(settings["task"]).model()
    model.load_state_dict(torch.load(folder / WEIGHTS_FILE, map_location="cpu", weights_only=True))
    policy = load_policy(folder / POLICY_FILE)
    converted = load_served_model(model, policy, "cpu", settings["int8"])
    return RebuiltModel(ServedModel(converted, settings["inputs"], settings["stacked"]).eval())
