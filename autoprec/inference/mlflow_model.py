"""The chosen serving model as an MLflow model, for ``mlflow.pyfunc.load_model`` and
``mlflow models serve``.

MLflow's PyTorch flavour calls the model with one tensor and wants one tensor back (its
pyfunc ``predict`` takes one numpy array), so the converted model goes in wrapped:
`ServedModel` returns the logits, and a model of several inputs of one shape and dtype
(transformers' ``input_ids`` and ``attention_mask``) takes them stacked along dimension 1,
in the order the metadata's ``inputs`` names them; ``labels`` are left out (a served model
computes no loss). The signature has a free batch dimension.

It is saved as ``pt2`` (``torch.export``: loading it needs torch alone) where the model
exports, else as ``pickle`` (loading it needs autoprec importable, for the casts between
layers): torch's own dynamic int8, the CPU's default, packs its weights in objects
``torch.export`` cannot trace.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from autoprec.errors import AutoprecError, first_line
from autoprec.inference.convert import has_torch_dynamic_int8, import_torchao
from autoprec.policy import Policy
from autoprec.structures import tensors
from autoprec.tasks.base import Batch, logits_of

EXAMPLE_SAMPLES = 4


class ServedModel(nn.Module):
    """A converted model as MLflow's PyTorch flavour calls it: one tensor in (several
    inputs stacked along dimension 1, passed by ``keywords`` where the model takes them by
    name), one tensor out (its logits, else its first floating output)."""

    def __init__(
        self, model: nn.Module, keywords: list[str] | None = None, stacked: bool = False
    ) -> None:
        super().__init__()
        self.model = model
        self.keywords = keywords or []
        self.stacked = stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = x.unbind(1) if self.stacked else (x,)
        if self.keywords:
            outputs = self.model(**dict(zip(self.keywords, inputs, strict=True)))
        else:
            outputs = self.model(*inputs)
        logits = logits_of(outputs)
        if logits is not None:
            return logits
        return next(t for t in tensors(outputs) if t.is_floating_point())


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
    """MLflow's advice against pickle, logged as a warning: the module docstring says why
    pickle is used, and only where pt2 cannot be."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def save_mlflow_model(
    converted: nn.Module, batch: Batch, policy: Policy, path: Path, int8: str | None
) -> str:
    """Save ``converted`` (a served model on the CPU, where MLflow's pyfunc runs it; see
    `autoprec.inference.convert`) as an MLflow model folder at ``path`` (replaced), with
    ``batch`` as its input example and the policy in its metadata and beside it. Returns
    the serialization format used; raises AutoprecError with the reason where it cannot be
    saved."""
    import mlflow.pytorch
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

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
    signature = ModelSignature(
        inputs=Schema([TensorSpec(array.dtype, (-1, *array.shape[1:]))]),
        outputs=Schema([TensorSpec(output.dtype, (-1, *output.shape[1:]))]),
    )
    requirements = [f"torch=={torch.__version__.split('+')[0]}"]
    if int8 is not None and int8.startswith("torchao"):
        torchao = import_torchao()
        requirements.append(f"torchao=={torchao.__version__.split('+')[0]}")
    metadata = {
        "autoprec_policy": policy.to_dict(),
        "int8": int8,
        "inputs": names or None,
        "inputs_stacked_on_dim_1": stacked,
    }
    errors = []
    formats = ["pickle"] if has_torch_dynamic_int8(converted) else ["pt2", "pickle"]
    folder = Path(tempfile.mkdtemp())
    try:
        policy_file = policy.save(folder / "policy.yaml")
        for fmt in formats:
            shutil.rmtree(path, ignore_errors=True)
            try:
                with warnings.catch_warnings(), _quiet("mlflow.pytorch"):
                    warnings.simplefilter("ignore")  # MLflow's and the tracer's, not the user's
                    mlflow.pytorch.save_model(
                        wrapped,
                        str(path),
                        signature=signature,
                        input_example=array,
                        serialization_format=fmt,
                        pip_requirements=requirements,
                        metadata=metadata,
                        extra_files=[str(policy_file)],
                    )
                return fmt
            except Exception as error:
                errors.append(f"{fmt}: {type(error).__name__}: {first_line(error, 160)}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    raise AutoprecError("the model could not be saved for MLflow (" + "; ".join(errors) + ")")
