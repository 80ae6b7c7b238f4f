"""The ``cann`` format: an ONNX model, a keep_dtype list and the ATC command that compiles them
to an offline model for Ascend inference.

ATC names no module, only ONNX nodes, so the policy's fp32 layers are mapped to node names.
torch's TorchScript-based exporter (``dynamo=False``) names each node after the modules it was
called in (``/layer1/layer1.0/conv1/Conv``); the default dynamo exporter names them
``node_Conv_18`` and keeps the module path only in metadata, and its optimiser folds BatchNorm
into the Conv before it. So the TorchScript exporter is used, in PRESERVE mode on a model in
eval mode, which leaves BatchNorm a node of its own. Written from CANN's documented ATC options
(shared/NPU.md); ATC was not run here.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.files import atomic_file
from autoprec.errors import WriteError
from autoprec.exports._common import (
    ExportError,
    OneLowDtype,
    comment,
    example_inputs,
    names,
    note_lines,
    one_low_dtype,
    policy_label,
    require,
    warn,
    write,
)
from autoprec.exports._owned import export_folder, record_written
from autoprec.exports.registry import FORMATS, ExportRequest
from autoprec.policy import Policy
from autoprec.serving.logits_path import serving_defaults

MODEL_FILE, KEEP_FILE, COMMAND_FILE = FILES = FORMATS["cann"].files
# The oldest opset that keeps LayerNormalization one node (one name to keep); the newer ones
# torch defaults to add nothing these models need.
OPSET = 17
_REPEATED_CALL = re.compile(r"_\d+$")  # a scope entered again: relu, relu_1, relu_2
# A chip name (Ascend910B3): written into the shell script, so nothing a shell expands.
_SOC_VERSION = re.compile(r"[A-Za-z0-9_.-]{1,64}")

MODE_REASONS = {
    "origin": (
        "every layer runs in fp32, so the model keeps its own dtypes; keep_dtype is ignored "
        "under origin and is not passed."
    ),
    "mixed_float16": (
        "the policy runs layers in fp16. The mixed mode runs ATC's white list (matmul, conv) "
        "in fp16 and keeps its black list (softmax, reductions, exp, log) in fp32, as torch's "
        "autocast did in training; keep_dtype.cfg pins the layers the policy runs in fp32, "
        "which the white list would reduce. (fp16 would reduce every op not listed, softmax "
        "and norms included, which autocast never did.)"
    ),
    "mixed_bfloat16": (
        "the policy runs layers in bf16: the same mixed mode in bf16 (ATC's white list in "
        "bf16, its black list in fp32; 910B and later), with keep_dtype.cfg pinning the "
        "layers the policy runs in fp32."
    ),
}


def precision_mode_v2(low: str | None) -> str:
    """ATC's ``--precision_mode_v2`` for a model whose low-precision layers are ``low``."""
    return {None: "origin", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}[low]


def export_onnx(
    model: nn.Module, example: Any, path: str | Path, opset_version: int = OPSET
) -> Path:
    """Export ``model`` in fp32 with the TorchScript-based exporter, whose node names carry
    module paths, leaving BatchNorm unfolded (see the module docstring)."""
    args, kwargs = example_inputs(example, "cann")
    kwargs = {**kwargs, **serving_defaults(model, args, kwargs)}  # no cache; T5's decoder
    path = Path(path)
    was_training = model.training
    model.eval()
    try:
        with atomic_file(path) as out, warnings.catch_warnings():
            # Chosen on purpose (the node names), and its tracer's notes are not ours to show.
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model,
                args,
                out,  # type: ignore[arg-type]  # the TorchScript exporter takes a file object
                kwargs=kwargs or None,
                dynamo=False,
                opset_version=opset_version,
                training=torch.onnx.TrainingMode.PRESERVE,
            )
    except WriteError as error:  # its message names the file
        raise ExportError(str(error)) from None
    except Exception as error:  # the ONNX exporter's failures have no common type
        message = (str(error).splitlines() or [""])[0][:200]
        raise ExportError(
            f"format 'cann': the ONNX exporter failed on {type(model).__name__} "
            f"({type(error).__name__}: {message})"
        ) from None
    finally:
        model.train(was_training)
    return path


