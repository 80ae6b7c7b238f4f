"""The ``torchao-optimizer`` format: a training policy's optimizer as torchao's own classes,
one per training state, with the parameters each steps and its keyword arguments.

``torchao_optimizer.py`` holds ``GROUPS`` (plain data: the class, its keyword arguments
beyond AdamW's hyperparameters, the master dtype and the parameter names) and
``optimizers(model, lr=..., ...)``, which builds them: ``torch.optim.AdamW`` for fp32 states,
``torchao.optim.AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` for the quantised ones, with
``bf16_stochastic_round=True`` where the master is bf16 (the parameters cast to bf16 first),
as ``policy.optimizer(model, torch.optim.AdamW, ...)`` builds them, so the two train bit for
bit. Step and zero each of them (or use ``policy.optimizer``, which does). bf16 moments,
MS-AMP-like fp8/bf16 moments and fp32 moments of a bf16 master have no public torchao class
(autoprec builds them on torchao's ``_AdamBase``): a policy with them is refused.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from autoprec.exports._common import (
    ADAMW_ARGUMENTS,
    ADAMW_SIGNATURE,
    ExportError,
    comment,
    docstring,
    library_note,
    note_lines,
    parameters_by_state,
    policy_label,
)
from autoprec.exports._owned import export_folder
from autoprec.exports.registry import FORMATS, ExportRequest
from autoprec.exports.yaml_file import export_code_beside_policy
from autoprec.optim.state import in_reference
from autoprec.policy import Policy

CONFIG_FILE, _ = FILES = FORMATS["torchao-optimizer"].files
# Each state kind torchao has a public optimizer class for (AdamW's variant).
CLASSES = {
    "fp32": "torch.optim.AdamW",
    "8bit": "torchao.optim.AdamW8bit",
    "4bit": "torchao.optim.AdamW4bit",
    "fp8": "torchao.optim.AdamWFp8",
}


def export_torchao_optimizer(
    policy: Policy, out_dir: str | Path, model: nn.Module | None = None
) -> list[Path]:
    """Write ``torchao_optimizer.py`` (``GROUPS`` and ``optimizers(model, ...)``) and
    ``policy.yaml``; raises ExportError for a state torchao has no public class for."""
    fmt = "torchao-optimizer"
    grouped = parameters_by_state(policy, model, fmt)  # checks the model first
    assert model is not None
    for state, names in grouped.items():
        fp32_states_low_master = in_reference(state.state) and not in_reference(state.master)
        if state.state not in CLASSES or fp32_states_low_master:
            group = policy.optimizer_states.group_of(model, names[0])
            where = f"group {group.describe()!r}" if group is not None else "the default"
            raise ExportError(
                f"format {fmt!r}: {where} keeps {state.describe()} states, which torchao has "
                "no public optimizer class for (build it with policy.optimizer(model, ...))"
            )
    folder = export_folder(out_dir, FILES)
    notes = library_note(policy, "torchao")
    entries = []
    for state, names in grouped.items():
        low_master = not in_reference(state.master)  # bf16
        kwargs = "{}" if in_reference(state.state) else f"{{'bf16_stochastic_round': {low_master}}}"
        entries += [
            "    {",
            f"        'optimizer': {CLASSES[state.state]},",
            f"        'kwargs': {kwargs},",
            f"        'master': {state.master!r},",
            "        'params': [",
            *(f"            {name!r}," for name in names),
            "        ],",
            "    },",
        ]
    lines = [
        *docstring(
            [
                f"autoprec {policy_label(policy)}: its optimizer as torchao's classes.",
                "",
                *comment(
                    "optimizers(model, lr=..., ...) builds one optimizer per training state "
                    "(GROUPS), with AdamW's hyperparameters; step and zero each of them. "
                    "Parameters whose master is bf16 are cast to bf16 first.",
                    "",
                    "",
                ),
            ]
        ),
        "",
        *note_lines(notes),
        "",
        "import torch",
        "import torchao.optim",
        "",
        "GROUPS = [",
        *entries,
        "]",
        "",
        "",
        "def optimizers(",
        f"    model: torch.nn.Module, {ADAMW_SIGNATURE}",
        ") -> list[torch.optim.Optimizer]:",
        "    params = dict(model.named_parameters())",
        "    built = []",
        "    for group in GROUPS:",
        "        chosen = [params[name] for name in group['params']]",
        "        if group['master'] == 'bf16':",
        "            for param in chosen:",
        "                param.data = param.data.to(torch.bfloat16)",
        "        built.append(",
        f"            group['optimizer'](chosen, {ADAMW_ARGUMENTS}, **group['kwargs'])",
        "        )",
        "    return built",
        "",
    ]
    return export_code_beside_policy(policy, folder / CONFIG_FILE, lines, FILES, notes)


def export(r: ExportRequest) -> list[Path]:
    return export_torchao_optimizer(r.policy, r.out_dir, r.model)
