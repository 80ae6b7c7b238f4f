"""The chosen serving model as an MLflow model, for ``mlflow.pyfunc.load_model`` and
``mlflow models serve``.

MLflow's PyTorch flavour calls the model with one tensor and wants one tensor back (its
pyfunc ``predict`` takes one numpy array), so the converted model goes in wrapped:
`ServedModel` returns the logits, and a model of several inputs of one shape and dtype
(transformers' ``input_ids`` and ``attention_mask``) takes them stacked along dimension 1,
in the order the metadata's ``inputs`` names them; ``labels`` are left out (a served model
computes no loss). The signature has a free batch dimension.

It is saved as ``pt2`` (``torch.export``: loading it needs torch alone) where the model
exports. torch's own dynamic int8, the CPU's default, packs its weights in objects
``torch.export`` cannot trace; such a model is saved as ``autoprec-rebuilt`` (data only: the
fp32 weights, the policy and the task's name, rebuilt and converted at load by
`autoprec.serving.mlflow_rebuilt`, nothing unpickled). Only where the task has no name or
file (a Task object given to ``search``) is it pickled, and the search says so in a warning,
in the metadata (``unpickles``) and in the parent run's tags.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.files import make_folder
from autoprec.errors import AutoprecError, WriteError, first_line
from autoprec.policy import Policy
from autoprec.serving.conversion import has_torch_dynamic_int8, weight_dtypes
from autoprec.serving.logits_path import ServedModel
from autoprec.serving.mlflow_rebuilt import FORMAT, write_data
from autoprec.serving.quantizers import quantizer
from autoprec.tasks.base import Batch

EXAMPLE_SAMPLES = 4
_LOADER = "autoprec.serving.mlflow_rebuilt"


def served_inputs(batch: Batch) -> tuple[list[str], list[torch.Tensor]]:
    """The batch's model inputs in call order: names (empty for positional inputs) and
    tensors. Raises AutoprecError for inputs one array cannot carry."""
    if batch.args and batch.kwargs:
        raise AutoprecError("inputs both positional and by keyword")
    names = [k for k in batch.kwargs if k != "labels"]
    values = [batch.kwargs[k] for k in names] if names else list(batch.args)
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        raise AutoprecError("inputs that are not all tensors")
    if len({(tuple(v.shape), v.dtype) for v in values}) > 1:
        raise AutoprecError("several inputs of different shapes or dtypes")
    return names, values


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """MLflow's advice against pickle, logged as a warning: pickle is the last resort (see
    the module docstring), and the search's own warning says so."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


PICKLE_NOTE = (
    "saved with pickle: loading it runs whatever the artifact store holds, so only load it "
    "from a store no one else can write"
)


