"""What a search's trials are: training under a policy (the default), or serving a trained
fp32 model converted under a policy (``mode="inference"``).

Both kinds give the trial loop the same two things: `measure` (one policy, one result)
and `retime` (the fastest candidates timed again side by side). The serving kind also
owns the fp32 model the trials convert: the user's checkpoint (``--checkpoint`` or
``Task.checkpoint``), else ``runs/<study>/fp32.pt``, else the task's model trained once for
``--steps`` and kept there. That file is the user's safety net: it is never overwritten.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.devices import Backend
from autoprec.digest import file_sha256
from autoprec.errors import DeviceError, TaskError, first_line
from autoprec.inference.convert import default_int8_method, int8_unavailable_reason
from autoprec.inference.measure import (
    InferenceResult,
    Reference,
    check_batch_sizes,
    time_side_by_side,
    timing_batch,
)
from autoprec.inference.scenarios import Scenario, scenario
from autoprec.inference.trial import convert_policy, run_inference_trial
from autoprec.policy import Policy
from autoprec.search.config import SearchConfig, parse_batch_sizes
from autoprec.tasks import Task
from autoprec.tasks.base import refuse_nan_outputs
from autoprec.trial import (
    Budget,
    EarlyStopping,
    TrialResult,
    run_trial,
    train_fp32,
)
from autoprec.trial import (
    time_side_by_side as time_training_side_by_side,
)

FP32_CHECKPOINT = "fp32.pt"
MLFLOW_MODEL_DIR = "mlflow_model"  # runs/<study>/, and the parent run's artifact "model"


@dataclass(frozen=True)
class Serving:
    """A serving search's settings: the scenario, the batch sizes measured (the first is
    the scenario's), the int8 method (None: no int8) and the user's fp32 checkpoint."""

    scenario: Scenario
    batch_sizes: tuple[int, ...]
    int8: str | None
    checkpoint: Path | None

    @property
    def settings(self) -> dict[str, Any]:
        """What the study is identified by, besides the training settings."""
        digest = None if self.checkpoint is None else _digest(self.checkpoint)
        return {
            "mode": "inference",
            "scenario": self.scenario.name,
            "batch_sizes": list(self.batch_sizes),
            "int8": self.int8,
            "checkpoint_sha256": digest,
        }


def serving_of(config: SearchConfig, task: Task, model: nn.Module, backend: Backend) -> Serving:
    """The serving settings, checked: the int8 method runs on the device, and the
    checkpoint (if any) fits the model."""
    preset = scenario(config.scenario or "server")
    main = config.batch_size or preset.batch_size
    extra = parse_batch_sizes(config.batch_sizes) if config.batch_sizes is not None else []
    sizes = (main, *(s for s in extra if s != main))
    if config.int8 == "off":
        int8 = None
    elif config.int8 == "auto":
        int8 = default_int8_method(backend.kind)
        if int8 is not None and int8_unavailable_reason(backend.kind, int8) is not None:
            int8 = None
    else:
        reason = int8_unavailable_reason(backend.kind, config.int8)
        if reason is not None:
            raise DeviceError(f"--int8 {config.int8}: {reason} (device {backend.name})")
        int8 = config.int8
    given = config.checkpoint or getattr(task, "checkpoint", None)
    checkpoint = None if given is None else Path(given)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, task)  # checked now, loaded again when used
        batch = task.first_val_batch()
        with torch.no_grad():
            refuse_nan_outputs(task, batch.run(model), f"with the weights of {checkpoint}")
    check_batch_sizes(task, sizes)
    return Serving(preset, sizes, int8, checkpoint)


def load_checkpoint(model: nn.Module, path: Path, task: Task) -> nn.Module:
    """``model`` with the fp32 weights of ``path`` (a state dict, or a mapping holding one
    under ``model`` or ``state_dict``); one line naming what does not fit."""
    where = f"checkpoint {path}"
    try:
        with warnings.catch_warnings():  # torch warns about legacy, non-zip files
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TaskError(f"{where}: no such file") from None
    except pickle.UnpicklingError as error:
        if _is_pickle(path):
            raise TaskError(
                f"{where}: holds Python objects other than tensors, which autoprec never "
                "unpickles (torch.load(weights_only=True)); save a state dict of tensors"
            ) from None
        raise TaskError(f"{where}: not a torch checkpoint ({first_line(error)})") from None
    except Exception as error:  # torch.load on a user's file: many types
        raise TaskError(f"{where}: not a torch checkpoint ({first_line(error)})") from None
    if isinstance(state, dict):
        state = state.get("model", state.get("state_dict", state))
    if not isinstance(state, dict):
        raise TaskError(f"{where}: expected a state dict, got {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TaskError(
                f"{where}: entry {key!r} is a {type(value).__name__}, not a tensor "
                "(expected a state dict of tensors)"
            )
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [
        f"{k} {tuple(state[k].shape)} (the model's: {tuple(v.shape)})"
        for k, v in expected.items()
        if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(v.shape)
    ]
    for problem, names in (
        ("lacks", missing),
        ("has weights the model lacks:", unexpected),
        ("has other shapes:", wrong),
    ):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise TaskError(
                f"{where}: does not fit task {task.name!r}'s model: it {problem} "
                f"{', '.join(names[:3])}{more}"
            )
    model.load_state_dict(state)
    return model


def _is_pickle(path: Path) -> bool:
    """Whether the file is a pickle: torch's zip format, or a bare pickle (protocol 2 or
    later); weights_only refused what it holds, so it holds more than tensors."""
    with path.open("rb") as data:
        start = data.read(4)
    return start == b"PK\x03\x04" or start[:1] == b"\x80"


def _digest(path: Path) -> str:
    return file_sha256(path)[:16]


def fp32_model(
    serving: Serving,
    task: Task,
    backend: Backend,
    budget: Budget,
    out_dir: Path,
    may_train: bool,
    training: Callable[[Path], None] = lambda path: None,
) -> nn.Module:
    """The trained fp32 model the trials convert: the user's checkpoint, else the study's
    ``fp32.pt``, else (where ``may_train``: the process setting the study up) the task's
    model trained once and kept there, never overwritten."""
    torch.manual_seed(budget.seed)
    model = task.model()
    if serving.checkpoint is not None:
        return load_checkpoint(model, serving.checkpoint, task)
    kept = out_dir / FP32_CHECKPOINT
    if kept.is_file():
        return load_checkpoint(model, kept, task)
    if not may_train:
        raise TaskError(f"task {task.name!r}: no fp32 checkpoint at {kept} yet")
    training(kept)
    model, _ = train_fp32(task, backend, budget)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(".pt.partial")
    torch.save(model.state_dict(), partial)
    partial.rename(kept)  # whole or absent: a crash never leaves half a safety net
    return model


class TrainingTrials:
    """Trials that train the task under each policy (`autoprec.trial.run_trial`)."""

    def __init__(
        self, task: Task, backend: Backend, budget: Budget, stopping: EarlyStopping | None
    ) -> None:
        self.task, self.backend, self.budget, self.stopping = task, backend, budget, stopping

    def measure(self, policy: Policy) -> TrialResult:
        return run_trial(self.task, policy, self.backend, self.budget, self.stopping)

    def failed(self, reason: str) -> TrialResult:
        return TrialResult("failed", reason)

    def retime(self, policies: list[Policy]) -> list[float]:
        return time_training_side_by_side(self.task, policies, self.backend, self.budget)


class ServingTrials:
    """Trials that convert the fp32 model under each policy and serve it
    (`autoprec.inference.run_inference_trial`)."""

    def __init__(
        self, task: Task, backend: Backend, model: nn.Module, reference: Reference, serving: Serving
    ) -> None:
        self.task, self.backend, self.model = task, backend, model
        self.reference, self.serving = reference, serving

    def measure(self, policy: Policy) -> InferenceResult:
        return run_inference_trial(
            self.task,
            policy,
            self.model,
            self.backend,
            self.reference,
            self.serving.batch_sizes,
            self.serving.int8,
        )

    def failed(self, reason: str) -> InferenceResult:
        return InferenceResult("failed", reason)

    def retime(self, policies: list[Policy]) -> list[float]:
        """Latency at the scenario's batch size, the policies' models timed in turn."""
        models = [convert_policy(self.model, p, self.backend, self.serving.int8) for p in policies]
        batch = timing_batch(self.task, self.serving.batch_sizes[0], self.backend)
        return time_side_by_side(models, batch, self.backend)


def save_served_model(
    trials: ServingTrials, policy: Policy, out_dir: Path, task_spec: str | None = None
) -> tuple[Path | None, str]:
    """The chosen policy's model, converted for the CPU (where MLflow's pyfunc runs it),
    saved as an MLflow model in ``out_dir/mlflow_model``: the folder and the format used,
    or None and the reason it could not be saved. ``task_spec`` (the task's name or file)
    lets a model that does not export be rebuilt at load rather than pickled."""
    from autoprec.devices import get_backend
    from autoprec.errors import AutoprecError
    from autoprec.inference.mlflow_model import save_mlflow_model

    cpu = get_backend("cpu")
    int8 = trials.serving.int8
    if "int8" in policy.resolve_inference(trials.model).values():
        reason = int8_unavailable_reason("cpu", int8)
        if reason is not None:
            return None, f"{reason}, where the MLflow model runs"
    path = out_dir / MLFLOW_MODEL_DIR
    try:
        converted = convert_policy(trials.model, policy, cpu, int8)  # a copy, on the CPU
        batch = trials.task.first_val_batch()
        spec = None if task_spec is None else _absolute_task_file(task_spec)
        return path, save_mlflow_model(converted, batch, policy, path, int8, trials.model, spec)
    except AutoprecError as error:
        return None, first_line(error)
    except Exception as error:  # the MLflow model is an extra: a failure is one warning
        return None, f"{type(error).__name__}: {first_line(error)}"


def _absolute_task_file(spec: str) -> str:
    """A task spec that names the same task from any folder: ``file.py:attr`` with the
    file's absolute path; a built-in name or ``package.module:attr`` as it is."""
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        return f"{Path(target).resolve()}:{attr}"
    return spec
