"""Export a policy to the formats other tools read.

A policy found by a search is autoprec's YAML; a deployment reads something else. Each format
is one function and one module; ``export_policy`` picks one by name:

- ``yaml``: ``policy.yaml``, what ``autoprec.load_policy`` reads back;
- ``torch-npu``: ``npu_settings.py`` (torch_npu's ACL_PRECISION_MODE and HF32 switches, then
  the policy applied) and ``policy.yaml``;
- ``cann``: ``model.onnx``, ``keep_dtype.cfg`` and ``atc_command.sh`` for ATC (Ascend inference);
- ``transformers``: ``keep_in_fp32_modules.json`` and ``load_transformers.py``
  (``_keep_in_fp32_modules_strict``, then ``from_pretrained(..., dtype=...)``).

A format that cannot say exactly what the policy says warns (``ExportWarning``) and writes the
same text in its file's header. The Ascend formats follow the documented formats only: neither
torch_npu nor ATC ran here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from autoprec import Policy
from autoprec.exports._common import ExportError, ExportWarning
from autoprec.exports.cann import export_cann
from autoprec.exports.hf import export_transformers
from autoprec.exports.npu import export_torch_npu
from autoprec.exports.yaml_file import export_yaml

FORMATS = ("yaml", "torch-npu", "cann", "transformers")

__all__ = [
    "FORMATS",
    "ExportError",
    "ExportWarning",
    "export_cann",
    "export_policy",
    "export_torch_npu",
    "export_transformers",
    "export_yaml",
]


def export_policy(
    policy: Policy,
    fmt: str,
    out_dir: str | Path,
    model: nn.Module | None = None,
    example: Any = None,
    device: str = "npu",
) -> list[Path]:
    """Write ``policy`` in format ``fmt`` under ``out_dir`` and return the files' paths.

    ``model`` (the fp32 module the policy was found for) is needed by ``cann`` and
    ``transformers`` and sharpens ``torch-npu``; ``example`` (one input batch, e.g.
    ``task.batch(raw)``) by ``cann``. ``device`` is the device kind whose autocast decides
    which layers run in fp32 (``Policy.resolve``) for ``cann`` and ``transformers``;
    ``torch-npu`` always resolves on the NPU.
    """
    if fmt == "yaml":
        return export_yaml(policy, out_dir)
    if fmt == "torch-npu":
        return export_torch_npu(policy, out_dir, model)
    if fmt == "cann":
        return export_cann(policy, out_dir, model, example, device)
    if fmt == "transformers":
        return export_transformers(policy, out_dir, model, device)
    raise ExportError(f"format {fmt!r}: unknown (expected one of {', '.join(FORMATS)})")
