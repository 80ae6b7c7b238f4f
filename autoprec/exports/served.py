"""The ``model`` format: the model itself, served as the policy says.

What a serving search chose is a policy; what a deployment loads is a model. This format
writes both ways to it:

- ``program.pt2``: the converted model's logits path as a ``torch.export`` program (batch
  size free where the model allows, every other dimension as in the example): it takes
  the model's inputs by the model's names and returns its logits, computed as the MLflow
  model computes them (`autoprec.serving.logits_path`: no key/value cache, so that a
  decoder-only LM's ``DynamicCache`` does not stop the export; an encoder-decoder's decoder
  started from its start token). It loads with ``torch.export.load`` alone: no autoprec,
  no model class. Checked at export time against the converted model on the example;
  written only where it matches.
- ``served.pt``: the converted model's state dict, each layer's weights in its dtype (int8
  ones as torch or torchao hold them); it loads into a converted model with
  ``load_state_dict(..., assign=True)``.
- ``fp32.pt`` (the fp32 state dict, untouched) and ``policy.yaml``: what
  ``autoprec.load_served_model`` converts again, for any batch shape, and what a later
  search starts from.
- ``load_model.py``: both, as code (``exported()``, where a program was written, and
  ``rebuilt()``); every value in it quoted, the weights loaded with ``weights_only=True``.

torch's own dynamic int8 (``int8: dynamic``, the CPU default) holds its weights in packed
TorchScript objects that ``torch.export`` cannot trace; such a policy gets no program, and a
warning that says how to get one (a torchao int8 method) or to rebuild it from the weights.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.files import atomic_file
from autoprec._util.structures import map_tensors, tensors, to_device
from autoprec.devices import get_backend
from autoprec.errors import first_line
from autoprec.exports._common import (
    ExportError,
    comment,
    docstring,
    example_inputs,
    note_lines,
    policy_label,
    require,
    warn,
    write,
)
from autoprec.exports._owned import export_folder, record_written
from autoprec.exports.registry import FORMATS, ExportRequest
from autoprec.exports.yaml_file import POLICY_FILE, export_yaml
from autoprec.policy import Policy
from autoprec.serving.conversion import has_torch_dynamic_int8
from autoprec.serving.logits_path import LogitsPath

PROGRAM_FILE, WEIGHTS_FILE, SERVED_FILE, _, SNIPPET_FILE = FILES = FORMATS["model"].files
MAX_DEVIATION = 1e-3  # the program against the converted model, relative to its outputs' scale


def export_model(
    policy: Policy,
    out_dir: str | Path,
    model: nn.Module | None = None,
    example: Any = None,
    device: str = "cpu",
    int8: str | None = None,
    task: str | None = None,
) -> list[Path]:
    """Write ``program.pt2`` (where ``torch.export`` takes the converted model),
    ``served.pt``, ``fp32.pt``, ``policy.yaml`` and ``load_model.py`` for serving ``model``
    (fp32, trained) on ``device`` as ``policy`` says, int8 layers by ``int8`` (default: the
    device's method). ``example`` is one input batch; without one, no program is written.
    ``task`` (a task's name or file) lets ``load_model.py`` build the model itself."""
    from autoprec.serving.conversion import convert_policy

    require(model, "a model (the trained fp32 module)", "model")
    assert model is not None
    folder = export_folder(out_dir, FILES)
    backend = get_backend(device)
    converted = convert_policy(model, policy, backend, int8)
    notes: list[str] = []
    note: str | None = None
    written = [
        *export_yaml(policy, folder),
        _save(model.state_dict(), folder / WEIGHTS_FILE),
        _save(converted.state_dict(), folder / SERVED_FILE),
    ]
    if example is None:
        notes.append(f"no example input: no {PROGRAM_FILE} (rebuilt() converts the weights)")
    else:
        inputs = to_device(example_inputs(example, "model"), backend.device)
        program, note = exported_program(LogitsPath(converted), inputs)
        if program is None:
            notes.append(f"no {PROGRAM_FILE}: {note}; rebuilt() converts the weights instead")
        else:
            written.append(_save_program(program, folder / PROGRAM_FILE))
            if note:
                notes.append(note)
    method = _int8_method(policy, model, backend.kind, int8)
    has_program = PROGRAM_FILE in {p.name for p in written}
    call = _call_line(example_inputs(example, "model"), note is None) if has_program else None
    text = snippet(policy, task, backend.kind, method, call)
    written.append(write(folder / SNIPPET_FILE, "\n".join([*note_lines(notes), text])))
    warn(notes)
    return record_written(folder, written, FILES)


def exported_program(
    converted: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]
) -> tuple[torch.export.ExportedProgram | None, str | None]:
    """``converted`` through ``torch.export`` with its batch dimension free (fixed where the
    model needs it fixed), checked against ``converted`` on ``inputs``; None and the reason
    where it does not export or does not match. A program with a fixed batch comes with a
    note saying so."""
    args, kwargs = inputs
    if has_torch_dynamic_int8(converted):
        return None, (
            "torch's dynamic int8 (int8: dynamic) packs its weights in TorchScript objects "
            "torch.export cannot trace; a torchao int8 method (--int8 torchao-dynamic or "
            "torchao-weight-only) exports"
        )
    note = None
    try:
        program = _export(converted, args, kwargs, free_batch=True)
    except Exception:  # torch.export's failures have no common type
        note = "the batch size is fixed to the example's: the model did not export with it free"
        try:
            program = _export(converted, args, kwargs, free_batch=False)
        except Exception as error:  # torch.export's failures have no common type
            return None, f"torch.export failed ({type(error).__name__}: {first_line(error, 200)})"
    try:
        deviation = _deviation(program, converted, args, kwargs)
    except Exception as error:  # the user's model, run as exported
        return None, (
            f"the exported program fails on the example ({type(error).__name__}: "
            f"{first_line(error, 200)})"
        )
    if deviation is None or deviation > MAX_DEVIATION:
        return None, f"the exported program's outputs differ from the model's ({deviation})"
    return program, note


def _export(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], free_batch: bool
) -> torch.export.ExportedProgram:
    shapes = None
    if free_batch:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        shapes = {
            name: map_tensors(lambda t: {0: torch.export.Dim.AUTO} if t.dim() else None, value)
            for name, value in bound.items()
        }
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes are not the user's concern
        return torch.export.export(model, args, kwargs, dynamic_shapes=shapes)


