"""The ``transformers`` format: a ``_keep_in_fp32_modules_strict`` list and a loading snippet,
so that ``from_pretrained(..., dtype=torch.float16)`` (or bf16) loads the policy's fp32 layers
in fp32 and every other layer in the low dtype.

transformers matches each entry against every state-dict key (parameter and buffer names):
5.x as a regular expression searched anywhere in the key (``core_model_loading``'s
``build_glob_alternation``, ``*`` as ``.*``), 4.x with the strict list (4.54 and later) as
whole dotted components (``(^|\\.)entry($|\\.)``). Each entry here is the shortest dotted tail
of a module's name that selects exactly the fp32 layers' keys under both rules, checked
against the model's own keys. The strict list is used because the plain one applies to fp16
loads only.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from torch import nn

import autoprec.formats as formats
from autoprec.exports._common import (
    ExportError,
    comment,
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

LIST_FILE, SNIPPET_FILE = FILES = FORMATS["transformers"].files
ATTRIBUTE = "_keep_in_fp32_modules_strict"
TORCH_DTYPES = {"fp16": "torch.float16", "bf16": "torch.bfloat16", None: "torch.float32"}


def matches(entry: str, key: str) -> bool:
    """Whether transformers keeps ``key`` in fp32 for ``entry``, under either rule (see the
    module docstring): an entry must be exact under both."""
    searched = re.search(entry.replace("*", ".*"), key) is not None
    components = re.search(rf"(^|\.){entry}($|\.)", key) is not None
    return searched or components


def _tails(module: str) -> Iterable[str]:
    """``query``, ``self.query``, ... ``bert.encoder.layer.1.attention.self.query``, leaving
    out tails that start with an index (``1.attention``), which read badly."""
    parts = module.split(".")
    starts = [i for i in range(len(parts) - 1, -1, -1) if not parts[i].isnumeric()] or [0]
    return (".".join(parts[i:]) for i in starts)


def keep_entries(keys: Iterable[str], fp32_layers: Iterable[str]) -> list[str]:
    """The shortest entries that select exactly the state-dict keys of ``fp32_layers``.

    One per largest module whose keys are all fp32 (``classifier`` rather than
    ``classifier.weight`` and ``classifier.bias``), the shortest dotted tail of its name that
    selects no other key. Where none does (transformers 5.x searches anywhere, so ``layer.1``
    also selects ``layer.10``), its children are listed instead (``layer.1.attention``,
    ``layer.1.output``); a layer whose every tail is part of another name (``head`` beside
    ``lm_head``) gets a regular expression of whole components."""
    keys = list(keys)
    wanted = keys_of(keys, fp32_layers)
    under: dict[str, set[str]] = defaultdict(set)
    for key in keys:
        parts = key.split(".")[:-1]
        for depth in range(1, len(parts) + 1):
            under[".".join(parts[:depth])].add(key)

    def exact(entry: str) -> bool:
        return selected(keys, [entry]) <= wanted

    def entries_for(module: str) -> list[str]:
        plain = next((tail for tail in _tails(module) if exact(tail)), None)
        if plain is not None:
            return [plain]
        children = [m for m in under if m.rpartition(".")[0] == module]
        if children and not any(key.rpartition(".")[0] == module for key in under[module]):
            return [entry for child in children for entry in entries_for(child)]
        tails = [bounded(tail) for tail in _tails(module)]
        return [next((tail for tail in tails if exact(tail)), bounded(module))]

    whole = {m for m, below in under.items() if below <= wanted}
    top = [m for m in under if m in whole and not any(a in whole for a in _ancestors(m))]
    entries: list[str] = []
    covered: set[str] = set()
    for module in top:
        if under[module] <= covered:
            continue  # an earlier entry (``LayerNorm``) already selects it
        for entry in entries_for(module):
            entries.append(entry)
            covered |= selected(keys, [entry])
    return entries


def bounded(tail: str) -> str:
    """``tail`` as a regular expression that matches whole dotted components only, under both
    rules: for the rare model where a plain name is also part of another (``head`` in
    ``head_extra`` or ``lm_head``)."""
    return rf"(?<![^.]){re.escape(tail)}(?=\.)"


def _ancestors(module: str) -> Iterable[str]:
    parts = module.split(".")
    return (".".join(parts[:depth]) for depth in range(1, len(parts)))


def keys_of(keys: Iterable[str], layers: Iterable[str]) -> set[str]:
    """The state-dict keys (parameters and buffers) that belong to these layers."""
    layers = set(layers)
    return {key for key in keys if key.rpartition(".")[0] in layers}


def selected(keys: Iterable[str], entries: Iterable[str]) -> set[str]:
    """The keys that transformers keeps in fp32 for these entries."""
    entries = list(entries)
    return {key for key in keys if any(matches(entry, key) for entry in entries)}


def _import_line(model: nn.Module) -> str:
    """Where the snippet imports the model's class from; its names are code there, so they
    must be Python names."""
    cls = type(model)
    if not all(part.isidentifier() for part in (cls.__name__, *cls.__module__.split("."))):
        raise ExportError(
            f"format 'transformers': {cls.__module__}.{cls.__name__!r} is not an importable "
            "class name"
        )
    try:
        import transformers

        if getattr(transformers, cls.__name__, None) is cls:
            return f"from transformers import {cls.__name__}"
    except ImportError:
        pass
    return f"from {cls.__module__} import {cls.__name__}"


def export_transformers(
    policy: Policy,
    out_dir: str | Path,
    model: nn.Module | None = None,
    device: str = "npu",
    checkpoint: str = "path/to/checkpoint",
) -> list[Path]:
    """Write ``keep_in_fp32_modules.json`` (the list) and ``load_transformers.py`` (set the
    list on the model's class, then ``from_pretrained(checkpoint, dtype=...)``). The fp32
    layers are those that run in fp32 on ``device`` (``Policy.resolve``: on cuda and npu that
    includes LayerNorm, which autocast runs in fp32)."""
    require(model, "a model (a transformers PreTrainedModel, for its layer names)", "transformers")
    assert model is not None
    if "PreTrainedModel" not in {cls.__name__ for cls in type(model).__mro__}:
        raise ExportError(
            f"format 'transformers': {type(model).__name__} is not a transformers "
            "PreTrainedModel (from_pretrained reads the keep lists)"
        )
    folder = export_folder(out_dir, FILES)
    cls = type(model).__name__
    plan = one_low_dtype(policy, model, device, "from_pretrained")
    dtype = TORCH_DTYPES[plan.low]
    notes = list(plan.notes)
    fp32_layers = plan.fp32_layers if plan.low is not None else []
    keys = list(model.state_dict())
    entries = keep_entries(keys, fp32_layers)
    wanted = keys_of(keys, fp32_layers)
    if selected(keys, entries) != wanted:
        notes.append(
            "no list of module names selects exactly the fp32 layers' parameters in this "
            f"model: {len(selected(keys, entries) ^ wanted)} key(s) load in the other dtype"
        )
    own = sorted(set(getattr(model, ATTRIBUTE, None) or ()) - set(entries))
    plain = sorted(getattr(model, "_keep_in_fp32_modules", None) or ())
    if own or (plain and plan.low is not None and formats.get(plan.low).torch_name == "float16"):
        notes.append(
            f"{cls} has keep lists of its own ({', '.join([*own, *plain])}): "
            "from_pretrained keeps those layers in fp32 too; the strict ones stay in the list "
            "below"
        )
    shared = _tied_across_dtypes(model, plan.dtypes)
    if shared:
        notes.append(
            f"tied weights shared by layers of different dtypes load in one dtype: {shared}"
        )
    listed = [*entries, *own]
    if plan.low is None:
        what = "every layer runs in fp32: it loads in torch.float32 and needs no keep list."
    else:
        what = (
            f"the {len(fp32_layers)} layer(s) that ran in fp32 on {device} "
            f"({names(fp32_layers)}) load in fp32, every other layer in {dtype}."
        )
    lines = [
        *comment(f"autoprec {policy_label(policy)} for {cls}.from_pretrained: {what}"),
        *comment(
            f"{ATTRIBUTE} (transformers 4.54 and later) applies to fp16 and bf16 loads alike; "
            "each entry selects exactly those layers' parameters, checked against the model."
        ),
        *comment(
            "The loaded model mixes dtypes: run it under the policy, which casts each layer's "
            "inputs (prec = policy.apply(model, device=...); with prec.autocast(): ...)."
        ),
        *note_lines(notes),
        "import torch",
        _import_line(model),
        "",
        f"{cls}.{ATTRIBUTE} = [",
        *(f"    {entry!r}," for entry in listed),
        "]",
        f"model = {cls}.from_pretrained({checkpoint!r}, dtype={dtype})",
    ]
    list_path = write(folder / LIST_FILE, json.dumps({ATTRIBUTE: listed}, indent=2) + "\n")
    snippet = write(folder / SNIPPET_FILE, "\n".join(lines) + "\n")
    warn(notes)
    return record_written(folder, [list_path, snippet], FILES)


def _tied_across_dtypes(model: nn.Module, dtypes: dict[str, str]) -> str:
    owners: dict[int, list[str]] = defaultdict(list)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owners[id(parameter)].append(name.rpartition(".")[0])
    tied = [
        " = ".join(layers)
        for layers in owners.values()
        if len({dtypes.get(layer) for layer in layers} - {None}) > 1
    ]
    return "; ".join(tied)


def export(r: ExportRequest) -> list[Path]:
    return export_transformers(r.policy, r.out_dir, r.model, str(r.device))