def _unqualified(name: str) -> str:
    """The scope name the TorchScript exporter gives a module: its name from the last
    non-numeric part on (``bert.encoder.layer.0`` -> ``layer.0``, ``layer1.0`` ->
    ``layer1.0``), as torch.onnx's ``_setup_trace_module_map`` does."""
    parts = name.split(".")
    for index in range(len(parts) - 1, -1, -1):
        if not parts[index].isnumeric():
            return ".".join(parts[index:])
    return name


class NodeModules:
    """Maps ONNX node names of the TorchScript exporter to module paths.

    A node's name is its scopes, one per module call it sits in, then the op:
    ``/bert/encoder/layer.0/attention/self/query/MatMul``. A module that is not called (a
    ModuleList) has no scope, so each scope is looked up among the descendants of the module
    found so far, nearest first."""

    def __init__(self, model: nn.Module) -> None:
        self.by_scope: dict[str, list[str]] = defaultdict(list)
        for name, _ in model.named_modules():
            if name:
                self.by_scope[_unqualified(name)].append(name)

    def _child(self, path: str, scope: str) -> str | None:
        below = [
            name for name in self.by_scope.get(scope, ()) if not path or name.startswith(path + ".")
        ]
        return min(below, key=lambda name: name.count("."), default=None)

    def module_of(self, node_name: str) -> str:
        """The module a node was created in ("" for the model itself)."""
        path = ""
        for scope in node_name.split("/")[1:-1]:
            child = self._child(path, scope) or self._child(path, _REPEATED_CALL.sub("", scope))
            if child is None:
                break
            path = child
        return path


def fp32_scopes(layer_dtypes: Mapping[str, str]) -> Callable[[str], bool]:
    """Whether a node created in a module runs in fp32: the module's layers (with
    parameters, as ``Policy.resolve`` lists them) are all fp32, as autoprec then gives the
    whole subtree one fp32 region. A parameter-free module (ReLU, pooling) counts with the
    nearest module above it that has layers."""
    below: dict[str, set[str]] = defaultdict(set)
    for layer, dtype in layer_dtypes.items():
        parts = layer.split(".") if layer else []
        for depth in range(len(parts) + 1):
            below[".".join(parts[:depth])].add(dtype)

    def runs_in_fp32(module: str) -> bool:
        while module and module not in below:
            module = module.rpartition(".")[0]
        dtypes = below.get(module, set())
        return bool(dtypes) and all(formats.get(d).reference for d in dtypes)

    return runs_in_fp32


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ExportError(
            "format 'cann': needs the onnx package (pip install 'autoprec[onnx]')"
        ) from None
    return onnx


def keep_list(graph: Any, model: nn.Module, plan: OneLowDtype) -> tuple[list[str], list[str]]:
    """The node names of the exported graph (an ``onnx.GraphProto``) that run in fp32
    (Constant nodes left out: they compute nothing), and notes on kept layers ATC could
    lose."""
    modules = NodeModules(model)
    runs_in_fp32 = fp32_scopes(plan.dtypes)
    node_module = {node.name: modules.module_of(node.name) for node in graph.node}
    kept = [
        node.name
        for node in graph.node
        if node.op_type != "Constant" and runs_in_fp32(node_module[node.name])
    ]
    notes = []
    with_nodes = set(node_module.values())
    lost = [layer for layer in plan.fp32_layers if layer not in with_nodes]
    if lost and plan.low is not None:
        notes.append(
            f"{len(lost)} fp32 layer(s) have no node of their own in the ONNX graph "
            f"({names(lost)}; not called in forward, or merged by the exporter): they run in "
            "the dtype of whatever computes them"
        )
    producer = {output: node for node in graph.node for output in node.output}
    kept_set = set(kept)
    fusable = [
        f"{node.name} after {producer[node.input[0]].name}"
        for node in graph.node
        if node.op_type == "BatchNormalization"
        and node.name in kept_set
        and node.input[0] in producer
        and producer[node.input[0]].op_type == "Conv"
        and producer[node.input[0]].name not in kept_set
    ]
    if fusable and plan.low is not None:
        notes.append(
            f"ATC may fuse a kept BatchNorm into the {plan.low} Conv before it and drop its "
            f"keep_dtype entry silently ({names(fusable, 4)}); keep such a Conv and its "
            "BatchNorm in one dtype to be sure"
        )
    return kept, notes