def _deviation(
    program: torch.export.ExportedProgram,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> float | None:
    """The largest difference between the program's and the model's floating outputs,
    relative to the outputs' largest magnitude; None where they have different tensors."""
    with torch.no_grad():
        ours = [t for t in tensors(program.module()(*args, **kwargs)) if t.is_floating_point()]
        theirs = [t for t in tensors(model(*args, **kwargs)) if t.is_floating_point()]
    if [t.shape for t in ours] != [t.shape for t in theirs]:
        return None
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        if b.numel():
            scale = max(float(b.float().abs().max()), 1.0)
            worst = max(worst, float((a.float() - b.float()).abs().max()) / scale)
    return worst


def _int8_method(policy: Policy, model: nn.Module, kind: str, int8: str | None) -> str | None:
    from autoprec.serving.conversion import default_int8_method

    served = [formats.get(d) for d in set(policy.resolve_served(model).values())]
    if not any(f.records_quantization for f in served):  # int8
        return None
    return int8 or policy.int8_method or default_int8_method(kind)


def _save(value: Any, path: Path) -> Path:
    try:
        with atomic_file(path) as out:
            torch.save(value, out)
    except OSError as error:  # a WriteError: its message names the file
        raise ExportError(str(error)) from None
    return path


def _save_program(program: torch.export.ExportedProgram, path: Path) -> Path:
    try:
        with atomic_file(path) as out:
            torch.export.save(program, out)
    except OSError as error:
        raise ExportError(str(error)) from None
    return path


def _call_line(inputs: tuple[tuple[Any, ...], dict[str, Any]], free_batch: bool) -> str:
    """How the program is called: its inputs, in order, with their dtypes and shapes."""
    args, kwargs = inputs

    def shape(value: Any) -> str:
        found = list(tensors(value))
        if len(found) != 1:
            return type(value).__name__
        t = found[0]
        dims = [str(d) for d in t.shape]
        if dims and free_batch:
            dims[0] = "batch"
        return f"{str(t.dtype).removeprefix('torch.')} [{', '.join(dims)}]"

    parts = [f"positional {shape(a)}" for a in args]
    parts += [f"{name}={shape(value)}" for name, value in kwargs.items()]
    return "Inputs: " + "; ".join(parts) + "."


def snippet(
    policy: Policy, task: str | None, device: str, int8: str | None, call: str | None
) -> str:
    """``load_model.py``: ``exported()`` where a program was written (called as ``call``
    says; None: no program, and no ``exported()``) and ``rebuilt()`` (the weights converted
    again by autoprec). Every value in it is quoted; the weights load without unpickling."""
    build = (
        f"model = load_task({task!r}).model()"
        if task
        else 'raise ValueError("rebuilt(model): pass an instance of your fp32 model")'
    )
    program_doc = (
        f"exported(): the converted model from {PROGRAM_FILE}; torch alone loads it (torchao "
        f"too, for torchao int8 layers). {call} rebuilt(): the same model, converted again "
        f"from {WEIGHTS_FILE} by autoprec; it takes what the original model takes."
        if call
        else f"No {PROGRAM_FILE} was written (see the NOTE above): use rebuilt()."
    )
    exported = [
        "def exported() -> torch.nn.Module:",
        f"    return torch.export.load(HERE / {PROGRAM_FILE!r}).module()",
        "",
        "",
    ]
    head = f"Serve the model as autoprec {policy_label(policy)} says, on {device!r}."
    lines = [
        *docstring([head, "", *comment(program_doc, "", "")]),
        "",
        "from pathlib import Path",
        "",
        "import torch",
        "",
        "HERE = Path(__file__).resolve().parent",
        "",
        "",
        *(exported if call else []),
        "def rebuilt(model: torch.nn.Module | None = None) -> torch.nn.Module:",
        f'    """The fp32 weights ({WEIGHTS_FILE}) converted as {POLICY_FILE} says; model: an',
        '    instance of the fp32 model class, its weights replaced by the saved ones."""',
        "    import autoprec",
        *(["    from autoprec.tasks import load_task"] if task else []),
        "",
        "    if model is None:",
        f"        {build}",
        f"    weights = torch.load(HERE / {WEIGHTS_FILE!r}, map_location='cpu', weights_only=True)",
        "    model.load_state_dict(weights)",
        f"    policy = autoprec.load_policy(HERE / {POLICY_FILE!r})",
        "    return autoprec.load_served_model(",
        f"        model, policy, device={device!r}, int8={int8!r}",
        "    )",
        "",
    ]
    return "\n".join(lines)


def export(r: ExportRequest) -> list[Path]:
    return export_model(r.policy, r.out_dir, r.model, r.example, str(r.device), r.int8, r.task)
