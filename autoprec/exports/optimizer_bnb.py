"""The ``bitsandbytes`` format: a training policy's optimizer as bitsandbytes' recipe.

``bitsandbytes_optimizer.py`` holds ``FP32_STATES`` (the names of the parameters whose
state stays in 32 bits) and ``optimizer(model, lr=..., ...)``: one
``bitsandbytes.optim.AdamW8bit`` over every trainable parameter, each told its bits by
``GlobalOptimManager.override_config`` (32 for those, 8 for the others, so that no stale
override of a freed parameter with the same id applies), as bitsandbytes documents for
embeddings and as ``policy.optimizer`` builds it for ``library: bitsandbytes``: the two
train bit for bit. bitsandbytes implements fp32 and 8-bit states with fp32 masters only; a
policy with another kind is refused.
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
from autoprec.optim.state import LIBRARY_KINDS, in_reference
from autoprec.policy import Policy

SNIPPET_FILE, _ = FILES = FORMATS["bitsandbytes"].files


def export_bitsandbytes(
    policy: Policy, out_dir: str | Path, model: nn.Module | None = None
) -> list[Path]:
    """Write ``bitsandbytes_optimizer.py`` (``FP32_STATES`` and ``optimizer(model, ...)``)
    and ``policy.yaml``; raises ExportError for a state bitsandbytes does not implement."""
    fmt = "bitsandbytes"
    grouped = parameters_by_state(policy, model, fmt)
    assert model is not None
    kinds, masters = LIBRARY_KINDS["bitsandbytes"]
    for state, names in grouped.items():
        if state.state not in kinds or state.master not in masters:
            group = policy.optimizer_states.group_of(model, names[0])
            where = f"group {group.describe()!r}" if group is not None else "the default"
            raise ExportError(
                f"format {fmt!r}: {where} keeps {state.describe()} states; bitsandbytes "
                "implements fp32 and 8bit states with fp32 masters"
            )
    folder = export_folder(out_dir, FILES)
    notes = library_note(policy, "bitsandbytes")
    fp32 = [name for state, names in grouped.items() if in_reference(state.state) for name in names]
    lines = [
        *docstring(
            [
                f"autoprec {policy_label(policy)}: its optimizer as bitsandbytes' 8-bit AdamW.",
                "",
                *comment(
                    f"optimizer(model, lr=..., ...) keeps the {len(fp32)} parameter(s) of "
                    "FP32_STATES in 32-bit states (GlobalOptimManager.override_config) and "
                    "every other trainable parameter in 8-bit states (bitsandbytes keeps "
                    "tensors under 4,096 elements in 32 bits anyway).",
                    "",
                    "",
                ),
            ]
        ),
        "",
        *note_lines(notes),
        "",
        "import bitsandbytes as bnb",
        "import torch",
        "",
        "FP32_STATES = [",
        *(f"    {name!r}," for name in fp32),
        "]",
        "",
        "",
        "def optimizer(",
        f"    model: torch.nn.Module, {ADAMW_SIGNATURE}",
        ") -> torch.optim.Optimizer:",
        "    manager = bnb.optim.GlobalOptimManager.get_instance()",
        "    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]",
        "    for name, param in params:",
        "        bits = 32 if name in FP32_STATES else 8",
        "        manager.override_config(param, key_value_dict={'optim_bits': bits})",
        "    chosen = [param for _, param in params]",
        f"    return bnb.optim.AdamW8bit(chosen, {ADAMW_ARGUMENTS})",
        "",
    ]
    return export_code_beside_policy(policy, folder / SNIPPET_FILE, lines, FILES, notes)


def export(r: ExportRequest) -> list[Path]:
    return export_bitsandbytes(r.policy, r.out_dir, r.model)
