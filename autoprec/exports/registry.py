"""The export formats, one declaration each: what the format needs, what it refuses, the
files it writes and its help line. A policy found by a search is autoprec's YAML; a
deployment reads something else: a new format is one module whose function takes an
`ExportRequest`, named here as ``"module:function"`` and imported only when it writes (so
that ``autoprec export --help`` reads this module without torch), and one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torch import nn

    from autoprec.policy import Policy


@dataclass(frozen=True)
class ExportRequest:
    """What a writer is given: the policy, the folder, and what the format needs of the
    model (the fp32 module; trained, where its weights are written), one input batch, the
    device kind (None: the format's own, as `autoprec.exports.export_policy` fills it in),
    the int8 method the serving search measured and the task's name or file."""

    policy: Policy
    out_dir: str | Path
    model: nn.Module | None = None
    example: Any = None
    device: str | None = None
    int8: str | None = None
    task: str | None = None


@dataclass(frozen=True)
class ExportFormat:
    """One export format: what it needs, refuses and writes."""

    name: str
    writer: str  # "module:function" taking an ExportRequest
    help: str
    files: tuple[str, ...]
    # its writer needs the fp32 model, is sharpened by it (optional), or never reads it
    model: Literal["needed", "optional", "unused"] = "needed"
    trained: bool = False  # needs the trained weights, not only the layer names
    converted: bool = False  # weights converted for serving: only a serving study's, on its device
    serving_policies: bool = False  # expresses int8 layers and fp8 ones by a serving method
    device: str | None = None  # the device kind when none is given, and what it decides
    device_help: str = ""
    refused_devices: tuple[tuple[str, str], ...] = ()  # kinds, each with "module:attr" why

    def loads_model(self, task_known: bool) -> bool:
        """Whether ``autoprec export`` builds the task's model for it."""
        return self.model == "needed" or (self.model == "optional" and task_known)


_NPU = "the device whose autocast decides which layers run in fp32"
FORMATS = {
    f.name: f
    for f in (
        ExportFormat(
            "yaml",
            "autoprec.exports.yaml_file:export",
            "policy.yaml, what autoprec.load_policy reads back",
            ("policy.yaml",),
            model="unused",
            serving_policies=True,
        ),
        ExportFormat(
            "torch-npu",
            "autoprec.exports.npu:export",
            "npu_settings.py (torch_npu's ACL_PRECISION_MODE and HF32 switches, then the "
            "policy applied) and policy.yaml",
            ("npu_settings.py", "policy.yaml"),
            model="optional",
        ),
        ExportFormat(
            "cann",
            "autoprec.exports.cann:export",
            "model.onnx, keep_dtype.cfg and atc_command.sh for ATC (Ascend inference)",
            ("model.onnx", "keep_dtype.cfg", "atc_command.sh"),
            trained=True,
            device="npu",
            device_help=_NPU,
        ),
        ExportFormat(
            "transformers",
            "autoprec.exports.hf:export",
            "keep_in_fp32_modules.json and load_transformers.py (_keep_in_fp32_modules_strict, "
            "then from_pretrained(..., dtype=...))",
            ("keep_in_fp32_modules.json", "load_transformers.py"),
            device="npu",
            device_help=_NPU,
        ),
        ExportFormat(
            "fp8",
            "autoprec.exports.fp8:export",
            "a training policy's fp8 layers as torchtitan's [quantize.linear.float8] "
            "filter_fqns with its command line, torchao's convert_to_float8_training and "
            "accelerate's AORecipeKwargs (a policy without fp8 layers is refused)",
            ("float8_torchtitan.toml", "float8_torchao.py", "float8_accelerate.py", "policy.yaml"),
            device="cuda",
            device_help="the device kind the fp8 layers are planned for",
            refused_devices=(("npu", "autoprec.devices:NPU_NO_FP8"),),
        ),
        ExportFormat(
            "model",
            "autoprec.exports.served:export",
            "program.pt2 (a torch.export program of the converted model), served.pt, "
            "fp32.pt, policy.yaml and load_model.py",
            ("program.pt2", "fp32.pt", "served.pt", "policy.yaml", "load_model.py"),
            trained=True,
            converted=True,
            serving_policies=True,
            device="cpu",
            device_help="the device served on",
        ),
        ExportFormat(
            "torchao",
            "autoprec.exports.torchao_file:export",
            "torchao_config.py, the int8 and fp8 layers as a FqnToConfig",
            ("torchao_config.py", "policy.yaml"),
            converted=True,
            serving_policies=True,
            device="cpu",
            device_help="the device served on",
        ),
        ExportFormat(
            "torchao-optimizer",
            "autoprec.exports.optimizer_torchao:export",
            "a training policy's optimizer states as torchao's optimizer classes per "
            "parameter group (torchao_optimizer.py)",
            ("torchao_optimizer.py", "policy.yaml"),
        ),
        ExportFormat(
            "bitsandbytes",
            "autoprec.exports.optimizer_bnb:export",
            "a training policy's optimizer as bitsandbytes' 8-bit AdamW with the 32-bit "
            "overrides (bitsandbytes_optimizer.py)",
            ("bitsandbytes_optimizer.py", "policy.yaml"),
        ),
        ExportFormat(
            "trainer",
            "autoprec.exports.trainer:export",
            "a training policy's optimizer in transformers' Trainer (trainer_optimizer.py: "
            "its optim string where one holds the policy, else optimizers= from the policy)",
            ("trainer_optimizer.py", "policy.yaml"),
        ),
    )
}


def load(reference: str) -> Any:
    """What ``"module:attr"`` names (a writer, a refusal's reason), its module imported."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def format_names(default: str, converted: bool = True) -> tuple[str, ...]:
    """The formats' names, ``default`` first, those writing converted weights left out
    unless ``converted``: what `autoprec.trials.Mode.export_formats` a mode allows."""
    kept = [f.name for f in FORMATS.values() if converted or not f.converted]
    return (default, *(name for name in kept if name != default))
