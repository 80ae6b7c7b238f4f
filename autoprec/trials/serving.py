"""Serving trials (``--mode serving``): convert a trained fp32 model's weights under a
policy and serve it; `ServingTrials` is the mode as the search sees it.

A trial is pure, as the training trial is: no Optuna, no MLflow. The fp32 model is
converted into a copy (it is never trained, never changed); a policy the model cannot be
converted to, or that breaks it, comes back ``failed`` with the reason.

The mode owns the fp32 model the trials convert: the user's checkpoint (``--checkpoint``
or ``Task.checkpoint``), else ``runs/<study>/fp32.pt``, else the task's model trained once
for ``--steps`` and kept there. That file is the user's safety net: it is never
overwritten. A finished search leaves the chosen model behind as an MLflow model.
"""

from __future__ import annotations

import pickle
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.digest import file_sha256
from autoprec._util.files import atomic_file
from autoprec.devices import DTYPES, Backend
from autoprec.errors import AutoprecError, DeviceError, PolicyError, TaskError, first_line
from autoprec.policy import Policy
from autoprec.precision.plan import low_precision_share
from autoprec.serving.conversion import (
    convert,
    convert_policy,
    default_int8_method,
    int8_unavailable_reason,
)
from autoprec.serving.fp8 import (
    default_fp8_method,
    search_refusal,
)
from autoprec.serving.measure import (
    TIMED_CALLS,
    WARMUP_CALLS,
    Reference,
    ServingResult,
    check_batch_sizes,
    latencies_s,
    latency_ms,
    measure_serving,
    timing_batch,
)
from autoprec.serving.scenarios import AS_SELECTION, Scenario, scenario
from autoprec.settings import SERVING, ServingSettings, check_values, options, parse_batch_sizes
from autoprec.tasks import Task
from autoprec.tasks.base import Batch, refuse_nan_outputs
from autoprec.trials.base import (
    SIDE_BY_SIDE_BLOCK,
    Choice,
    Feasibility,
    Publisher,
    Result,
    TrialState,
    time_side_by_side,
)
from autoprec.trials.training import Budget, train_fp32

if TYPE_CHECKING:
    from autoprec.profile.sensitivity import Profile
    from autoprec.space import SearchSpace

FP32_CHECKPOINT = "fp32.pt"
MLFLOW_MODEL_DIR = "mlflow_model"  # runs/<study>/, and the parent run's artifact "model"


