"""Export a policy to the formats other tools read.

A policy found by a search is autoprec's YAML; a deployment reads something else. Each format
is one function and one module; ``export_policy`` picks one by name:

- ``yaml``: ``policy.yaml``, what ``autoprec.load_policy`` reads back;
- ``torch-npu``: ``npu_settings.py`` (torch_npu's ACL_PRECISION_MODE and HF32 switches, then
  the policy applied) and ``policy.yaml``;
- ``cann``: ``model.onnx``, ``keep_dtype.cfg`` and ``atc_command.sh`` for ATC (Ascend inference);
- ``transformers``: ``keep_in_fp32_modules.json`` and ``load_transformers.py``
  (``_keep_in_fp32_modules_strict``, then ``from_pretrained(..., dtype=...)``);
- ``model`` (serving): ``program.pt2`` (the converted model, ``torch.export``), ``fp32.pt``,
  ``policy.yaml`` and ``load_model.py``;
- ``torchao`` (serving): ``torchao_config.py``, the int8 layers as a ``FqnToConfig``;
- ``fp8``: a training policy's fp8 layers as torchtitan (``float8_torchtitan.toml``), torchao
  (``float8_torchao.py``) and accelerate (``float8_accelerate.py``) convert them;
- ``torchao-optimizer``: a training policy's optimizer states as torchao's optimizer classes per
  parameter group (``torchao_optimizer.py``);
- ``bitsandbytes``: its optimizer as bitsandbytes' 8-bit AdamW with the 32-bit overrides
  (``bitsandbytes_optimizer.py``);
- ``trainer``: its optimizer in transformers' Trainer (``trainer_optimizer.py``: the Trainer's
  ``optim`` string where one holds the policy, else ``optimizers=`` from the policy).

A format that cannot say exactly what the policy says warns (``ExportWarning``) and writes the
same text in its file's header. Every value written into a generated file is quoted, and no
export overwrites a file it did not write (``.autoprec-export.json`` records what it wrote).
The Ascend formats follow the documented formats only: neither torch_npu nor ATC ran here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from autoprec.devices import NPU_NO_FP8, device_kind
from autoprec.exports import (
    cann,
    fp8,
    hf,
    npu,
    optimizer_bnb,
    optimizer_torchao,
    served,
    torchao_file,
    trainer,
    yaml_file,
)
from autoprec.exports._common import ExportError, ExportWarning
from autoprec.exports._owned import removed_if_refused
from autoprec.exports.cann import export_cann
from autoprec.exports.fp8 import export_fp8
from autoprec.exports.hf import export_transformers
from autoprec.exports.npu import export_torch_npu
from autoprec.exports.optimizer_bnb import export_bitsandbytes
from autoprec.exports.optimizer_torchao import export_torchao_optimizer
from autoprec.exports.served import export_model
from autoprec.exports.torchao_file import export_torchao
from autoprec.exports.trainer import export_trainer, trainer_optim
from autoprec.exports.yaml_file import export_yaml
from autoprec.policy import Policy

FORMATS = (
    "yaml",
    "torch-npu",
    "cann",
    "transformers",
    "fp8",
    "model",
    "torchao",
    "torchao-optimizer",
    "bitsandbytes",
    "trainer",
)
SERVING_FORMATS = ("model", "torchao")
# A training policy's optimizer states.
OPTIMIZER_FORMATS = ("torchao-optimizer", "bitsandbytes", "trainer")
# Every name an export writes: what a refused export into a folder it made removes.
_NAMES = sorted(
    {yaml_file.POLICY_FILE}.union(
        *(
            m.FILES
            for m in (cann, fp8, hf, npu, optimizer_bnb, optimizer_torchao, served, torchao_file)
        ),
        trainer.FILES,
    )
)

__all__ = [
    "FORMATS",
    "OPTIMIZER_FORMATS",
    "SERVING_FORMATS",
    "ExportError",
    "ExportWarning",
    "export_bitsandbytes",
    "export_cann",
    "export_fp8",
    "export_model",
    "export_policy",
    "export_torch_npu",
    "export_torchao",
    "export_torchao_optimizer",
    "export_trainer",
    "export_transformers",
    "export_yaml",
    "trainer_optim",
]


def export_policy(
    policy: Policy,
    fmt: str,
    out_dir: str | Path,
    model: nn.Module | None = None,
    example: Any = None,
    device: str | None = None,
    int8: str | None = None,
    task: str | None = None,
) -> list[Path]:
    """Write ``policy`` in format ``fmt`` under ``out_dir`` and return the files' paths.

    ``model`` (the fp32 module the policy was found for; trained, for ``model``) is needed
    by every format but ``yaml`` and ``torch-npu``, which it sharpens (the optimizer formats
    take its parameter names); ``example`` (one
    input batch, e.g. ``task.batch(raw)``) by ``cann``, and by ``model`` for its program.
    ``device`` is, for ``cann`` and ``transformers``, the device kind whose autocast decides
    which layers run in fp32 (``Policy.resolve``; default ``npu``), for ``fp8`` the device
    kind its layers are planned for (default ``cuda``; ``npu`` is refused: Ascend has no
    fp8 matmuls), and for ``model`` the device served on (default ``cpu``); ``torch-npu``
    always resolves on the NPU. ``int8``
    is the int8 method the serving search measured (``model``, ``torchao``); ``task`` a
    task's name or file, which ``model``'s ``load_model.py`` builds the model from.
    """
    if fmt in ("torch-npu", "cann", "transformers", "fp8", *OPTIMIZER_FORMATS) and (
        policy.serving_only
    ):
        raise ExportError(
            f"format {fmt!r}: the policy serves layers in {_served_in(policy)}, which {fmt} "
            "cannot express "
            f"(the int8 formats: {', '.join(SERVING_FORMATS)})"
        )
    if fmt == "fp8" and device is not None and device_kind(device) == "npu":
        raise ExportError(f"format 'fp8': --device {device}: {NPU_NO_FP8}")
    with removed_if_refused(out_dir, _NAMES):
        return _export(policy, fmt, out_dir, model, example, device, int8, task)


def _export(
    policy: Policy,
    fmt: str,
    out_dir: str | Path,
    model: nn.Module | None,
    example: Any,
    device: str | None,
    int8: str | None,
    task: str | None,
) -> list[Path]:
    if fmt == "yaml":
        return export_yaml(policy, out_dir)
    if fmt == "torch-npu":
        return export_torch_npu(policy, out_dir, model)
    if fmt == "cann":
        return export_cann(policy, out_dir, model, example, device or "npu")
    if fmt == "transformers":
        return export_transformers(policy, out_dir, model, device or "npu")
    if fmt == "fp8":
        return export_fp8(policy, out_dir, model, device or "cuda")
    if fmt == "model":
        return export_model(policy, out_dir, model, example, device or "cpu", int8, task)
    if fmt == "torchao":
        return export_torchao(policy, out_dir, model, int8, device or "cpu")
    if fmt == "torchao-optimizer":
        return export_torchao_optimizer(policy, out_dir, model)
    if fmt == "bitsandbytes":
        return export_bitsandbytes(policy, out_dir, model)
    if fmt == "trainer":
        return export_trainer(policy, out_dir, model)
    raise ExportError(f"format {fmt!r}: unknown (expected one of {', '.join(FORMATS)})")


def _served_in(policy: Policy) -> str:
    """What makes a policy serving-only: int8 layers, and/or fp8 ones by a serving method."""
    found = ["int8"] if "int8" in (policy.default, *(r.dtype for r in policy.rules)) else []
    if policy.fp8_method is not None and policy.names_fp8:
        found.append(f"fp8 ({policy.fp8_method})")
    return " and ".join(found)
