"""The ``torchao`` format: the policy's int8 and fp8 layers as a torchao ``FqnToConfig``.

torchao quantizes by module name: ``quantize_(model, FqnToConfig({fqn: config}),
filter_fn=None)`` applies each config to the module of that fully qualified name. This format
writes ``torchao_config.py`` with that mapping for the layers a policy serves in int8, so a
torchao workflow (``torch.compile`` after it, a server that takes torchao models) quantizes
exactly those layers.

torchao configs quantize; they do not cast. A policy's fp16 and bf16 layers stay fp32 under
this file, and transformers' Conv1D layers (GPT-2), which torchao's int8 handlers do not
take, too: the warning and the file's header name them; the ``model`` format serves the
whole policy. The int8 method is the one the policy records (the search measured it), else
the device's default, as the served model takes it; its torchao config comes from the one
registry of quantizers (`autoprec.serving.quantizers`), as the fp8 layers' (``FP8_LAYERS``, with
``Float8WeightOnlyConfig`` or ``Float8DynamicActivationFloat8WeightConfig``, the method the
policy records, else the device's): ``torchao-weight-only`` is
``Int8WeightOnlyConfig``, ``torchao-dynamic`` ``Int8DynamicActivationInt8WeightConfig``, and
torch's own ``dynamic`` (the CPU default) has the latter as its nearest (it quantizes
activations per token, not per tensor, so its outputs differ slightly from the trial's).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

import autoprec.formats as formats
from autoprec.dtypes import LOW_PRECISION
from autoprec.exports._common import (
    ExportError,
    comment,
    docstring,
    names,
    note_lines,
    policy_label,
    require,
)
from autoprec.exports._owned import export_folder
from autoprec.exports.registry import FORMATS, ExportRequest
from autoprec.exports.yaml_file import export_code_beside_policy
from autoprec.policy import Policy
from autoprec.serving.fp8 import default_fp8_method
from autoprec.serving.quantizers import INT8_METHODS, QUANTIZERS, Quantizer, default_int8_method

CONFIG_FILE, _ = FILES = FORMATS["torchao"].files


def export_torchao(
    policy: Policy,
    out_dir: str | Path,
    model: nn.Module | None = None,
    int8: str | None = None,
    device: str = "cpu",
) -> list[Path]:
    """Write ``torchao_config.py`` (``config()`` and ``quantize(model)``) and
    ``policy.yaml``. ``int8`` is the method the search measured (default: the one the
    policy records, else ``device``'s default, as `autoprec.load_served_model` takes
    it), and the fp8 layers' the one the policy records; raises ExportError for a policy
    with no int8 or fp8 Linear layer."""
    require(model, "a model (the fp32 module, for its layer names)", "torchao")
    assert model is not None
    resolved = policy.resolve_served(model)
    made = {name: formats.get(dtype) for name, dtype in resolved.items()}
    int8_layers = [name for name, f in made.items() if f.records_quantization]
    linear = [name for name in int8_layers if isinstance(model.get_submodule(name), nn.Linear)]
    fp8_layers = [name for name, f in made.items() if f.records_conversion]
    chosen: Quantizer | None = None
    method = ""
    if int8_layers:
        method = int8 or policy.int8_method or default_int8_method(device) or ""
        if method not in QUANTIZERS:
            raise ExportError(
                f"format 'torchao': unknown int8 method {method!r} "
                f"(expected {', '.join(INT8_METHODS)})"
            )
        chosen = QUANTIZERS[method]
    fp8 = _fp8_method(policy, device) if fp8_layers else None
    if not linear and not fp8_layers:
        raise ExportError(
            "format 'torchao': the policy serves no Linear layer in int8 or fp8, and torchao's "
            "configs hold quantization only (use the 'model' format)"
        )
    folder = export_folder(out_dir, FILES)
    notes = _notes(resolved, int8_layers, linear, chosen)
    configs = [q for q in (chosen if linear else None, fp8) if q is not None]
    imported = sorted({"FqnToConfig", "quantize_", *(q.torchao_config for q in configs)})
    imported += sorted({name for q in configs for name in q.torchao_imports})
    said = []
    if chosen is not None and linear:
        said.append(f"{len(linear)} int8 layer(s) with {chosen.torchao_config}() ({method!r})")
    if fp8 is not None:
        call = f"{fp8.torchao_config}({fp8.torchao_args})"
        said.append(f"{len(fp8_layers)} fp8 layer(s) with {call} ({fp8.name!r})")
    int8_call = f"{chosen.torchao_config}()" if chosen is not None else ""
    fp8_call = f"{fp8.torchao_config}({fp8.torchao_args})" if fp8 is not None else ""
    lines = [
        *docstring(
            [
                f"autoprec {policy_label(policy)}: its quantized layers as a torchao FqnToConfig.",
                "",
                *comment(
                    f"quantize(model) quantizes them in place: {'; '.join(said)}. Every other "
                    "layer is left as it is.",
                    "",
                    "",
                ),
            ]
        ),
        "",
        *note_lines(notes),
        "",
        "from collections import OrderedDict",
        "",
        "import torch",
        f"from torchao.quantization import {', '.join(imported)}",
        "",
        "LAYERS = [",
        *(f"    {name!r}," for name in linear),
        "]",
        "FP8_LAYERS = [",
        *(f"    {name!r}," for name in fp8_layers),
        "]",
        "",
        "",
        "def config() -> FqnToConfig:",
        f"    layers = [(name, {int8_call}) for name in LAYERS]" if linear else "    layers = []",
        *([f"    layers += [(name, {fp8_call}) for name in FP8_LAYERS]"] if fp8_layers else []),
        "    return FqnToConfig(OrderedDict(layers))",
        "",
        "",
        "def quantize(model: torch.nn.Module) -> torch.nn.Module:",
        "    quantize_(model, config(), filter_fn=None)",
        "    return model",
        "",
    ]
    return export_code_beside_policy(policy, folder / CONFIG_FILE, lines, FILES, notes)


def _fp8_method(policy: Policy, device: str) -> Quantizer:
    """The fp8 method the policy records, else the device's default (as the served model
    takes it)."""
    method = policy.fp8_method or default_fp8_method(device)
    if method is None:
        raise ExportError(f"format 'torchao': no fp8 serving method for {device}")
    return QUANTIZERS[method]


def _notes(
    resolved: dict[str, str], int8_layers: list[str], linear: list[str], method: Quantizer | None
) -> list[str]:
    notes = []
    low = [name for name, dtype in resolved.items() if dtype in LOW_PRECISION]
    if low:
        notes.append(
            f"torchao configs quantize and do not cast: the policy's {len(low)} fp16/bf16 "
            f"layer(s) ({names(low)}) stay fp32 under this file; the 'model' format serves them "
            "as the policy says"
        )
    others = [name for name in int8_layers if name not in linear]
    if others:
        notes.append(
            f"torchao's int8 configs take nn.Linear only: the {len(others)} other int8 "
            f"layer(s) ({names(others)}, transformers' Conv1D) stay fp32 under this file; the "
            "'model' format converts them"
        )
    if method is not None and not method.torchao_twin:
        notes.append(
            f"int8 method {method.name!r} (torch's, per-tensor activations) has no torchao "
            f"twin: {method.torchao_config} (per-token activations) is the nearest, and its "
            "outputs differ slightly from the trial's"
        )
    return notes


def export(r: ExportRequest) -> list[Path]:
    return export_torchao(r.policy, r.out_dir, r.model, r.int8, str(r.device))
