"""The chosen serving model as an MLflow model, for ``mlflow.pyfunc.load_model`` and
``mlflow models serve``.

MLflow's PyTorch flavour calls the model with positional tensors and wants one tensor back,
so the converted model goes in wrapped: `ServedModel` takes the task's inputs in order
(keyword inputs, as transformers models take them, by their names, ``labels`` left out: a
served model computes no loss) and returns the logits. The signature names each input,
with a free batch dimension.

It is saved as ``pt2`` (``torch.export``: loading it needs torch alone) where the model
exports, else as ``pickle`` (loading it needs autoprec importable, for the casts between
layers): torch's own dynamic int8, the CPU's default, packs its weights in objects
``torch.export`` cannot trace.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from autoprec.errors import AutoprecError, first_line
from autoprec.inference.convert import has_torch_dynamic_int8
from autoprec.policy import Policy
from autoprec.structures import tensors
from autoprec.tasks.base import Batch, logits_of

MAX_INPUTS = 4  # the fixed-arity wrappers below: MLflow's torch.export needs named parameters


class ServedModel(nn.Module):
    """A converted model called with positional tensors, returning one tensor (its logits,
    else its first floating output)."""

    def __init__(self, model: nn.Module, keywords: list[str] | None = None) -> None:
        super().__init__()
        self.model = model
        self.keywords = keywords or []

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.keywords:
            outputs = self.model(**dict(zip(self.keywords, inputs, strict=True)))
        else:
            outputs = self.model(*inputs)
        logits = logits_of(outputs)
        if logits is not None:
            return logits
        return next(t for t in tensors(outputs) if t.is_floating_point())


class _OneInput(ServedModel):
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.run(a)


class _TwoInputs(ServedModel):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.run(a, b)


class _ThreeInputs(ServedModel):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.run(a, b, c)


class _FourInputs(ServedModel):
    def forward(
        self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor
    ) -> torch.Tensor:
        return self.run(a, b, c, d)


_BY_ARITY = {1: _OneInput, 2: _TwoInputs, 3: _ThreeInputs, 4: _FourInputs}


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """MLflow's advice on pickle, logged as a warning: the module docstring says why."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def served_inputs(batch: Batch) -> tuple[list[str], list[torch.Tensor]]:
    """The batch's model inputs in call order: names (empty for positional inputs) and
    tensors. Raises AutoprecError for inputs MLflow's PyTorch flavour cannot carry."""
    if batch.args and batch.kwargs:
        raise AutoprecError("inputs both positional and by keyword")
    names = [k for k in batch.kwargs if k != "labels"]
    values = [batch.kwargs[k] for k in names] if names else list(batch.args)
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        raise AutoprecError("inputs that are not all tensors")
    if len(values) > MAX_INPUTS:
        raise AutoprecError(f"{len(values)} inputs (at most {MAX_INPUTS})")
    return names, values


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
        raise AutoprecError(f"an MLflow model takes tensors only; the task has {error}") from None
    wrapped = _BY_ARITY[len(values)](converted, names).eval()
    example = [v[: min(len(v), 4)].detach().cpu() for v in values]
    with torch.inference_mode():
        output = wrapped(*example).float().cpu().numpy()
    arrays = [v.numpy() for v in example]
    signature = ModelSignature(
        inputs=Schema(
            [
                TensorSpec(a.dtype, (-1, *a.shape[1:]), name or None)
                for a, name in zip(arrays, names or [""] * len(arrays), strict=True)
            ]
        ),
        outputs=Schema([TensorSpec(output.dtype, (-1, *output.shape[1:]))]),
    )
    requirements = [f"torch=={torch.__version__.split('+')[0]}"]
    if int8 is not None and int8.startswith("torchao"):
        import torchao

        requirements.append(f"torchao=={torchao.__version__.split('+')[0]}")
    policy_file = path.parent / f".{path.name}-policy.yaml"
    policy.save(policy_file)
    metadata = {"autoprec_policy": policy.to_dict(), "int8": int8, "inputs": names or None}
    errors = []
    formats = ["pickle"] if has_torch_dynamic_int8(converted) else ["pt2", "pickle"]
    try:
        for fmt in formats:
            shutil.rmtree(path, ignore_errors=True)
            try:
                with warnings.catch_warnings(), _quiet("mlflow.pytorch"):
                    warnings.simplefilter("ignore")  # MLflow's and the tracer's, not the user's
                    mlflow.pytorch.save_model(
                        wrapped,
                        str(path),
                        signature=signature,
                        input_example=arrays if len(arrays) > 1 else arrays[0],
                        serialization_format=fmt,
                        pip_requirements=requirements,
                        metadata=metadata,
                        extra_files=[str(policy_file)],
                    )
                return fmt
            except Exception as error:
                errors.append(f"{fmt}: {type(error).__name__}: {first_line(error, 160)}")
    finally:
        policy_file.unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    raise AutoprecError("the model could not be saved for MLflow (" + "; ".join(errors) + ")")
