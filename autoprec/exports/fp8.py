"""The ``fp8`` format: a policy's fp8 Linear layers in the forms float8 training tools take.

A training policy with fp8 layers is run elsewhere by a tool that converts Linear layers to
torchao's ``Float8Linear`` itself. This format writes each such tool's settings for exactly
the policy's fp8 layers (the layers ``Policy.plan`` converts on the target device, CUDA by
default), with the policy's recipe (``quantization.fp8``):

- ``float8_torchtitan.toml``: torchtitan's ``filter_fqns``, which lists the Linear layers NOT to
  convert (torchtitan converts every ``nn.Linear`` whose dimensions are multiples of 16 unless
  an entry is a substring of its name), so the list names every other such layer, in as few
  entries as exactness allows; the command line beside it;
- ``float8_torchao.py``: ``convert_to_float8_training`` with a ``module_filter_fn`` of the
  layers' names;
- ``float8_accelerate.py``: accelerate's ``AORecipeKwargs`` with that filter as its
  ``module_filter_func``, and ``Accelerator(mixed_precision="fp8", ...)``;
- ``policy.yaml``, for the rest of the policy (``autoprec.load_policy``).

One format, not three: the three files say one thing (one set of layers, one recipe), a user
rarely knows beforehand which tool a colleague runs, and each file is a few lines.

These tools run every other layer in one dtype (bf16 under accelerate's fp8; torchtitan's
``training.mixed_precision_param``; the user's autocast around torchao's conversion). Where
the policy's other layers are not uniform in the dtype the tool runs, a note says which run
otherwise. Every layer name is quoted (``repr`` in Python, TOML basic strings, ``shlex`` on the
command line), so no name a policy or model holds can run as code.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

import autoprec.formats as formats
from autoprec.exports._common import (
    ExportError,
    comment,
    docstring,
    names,
    note_lines,
    policy_label,
    require,
    warn,
    write,
)
from autoprec.exports._owned import export_folder, record_written
from autoprec.exports.registry import FORMATS, ExportRequest
from autoprec.exports.yaml_file import export_yaml
from autoprec.formats.fp8 import FP8_DIM_MULTIPLE
from autoprec.policy import Policy

TORCHTITAN_FILE, TORCHAO_FILE, ACCELERATE_FILE, _ = FILES = FORMATS["fp8"].files
# A filter_fqns entry torchtitan reads as a switch (its size heuristic), never as a name.
TORCHTITAN_AUTO_FILTER = "auto_filter_small_kn"
# The dtype each tool runs the layers it does not convert in, as the policy names them.
_TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}
_TORCHTITAN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class TorchtitanFilter:
    """torchtitan's ``filter_fqns`` for a set of fp8 layers: ``entries``, and the fp8 layers
    they also exclude (``widened``: an fp8 layer's name holds the whole name of a layer that
    must not convert, as ``fc2`` holds ``fc``), which then train in high precision."""

    entries: tuple[str, ...]
    widened: tuple[str, ...]


def export_fp8(
    policy: Policy,
    out_dir: str | Path,
    model: nn.Module | None = None,
    device: str = "cuda",
) -> list[Path]:
    """Write the torchtitan, torchao and accelerate settings for the policy's fp8 layers on
    ``model`` (as ``device``'s kind plans them), and ``policy.yaml``; raises ExportError
    for a policy with no fp8 layer there, before anything is written."""
    require(model, "a model (the fp32 module, for its layer names)", "fp8")
    assert model is not None
    plan = policy.plan(model, device)
    layers = plan.fp8_layers
    if not layers:
        raise ExportError(
            "format 'fp8': the policy puts no layer in fp8, so it does not apply "
            "(the training formats: yaml, torch-npu, cann, transformers)"
        )
    recipe = policy.fp8_recipe
    others = _other_dtypes(plan.leaf_dtypes, model, device, layers)
    found = torchtitan_filter(model, layers)
    folder = export_folder(out_dir, FILES)
    label = policy_label(policy)
    rest = others.rest
    torchtitan_runs = rest if rest is not None and formats.get(rest).reference else "bf16"
    torchtitan_notes = _rest_notes(
        others, torchtitan_runs, "torchtitan", "training.mixed_precision_param"
    )
    if found.widened:
        torchtitan_notes.insert(
            0,
            "torchtitan's filter_fqns excludes by substring, and the name of a layer the "
            f"policy keeps out of fp8 is part of the name of {len(found.widened)} fp8 "
            f"layer(s) ({_quoted(found.widened)}): under this file they train in "
            "high precision too (wider, never less accurate); the torchao and accelerate "
            "files convert them",
        )
    torchao_runs = others.rest or others.nearest
    torchao_notes = _rest_notes(others, torchao_runs, "torchao", "the autocast around it")
    accelerate_notes = _rest_notes(others, "bf16", "accelerate", 'mixed_precision="fp8"')
    paths = [
        write(
            folder / TORCHTITAN_FILE,
            _torchtitan(label, layers, recipe, found, others.rest, torchtitan_notes),
        ),
        write(folder / TORCHAO_FILE, _torchao(label, layers, recipe, torchao_runs, torchao_notes)),
        write(folder / ACCELERATE_FILE, _accelerate(label, layers, recipe, accelerate_notes)),
    ]
    warn(dict.fromkeys([*torchtitan_notes, *torchao_notes, *accelerate_notes]))
    return record_written(folder, [*paths, *export_yaml(policy, folder)], FILES)


def torchtitan_filter(model: nn.Module, fp8_layers: Iterable[str]) -> TorchtitanFilter:
    """The fewest ``filter_fqns`` entries (greedily) under which torchtitan's rule converts
    exactly ``fp8_layers``: every other Linear it would convert is excluded by an entry
    that is a substring of no fp8 layer's name. Candidates are runs of whole dotted
    components (``attention.wk``, ``output``); among entries excluding as many layers, the
    longer (more specific) is taken. Raises ExportError where a layer to exclude is called
    ``auto_filter_small_kn``, which torchtitan reads as a switch."""
    fp8 = set(fp8_layers)
    to_exclude = [name for name in _torchtitan_candidates(model) if name not in fp8]
    if TORCHTITAN_AUTO_FILTER in to_exclude:
        raise ExportError(
            f"format 'fp8': a Linear layer is named {TORCHTITAN_AUTO_FILTER!r}, which "
            "torchtitan's filter_fqns reads as its size heuristic, not as a name"
        )

    def harmless(entry: str) -> bool:
        return entry != TORCHTITAN_AUTO_FILTER and not any(entry in layer for layer in fp8)

    options = dict.fromkeys(
        run for name in to_exclude for run in _component_runs(name) if harmless(run)
    )
    excludes = {entry: {name for name in to_exclude if entry in name} for entry in options}
    left = set(to_exclude)
    entries: list[str] = []
    while left and excludes:
        best = max(excludes, key=lambda entry: (len(excludes[entry] & left), len(entry)))
        if not excludes[best] & left:
            break
        entries.append(best)
        left -= excludes[best]
    # What no harmless entry excludes: its whole name, and the fp8 layers holding it with it.
    stubborn = [name for name in to_exclude if name in left]
    entries += stubborn
    widened = tuple(name for name in fp8_layers if any(entry in name for entry in stubborn))
    return TorchtitanFilter(tuple(entries), widened)


def _torchtitan_candidates(model: nn.Module) -> list[str]:
    """The layers torchtitan's ``module_filter_fn`` converts given no ``filter_fqns``."""
    return [
        name
        for name, module in model.named_modules()
        if name
        and isinstance(module, nn.Linear)
        and module.in_features % FP8_DIM_MULTIPLE == 0
        and module.out_features % FP8_DIM_MULTIPLE == 0
    ]


def _component_runs(name: str) -> list[str]:
    parts = name.split(".")
    return [
        ".".join(parts[start:end])
        for start in range(len(parts))
        for end in range(start + 1, len(parts) + 1)
    ]


@dataclass(frozen=True)
class _Others:
    """The policy's other layers: each one's dtype, and each under a uniform policy of bf16,
    fp16 and fp32 (the dtypes a tool that runs them all alike may run them in)."""

    dtypes: dict[str, str]
    uniform: dict[str, dict[str, str]]

    @property
    def rest(self) -> str | None:
        """The uniform dtype that runs every other layer as the policy does (None: none)."""
        return next((dtype for dtype in self.uniform if not self.off(dtype)), None)

    @property
    def nearest(self) -> str:
        """The uniform dtype that runs the most other layers as the policy does."""
        return min(self.uniform, key=lambda dtype: len(self.off(dtype)))

    def off(self, dtype: str) -> list[str]:
        """The other layers a uniform ``dtype`` would run otherwise than the policy."""
        return [name for name, own in self.dtypes.items() if self.uniform[dtype][name] != own]


def _other_dtypes(
    leaf_dtypes: dict[str, str], model: nn.Module, device: str, fp8: Iterable[str]
) -> _Others:
    dtypes = dict(leaf_dtypes)
    for name in fp8:
        dtypes.pop(name)
    uniform = {
        dtype: Policy.uniform(dtype).plan(model, device).leaf_dtypes
        for dtype in ("bf16", "fp16", "fp32")
    }
    return _Others(dtypes, uniform)


def _rest_notes(others: _Others, runs: str, tool: str, where: str) -> list[str]:
    """The note where ``tool`` runs the other layers alike, in ``runs``, and the policy runs
    some of them otherwise."""
    off = others.off(runs)
    if not off:
        return []
    shown = names(f"{name or '(model)'!r}={others.dtypes[name]}" for name in off)
    return [
        f"{tool} runs the layers it does not convert alike, in {runs} ({where}), and the "
        f"policy runs these otherwise: {shown}; autoprec's policy.apply(model) with "
        "policy.yaml runs them as the policy says"
    ]


def _quoted(layers: Iterable[str]) -> str:
    return names(repr(layer) for layer in layers)


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quotes, backslashes and control characters escaped,
    so no name ends the string or the line."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        elif 0xD800 <= ord(char) <= 0xDFFF:
            raise ExportError(f"format 'fp8': layer name {text!r} is not valid Unicode")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _command_line(prefix: str, converter: str, recipe: str, entries: tuple[str, ...]) -> str:
    """torchtitan's flags for these settings, or why none: it splits a list flag at commas,
    and a comment line cannot carry a name that is not printable."""
    if any("," in entry or not entry.isprintable() for entry in entries):
        return "(none: a filter_fqns entry holds a comma or an unprintable character)"
    flags = [f"--model.converters={converter}", f"--{prefix}.recipe_name={recipe}"]
    if entries:
        flags.append(f"--{prefix}.filter_fqns={shlex.quote(','.join(entries))}")
    return " ".join(flags)


def _torchtitan(
    label: str,
    layers: tuple[str, ...],
    recipe: str,
    found: TorchtitanFilter,
    rest: str | None,
    notes: list[str],
) -> str:
    converted = [layer for layer in layers if layer not in found.widened]
    precision = _TORCHTITAN_DTYPES.get(rest or "", "bfloat16")
    v02 = _command_line("quantize.linear.float8", "quantize.linear.float8", recipe, found.entries)
    v01 = _command_line("float8", "float8", recipe, found.entries)
    lines = [
        *comment(
            f"autoprec {label}: its {len(layers)} fp8 Linear layer(s) for torchtitan's float8 "
            f"training, recipe {recipe!r}. Converted under this file: {_quoted(converted)}."
        ),
        "#",
        *comment(
            "torchtitan converts every nn.Linear whose dimensions are multiples of 16 unless a "
            "filter_fqns entry is a substring of its name (torchtitan/components/quantization/"
            "utils.py, module_filter_fn: any(filter_fqn in fqn for filter_fqn in "
            "filter_fqns)); so filter_fqns lists the model's other such Linear layers."
        ),
        *comment(
            "The keys are torchtitan v0.2's (v0.2.0 to v0.2.2, torchtitan/config/job_config.py, "
            "class Float8Linear, the [quantize.linear.float8] table). With recipe_name set, "
            "enable_fsdp_float8_all_gather must stay false (components/quantization/float8.py "
            "asserts it)."
        ),
        "#",
        '# In your [model] table: converters = ["quantize.linear.float8"]',
        f'# In your [training] table: mixed_precision_param = "{precision}" (the other layers)',
        f"# Command line (v0.2): {v02}",
        "#",
        *comment(
            "torchtitan v0.1 (torchtitan/config_manager.py) reads the same keys from a [float8] "
            'table, with converters = ["float8"].'
        ),
        f"# Command line (v0.1): {v01}",
        *comment(
            "torchtitan after v0.2 takes Python configs: Float8LinearConverter.Config("
            "recipe_name=..., filter_fqns=[...]) with the same list"
            + (
                "; it has no tensorwise recipe (rowwise and rowwise_with_gw_hp only)."
                if recipe == "tensorwise"
                else "."
            )
        ),
        *note_lines(notes),
        "",
        "[quantize.linear.float8]",
        f"recipe_name = {_toml_string(recipe)}",
        "filter_fqns = [",
        *(f"    {_toml_string(entry)}," for entry in found.entries),
        "]",
        "enable_fsdp_float8_all_gather = false",
        "",
    ]
    return "\n".join(lines)


def _python_header(summary: str, body: str, notes: list[str]) -> list[str]:
    notes_block = [*note_lines(notes), ""] if notes else []
    return [*docstring([summary, "", *comment(body, "", "")]), "", *notes_block]


def _layer_lines(recipe: str, layers: tuple[str, ...]) -> list[str]:
    return [
        f"RECIPE = {recipe!r}",
        "FP8_LAYERS = frozenset(",
        "    [",
        *(f"        {layer!r}," for layer in layers),
        "    ]",
        ")",
    ]


def _torchao(label: str, layers: tuple[str, ...], recipe: str, rest: str, notes: list[str]) -> str:
    if rest in _TORCH_DTYPES:
        around = f"train under torch.autocast(device_type, dtype={_TORCH_DTYPES[rest]})"
    else:
        around = "train with no autocast"
    return "\n".join(
        [
            *_python_header(
                f"autoprec {label}: its {len(layers)} fp8 Linear layer(s) as torchao's "
                "float8 training converts them.",
                "convert(model) runs convert_to_float8_training(model, config=Float8LinearConfig"
                ".from_recipe_name(RECIPE), module_filter_fn=module_filter_fn): exactly the "
                f"layers named in FP8_LAYERS become Float8Linear; then {around} for the "
                "policy's other layers.",
                notes,
            ),
            "import torch",
            "from torchao.float8 import Float8LinearConfig, convert_to_float8_training",
            "",
            *_layer_lines(recipe, layers),
            "",
            "",
            "def module_filter_fn(module: torch.nn.Module, fqn: str) -> bool:",
            "    return fqn in FP8_LAYERS",
            "",
            "",
            "def convert(model: torch.nn.Module) -> torch.nn.Module:",
            "    convert_to_float8_training(",
            "        model,",
            "        config=Float8LinearConfig.from_recipe_name(RECIPE),",
            "        module_filter_fn=module_filter_fn,",
            "    )",
            "    return model",
            "",
        ]
    )


def _accelerate(label: str, layers: tuple[str, ...], recipe: str, notes: list[str]) -> str:
    return "\n".join(
        [
            *_python_header(
                f"autoprec {label}: its {len(layers)} fp8 Linear layer(s) for accelerate's "
                "torchao fp8 training.",
                "make_accelerator() builds Accelerator(mixed_precision='fp8', kwargs_handlers="
                "[recipe_kwargs()]); its prepare(model, ...) converts exactly the layers named "
                "in FP8_LAYERS (accelerate calls torchao's convert_to_float8_training with the "
                "handler's config and module_filter_func, in place of its default filter, "
                "which keeps the first and the last Linear out), and runs the rest under bf16 "
                "autocast.",
                notes,
            ),
            "from typing import Any",
            "",
            "import torch",
            "from accelerate import Accelerator",
            "from accelerate.utils import AORecipeKwargs",
            "from torchao.float8 import Float8LinearConfig",
            "",
            *_layer_lines(recipe, layers),
            "",
            "",
            "def module_filter_func(module: torch.nn.Module, fqn: str) -> bool:",
            "    return fqn in FP8_LAYERS",
            "",
            "",
            "def recipe_kwargs() -> AORecipeKwargs:",
            "    return AORecipeKwargs(",
            "        config=Float8LinearConfig.from_recipe_name(RECIPE),",
            "        module_filter_func=module_filter_func,",
            "    )",
            "",
            "",
            "def make_accelerator(**kwargs: Any) -> Accelerator:",
            "    return Accelerator(",
            '        mixed_precision="fp8", kwargs_handlers=[recipe_kwargs()], **kwargs',
            "    )",
            "",
        ]
    )


def export(r: ExportRequest) -> list[Path]:
    return export_fp8(r.policy, r.out_dir, r.model, str(r.device))
