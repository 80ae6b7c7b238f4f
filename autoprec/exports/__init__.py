"""Export a policy to the formats other tools read (`FORMATS`): ``export_policy`` picks one
by name; each format module's own function (``export_cann``, ...) takes its arguments. No
torch is imported here. A format that cannot say exactly what the policy says warns
(``ExportWarning``) and says it in its file's header; every value written into a generated
file is quoted, and no export overwrites a file it did not write (``.autoprec-export.json``).
The Ascend formats follow the documented formats only: neither torch_npu nor ATC ran here.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import autoprec.formats as formats
from autoprec.errors import ExportError, ExportWarning
from autoprec.exports.registry import FORMATS, ExportFormat, ExportRequest, load

if TYPE_CHECKING:
    from torch import nn

    from autoprec.policy import Policy

__all__ = [
    "FORMATS",
    "ExportError",
    "ExportFormat",
    "ExportRequest",
    "ExportWarning",
    "export_policy",
]


def __getattr__(name: str) -> Any:
    """A format module's own function (``export_cann``, ``trainer_optim``, ...)."""
    if name.startswith(("export_", "trainer_")):
        for module in dict.fromkeys(f.writer.partition(":")[0] for f in FORMATS.values()):
            found = getattr(importlib.import_module(module), name, None)
            if found is not None:
                return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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

    What each format needs of the rest (`ExportRequest`), and the device kind it takes
    when ``device`` is None, is declared in `FORMATS`: ``model`` is the fp32 module the
    policy was found for (trained, for ``model`` and ``cann``), ``example`` one input batch
    (``task.batch(raw)``), ``int8`` the int8 method the serving search measured, ``task``
    the task's name or file that ``model``'s ``load_model.py`` builds the model from.
    """
    from autoprec.devices import device_kind
    from autoprec.exports._owned import removed_if_refused

    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r}: unknown (expected one of {', '.join(FORMATS)})")
    found = FORMATS[fmt]
    if policy.serving_only and not found.serving_policies:
        raise ExportError(
            f"format {fmt!r}: the policy serves layers in {_served_in(policy)}, which {fmt} "
            "cannot express "
            f"(the int8 formats: {', '.join(f.name for f in FORMATS.values() if f.converted)})"
        )
    for kind, reason in found.refused_devices:
        if device is not None and device_kind(device) == kind:
            raise ExportError(f"format {fmt!r}: --device {device}: {load(reason)}")
    request = ExportRequest(policy, out_dir, model, example, device or found.device, int8, task)
    every_file = {name for f in FORMATS.values() for name in f.files}  # a refusal removes
    with removed_if_refused(out_dir, sorted(every_file)):
        return load(found.writer)(request)  # type: ignore[no-any-return]


def _served_in(policy: Policy) -> str:
    """What makes a policy serving-only: layers in a format only serving has (int8), and/or
    fp8 ones by a serving method."""
    found = [d for d in dict.fromkeys(policy.named_dtypes) if not formats.get(d).trains]
    if policy.fp8_method is not None and policy.names_fp8:
        found.append(f"fp8 ({policy.fp8_method})")
    return " and ".join(found)