def _inputs_line(graph: Any) -> str:
    onnx = _onnx()
    initializers = {tensor.name for tensor in graph.initializer}
    shown = []
    for value in graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dtype = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
        dims = ",".join(str(d.dim_value or d.dim_param or "?") for d in tensor.shape.dim)
        shown.append(f"{value.name} {dtype}[{dims}]")
    return ", ".join(shown)


def export_cann(
    policy: Policy,
    out_dir: str | Path,
    model: nn.Module | None = None,
    example: Any = None,
    device: str = "npu",
    soc_version: str | None = None,
    opset_version: int = OPSET,
) -> list[Path]:
    """Write ``model.onnx``, ``keep_dtype.cfg`` (the node names of the layers that run in
    fp32 on ``device``, one a line) and ``atc_command.sh`` (the ATC command with the matching
    ``--precision_mode_v2``). ``example`` is one input batch; its shapes become the model's.
    ``soc_version`` (e.g. ``Ascend910B3``) is the script's default for ``$SOC_VERSION``."""
    require(model, "a model (the fp32 module to export)", "cann")
    require(example, "an example input (e.g. the task's first training batch)", "cann")
    if soc_version is not None and not _SOC_VERSION.fullmatch(soc_version):
        raise ExportError(
            f"format 'cann': soc_version {soc_version[:40]!r} is not a chip name (letters, "
            "digits, _ . -; e.g. Ascend910B3)"
        )
    assert model is not None
    folder = export_folder(out_dir, FILES)
    plan = one_low_dtype(policy, model, device, "ATC")
    onnx = _onnx()
    onnx_path = export_onnx(model, example, folder / MODEL_FILE, opset_version)
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    kept, keep_notes = keep_list(graph, model, plan)
    notes = [*plan.notes, *keep_notes]
    if policy.hf32 is not None:
        notes.append(
            f"the policy's hf32 switch ({policy.hf32}) is a torch_npu setting and is not part "
            "of this command: ATC's own defaults apply"
        )
    mode = precision_mode_v2(plan.low)
    keep_path = write(folder / KEEP_FILE, "".join(f"{name}\n" for name in kept))
    options = [
        f"--model={MODEL_FILE}",
        "--framework=5",
        "--output=model",
        '--soc_version="$SOC_VERSION"',
        f"--precision_mode_v2={mode}",
    ]
    if mode != "origin" and kept:
        options.append(f"--keep_dtype={KEEP_FILE}")
    soc = (
        f'"${{SOC_VERSION:-{soc_version}}}"'
        if soc_version
        else '"${SOC_VERSION:?set SOC_VERSION to your chip, e.g. Ascend910B3 (npu-smi info)}"'
    )
    fp32_layers = plan.fp32_layers
    lines = [
        "#!/usr/bin/env bash",
        *comment(
            f"autoprec {policy_label(policy)}: compile {MODEL_FILE} to an offline "
            "model for Ascend inference with ATC (CANN). Written from CANN's documented ATC "
            "options; ATC was not run here (no Ascend toolkit)."
        ),
        "#",
        *comment(f"--precision_mode_v2={mode}: {MODE_REASONS[mode]}"),
        *comment(
            f"{KEEP_FILE}: {len(kept)} ONNX node(s) of the {len(fp32_layers)} layer(s) that run "
            f"in fp32 on {device} ({names(fp32_layers)}), and of the modules around them whose "
            "layers are all fp32."
        ),
        *comment(f"Inputs, with the example's static shapes: {_inputs_line(graph)}."),
        *comment(
            "If accuracy drops under a mixed mode (a reported case: Ascend/pytorch#125), "
            "compare with --precision_mode_v2=origin."
        ),
        *note_lines(notes),
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f"SOC_VERSION={soc}",
        "atc " + " \\\n    ".join(options),
    ]
    command_path = write(folder / COMMAND_FILE, "\n".join(lines) + "\n")
    command_path.chmod(0o755)
    warn(notes)
    return record_written(folder, [onnx_path, keep_path, command_path], FILES)


def export(r: ExportRequest) -> list[Path]:
    return export_cann(r.policy, r.out_dir, r.model, r.example, str(r.device))