def save_mlflow_model(
    converted: nn.Module,
    batch: Batch,
    policy: Policy,
    path: Path,
    int8: str | None,
    fp32: nn.Module | None = None,
    task_spec: str | None = None,
) -> str:
    """Save ``converted`` (a served model on the CPU, where MLflow's pyfunc runs it; see
    `autoprec.serving.conversion`) as an MLflow model folder at ``path`` (replaced), with
    ``batch`` as its input example and the policy in its metadata and beside it; ``int8``
    (default: the policy's) is the method its int8 layers were quantized with. Returns
    the serialization format used: ``pt2`` where it exports, else ``autoprec-rebuilt``
    (``fp32``, the model it was converted from, and ``task_spec``, the task's name or file,
    rebuilt at load: nothing unpickled), else ``pickle``. Raises AutoprecError with the
    reason where it cannot be saved."""
    try:
        names, values = served_inputs(batch)
    except AutoprecError as error:
        raise AutoprecError(
            f"an MLflow PyTorch model takes one array; the task has {error}"
        ) from None
    stacked = len(values) > 1
    wrapped = ServedModel(converted, names, stacked).eval()
    heads = [v[:EXAMPLE_SAMPLES].detach().cpu() for v in values]
    example = torch.stack(heads, 1) if stacked else heads[0]
    with torch.inference_mode():
        output = wrapped(example).float().numpy()
    array = example.numpy()
    int8 = int8 or policy.int8_method
    requirements = [f"torch=={torch.__version__.split('+')[0]}"]
    if int8 is not None:
        requirements += quantizer(int8).requirements()
    for dtype in sorted(set(weight_dtypes(converted).values())):  # torchao's float8 weights...
        served = formats.get(dtype) if formats.known(dtype) else None
        named = {"int8": int8}.get(dtype) or policy.quantization.method(dtype)
        method = served.method(named, "cpu") if served else None
        if served is not None and served.quantizes and method is not None:
            requirements += [r for r in method.requirements() if r not in requirements]
    saved_as = [] if has_torch_dynamic_int8(converted) else ["pt2"]
    if fp32 is not None and task_spec is not None:
        saved_as.append(FORMAT)
    saved_as.append("pickle")
    common = {
        "signature": _signature(array, output),
        "input_example": array,
        "pip_requirements": requirements,
    }
    metadata = {
        "autoprec_policy": policy.to_dict(),
        "int8": int8,
        "inputs": names or None,
        "inputs_stacked_on_dim_1": stacked,
    }
    errors = []
    # MLflow writes the model's files itself, following links: it writes them into a
    # fresh private folder (mkdtemp's, 0700) beside ``path``, which is renamed into place.
    folder = Path(tempfile.mkdtemp(dir=make_folder(path.parent), prefix=f".{path.name}."))
    staged = folder / "model"
    try:
        policy_file = policy.save(folder / "policy.yaml")
        data = None
        if fp32 is not None and task_spec is not None:
            state = fp32.state_dict()
            data = write_data(folder / "rebuilt", state, policy, task_spec, int8, names, stacked)
        for fmt in saved_as:
            common["metadata"] = {**metadata, "serialization": fmt, "unpickles": fmt == "pickle"}
            try:
                if fmt == FORMAT:
                    _save_rebuilt(staged, data, common)
                else:
                    _save_pytorch(staged, wrapped, fmt, policy_file, common)
            except Exception as error:  # MLflow's save: try the next format
                errors.append(f"{fmt}: {type(error).__name__}: {first_line(error, 160)}")
                continue
            _put_in_place(staged, path)
            return fmt
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _remove(path)
    raise AutoprecError("the model could not be saved for MLflow (" + "; ".join(errors) + ")")


def _put_in_place(staged: Path, path: Path) -> None:
    """The staged model folder renamed to ``path``, whatever was there removed first (a
    link itself, not what it points to). A link planted between the two makes the
    rename fail (a folder is not renamed over a link), never write through it."""
    _remove(path)
    try:
        staged.rename(path)
    except OSError as error:
        raise WriteError(f"{path}: cannot write ({error.strerror or error})") from None


def _remove(path: Path) -> None:
    """``path`` gone: a link or a file unlinked, a folder (not a link) removed whole."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _signature(array: Any, output: Any) -> Any:
    """One array in, one out, both with a free batch dimension."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    return ModelSignature(
        inputs=Schema([TensorSpec(array.dtype, (-1, *array.shape[1:]))]),
        outputs=Schema([TensorSpec(output.dtype, (-1, *output.shape[1:]))]),
    )


def _save_pytorch(
    path: Path, wrapped: nn.Module, fmt: str, policy_file: Path, common: dict[str, Any]
) -> None:
    """MLflow's PyTorch flavour, ``fmt`` pt2 or pickle, the policy beside it."""
    import mlflow.pytorch

    shutil.rmtree(path, ignore_errors=True)  # a failed format's files (a private folder)
    with warnings.catch_warnings(), _quiet("mlflow.pytorch"):
        warnings.simplefilter("ignore")  # MLflow's and the tracer's, not the user's
        mlflow.pytorch.save_model(
            wrapped,
            str(path),
            serialization_format=fmt,
            extra_files=[str(policy_file)],
            **common,
        )


def _save_rebuilt(path: Path, data: Path | None, common: dict[str, Any]) -> None:
    """A pyfunc of data only, which `autoprec.serving.mlflow_rebuilt` loads."""
    import mlflow.pyfunc

    assert data is not None
    shutil.rmtree(path, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlflow.pyfunc.save_model(str(path), loader_module=_LOADER, data_path=str(data), **common)