@dataclass(frozen=True, kw_only=True)
class ServingConfig(ServingSettings):
    """A serving search's settings, as given (``SearchConfig.serving``): the scenario, the
    batch sizes, the fp32 checkpoint and the int8 and fp8 methods, each declared (and
    checked when made) in `autoprec.settings.ServingSettings`."""

    def __post_init__(self) -> None:
        check_values(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for a worker's settings, and the settings shown)."""
        values = {o.name: getattr(self, o.name) for o in options(SERVING)}
        sizes, checkpoint = self.batch_sizes, self.checkpoint
        values["batch_sizes"] = None if sizes is None else parse_batch_sizes(sizes)
        values["checkpoint"] = None if checkpoint is None else str(checkpoint)
        return values


@dataclass(frozen=True)
class Serving:
    """A serving search's settings, settled for the task and the device: the scenario,
    the batch sizes measured (the first is the scenario's), the int8 method (None: no
    int8), the user's fp32 checkpoint and the fp8 method (None: no fp8)."""

    scenario: Scenario
    batch_sizes: tuple[int, ...]
    int8: str | None
    checkpoint: Path | None
    fp8: str | None = None

    @property
    def settings(self) -> dict[str, Any]:
        """What the study is identified by, besides the training settings."""
        digest = None if self.checkpoint is None else _digest(self.checkpoint)
        settings = {
            "mode": "serving",
            "scenario": self.scenario.name,
            "batch_sizes": list(self.batch_sizes),
            "int8": self.int8,
            "checkpoint_sha256": digest,
        }
        if self.fp8 is not None:  # only then: studies without fp8 keep their identity
            settings["fp8"] = self.fp8
        return settings


def serving_of(config: ServingConfig, task: Task, model: nn.Module, backend: Backend) -> Serving:
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
    return Serving(preset, sizes, int8, checkpoint, fp8_of(config.fp8, backend))


def fp8_of(asked: str, backend: Backend) -> str | None:
    """The fp8 serving method a search measures with (None: none): ``auto`` takes the
    device's where it is offered (on the CPU only with ``--emulate fp8``), a named method
    must run there (DeviceError in one line otherwise)."""
    if asked == "off":
        return None
    if asked == "auto":
        method = default_fp8_method(backend.kind)
        return None if search_refusal(backend, method) is not None else method
    reason = search_refusal(backend, asked)
    if reason is not None:
        raise DeviceError(f"--fp8 {asked}: {reason} (device {backend.name})")
    return asked


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
    # Whole or absent: a crash never leaves half a safety net; a link planted at the name
    # is replaced, not written through, and the study folder is not followed if a link.
    with atomic_file(kept, within=out_dir.parent) as out:
        torch.save(model.state_dict(), out)
    return model


def run_serving_trial(
    task: Task,
    policy: Policy,
    model: nn.Module,
    backend: Backend,
    reference: Reference,
    batch_sizes: Sequence[int],
    int8: str | None = None,
    timed_calls: int = TIMED_CALLS,
    warmup_calls: int = WARMUP_CALLS,
) -> ServingResult:
    """Convert ``model`` (fp32, trained) under ``policy``, score it against ``reference``
    and time it at each of ``batch_sizes`` (the first is the scenario's); never raises for
    a problem of the policy."""
    started = time.perf_counter()
    previous = backend.set_switches(policy.tf32, policy.hf32)
    try:
        layer_dtypes = policy.resolve_served(model)
        converted = convert(
            model, layer_dtypes, backend, int8 or policy.int8_method, policy.fp8_method
        )
        result = measure_serving(
            task, converted, reference, backend, batch_sizes[0], timed_calls, warmup_calls
        )
        if result.state == TrialState.COMPLETE:
            result.latency_by_batch_ms[str(batch_sizes[0])] = float(result.latency_p50_ms or 0)
            for size in batch_sizes[1:]:
                result.latency_by_batch_ms[str(size)] = latency_ms(
                    converted, task, backend, size, timed_calls, warmup_calls
                )
        result.low_precision_share = low_precision_share(model, layer_dtypes)
        result.emulated = sorted(set(layer_dtypes.values()) & set(backend.emulated()))
    except AutoprecError as error:  # a policy this model cannot be served in
        result = ServingResult(TrialState.FAILED, first_line(error, 500))
    except Exception as error:  # any failure of a trial is its result
        result = ServingResult(
            TrialState.FAILED, f"{type(error).__name__}: {first_line(error, 500)}"
        )
    finally:
        backend.restore_switches(previous)
    result.batch_size = batch_sizes[0]
    result.run_time_s = time.perf_counter() - started
    return result


def time_models_side_by_side(
    models: Sequence[nn.Module],
    batch: Batch,
    backend: Backend,
    rounds: int = 5,
    block: int = SIDE_BY_SIDE_BLOCK,
) -> list[float]:
    """Median latency (ms) of each model on ``batch``, measured in alternating blocks of
    ``block`` forwards (see `time_side_by_side`)."""
    return time_side_by_side([_Served(m, batch, backend) for m in models], backend, rounds, block)


class _Served:
    """One converted model, timed forward by forward on one batch."""

    def __init__(self, model: nn.Module, batch: Batch, backend: Backend) -> None:
        self.model, self.batch, self.backend = model, batch, backend

    def warm_up(self, calls: int) -> None:
        latencies_s(self.model, self.batch, self.backend, calls, 0)

    def timed(self, calls: int) -> list[float]:
        return latencies_s(self.model, self.batch, self.backend, calls, 0)


class ServingTrials:
    """The serving mode: each trial converts the trained fp32 model under a policy and
    serves it (`run_serving_trial`), scored on agreement with fp32, latency at the
    scenario's batch size and memory."""

    mode: ClassVar[str] = "serving"
    objectives: ClassVar[tuple[str, str, str]] = (
        "accuracy",
        "peak_memory_mb",
        "latency_p50_ms",  # at the scenario's batch
    )
    result_type: ClassVar[type[Result]] = ServingResult
    baseline_verb: ClassVar[str] = "serve"

    def __init__(
        self,
        *,
        task: Task,
        model: nn.Module,
        backend: Backend,
        budget: Budget,
        serving: Serving,
        accuracy_tolerance: float | None = None,
        prefer: str | None = None,
        study: str | None = None,
    ) -> None:
        self.task, self.model, self.backend, self.budget = task, model, backend, budget
        self.serving = serving
        self.asked = (accuracy_tolerance, prefer, study)
        self.fp32: nn.Module | None = None  # the trained model, once `load` readied it
        self.reference: Reference | None = None
        self.out_dir: Path | None = None

    @classmethod
    def of(
        cls, config: Any, task: Task, model: nn.Module, backend: Backend, budget: Budget
    ) -> ServingTrials:
        """The mode made from a search's settings (``config.serving``, checked here
        against the task and the device)."""
        return cls(
            task=task,
            model=model,
            backend=backend,
            budget=budget,
            serving=serving_of(config.serving or ServingConfig(), task, model, backend),
            accuracy_tolerance=config.accuracy_tolerance,
            prefer=config.prefer,
            study=config.study,
        )

    @property
    def settings(self) -> dict[str, Any]:
        return self.serving.settings

    def _serves(self, served: formats.Format) -> bool:
        """Whether this device serves a quantizing format by its default method: natively,
        or emulated where opted into (the search's figures are no such device's)."""
        method = served.method(None, self.backend.kind)
        if served.serving_refusal(self.backend, method) is not None:
            return False
        return not served.emulated_elsewhere or served.refusal(self.backend) is None

    def fit(self, space: SearchSpace, profile: Profile | None) -> SearchSpace:
        """Weights are converted: every layer's may be, int8 and fp8 too where they run
        (their own settings say), and the other quantizing formats where the device serves
        them by their default method (an emulated one where ``--emulate`` names it)."""
        supported = {d for d in DTYPES if self.backend.supports(d)}
        if self.serving.int8 is not None:
            supported.add("int8")
        if self.serving.fp8 is not None:
            supported.add("fp8")
        supported.update(
            served.name
            for served in formats.all_formats()
            if served.quantizes
            and served.name not in self.settings  # int8's and fp8's: --int8, --fp8
            and self._serves(served)
        )
        fitted = space.fit(
            self.model,
            profile,
            self.backend,
            mode=self.mode,
            int8_method=self.serving.int8,
            fp8_method=self.serving.fp8,
        )
        return fitted.restrict(supported)

    def choice(self, space: SearchSpace) -> Choice:
        """The settings first, then the scenario's presets; the study is named after the
        task and the scenario."""
        tolerance, prefer, study = self.asked
        preset = self.serving.scenario
        feasibility = Feasibility(
            preset.accuracy_tolerance if tolerance is None else tolerance,
            preset.min_top1_agreement,
            preset.max_rel_deviation,
        )
        chosen = AS_SELECTION.get(prefer or preset.prefer, prefer or "speed")
        return Choice(feasibility, chosen, study or f"{self.task.name}-{preset.name}")

    def load(self, out_dir: Path, may_train: bool, on_training: Callable[[Path], None]) -> None:
        """The trained fp32 model the trials convert, and its outputs to compare with."""
        self.out_dir = out_dir
        self.fp32 = fp32_model(
            self.serving, self.task, self.backend, self.budget, out_dir, may_train, on_training
        )
        self.reference = Reference.of(self.task, self.fp32, self.backend)

    def _loaded(self) -> tuple[nn.Module, Reference]:
        if self.fp32 is None or self.reference is None:
            raise AutoprecError("serving trials: the fp32 model was not loaded (call load)")
        return self.fp32, self.reference

    def profile(self, seed: int) -> Profile:
        """The trained model's risks (trains nothing: it serves)."""
        from autoprec.profile.sensitivity import profile_task

        model, _ = self._loaded()
        return profile_task(self.task, self.backend, seed=seed, model=model, steps=0)

    def warm_up(self, space: SearchSpace, limit_s: float) -> None:
        """Nothing here: each measurement warms up before it times (``WARMUP_CALLS``)."""

    def judged_against(self, baseline: Result, early_stopping: bool) -> ServingTrials:
        """A serving trial is short and trains nothing: none is stopped early."""
        return self

    def measure(self, policy: Policy) -> ServingResult:
        model, reference = self._loaded()
        serving = self.serving
        return run_serving_trial(
            self.task, policy, model, self.backend, reference, serving.batch_sizes, serving.int8
        )

    def failed(self, reason: str) -> ServingResult:
        return ServingResult(TrialState.FAILED, reason)

    def retime(self, policies: list[Policy]) -> list[float]:
        """Latency at the scenario's batch size, the policies' models timed in turn."""
        model, _ = self._loaded()
        int8 = self.serving.int8
        models = [convert_policy(model, p, self.backend, int8) for p in policies]
        batch = timing_batch(self.task, self.serving.batch_sizes[0], self.backend)
        return time_models_side_by_side(models, batch, self.backend)

    def layer_table(self, policy: Policy, model: nn.Module) -> list[dict[str, Any]]:
        """The dtype each layer's weights are served in."""
        return policy.layer_table(model, self.backend, mode=self.mode)

    def summary_settings(self) -> dict[str, Any]:
        checkpoint = self.serving.checkpoint
        return {"checkpoint": None if checkpoint is None else str(checkpoint.resolve())}

    def summary_part(self, feasibility: Feasibility) -> dict[str, Any] | None:
        """The scenario and what it asks, and the fp32 weights the trials converted (the
        summary adds the best at each batch size)."""
        serving = self.serving
        out_dir = self.out_dir or Path(".")
        return {
            "scenario": serving.scenario.name,
            "batch_sizes": list(serving.batch_sizes),
            "int8": serving.int8,
            "fp32_checkpoint": str(serving.checkpoint or out_dir / FP32_CHECKPOINT),
            "min_top1_agreement": feasibility.min_top1_agreement,
            "max_rel_deviation": feasibility.max_rel_deviation,
        }

    def leave_behind(
        self, policy: Policy, out_dir: Path, task_spec: str | None, publish: Publisher
    ) -> dict[str, Any] | None:
        """The chosen model saved as an MLflow model and logged on the parent run; where
        it cannot be, one warning and the reason in the summary."""
        from autoprec.serving.mlflow_model import PICKLE_NOTE

        folder, said = save_served_model(self, policy, out_dir, task_spec)
        if folder is None:
            publish.warn(f"the chosen model was not logged as an MLflow model: {said}")
            return {"logged": False, "reason": said}
        if said == "pickle":
            publish.warn(f"the chosen MLflow model is {PICKLE_NOTE}")
        unpickles = said == "pickle"
        tags = {"autoprec.model_format": said, "autoprec.model_unpickles": str(unpickles).lower()}
        publish.log_model_folder(folder, tags=tags)
        parent = publish.parent_id
        return {
            "logged": True,
            "format": said,
            "unpickles": unpickles,
            "path": str(folder),
            "uri": None if parent is None else f"runs:/{parent}/model",
        }


def save_served_model(
    trials: ServingTrials, policy: Policy, out_dir: Path, task_spec: str | None = None
) -> tuple[Path | None, str]:
    """The chosen policy's model, converted for the CPU (where MLflow's pyfunc runs it),
    saved as an MLflow model in ``out_dir/mlflow_model``: the folder and the format used,
    or None and the reason it could not be saved. ``task_spec`` (the task's name or file)
    lets a model that does not export be rebuilt at load rather than pickled."""
    from autoprec.devices import get_backend
    from autoprec.serving.mlflow_model import save_mlflow_model

    cpu = get_backend("cpu")
    int8 = trials.serving.int8
    fp32, _ = trials._loaded()
    dtypes = set(policy.resolve_served(fp32).values())
    for dtype in sorted(dtypes):  # weight-only fp8 runs on the CPU; dynamic fp8 needs CUDA
        served = formats.get(dtype)
        if not served.quantizes:
            continue
        try:
            method = served.method(
                {"int8": int8}.get(dtype) or policy.quantization.method(dtype), "cpu"
            )
        except PolicyError as error:
            return None, f"{error}, where the MLflow model runs"
        reason = served.serving_refusal(cpu, method)
        if reason is not None:
            return None, f"{reason}, where the MLflow model runs"
    path = out_dir / MLFLOW_MODEL_DIR
    try:
        converted = convert_policy(fp32, policy, cpu, int8)  # a copy, on the CPU
        batch = trials.task.first_val_batch()
        spec = None if task_spec is None else _absolute_task_file(task_spec)
        return path, save_mlflow_model(converted, batch, policy, path, int8, fp32, spec)
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
