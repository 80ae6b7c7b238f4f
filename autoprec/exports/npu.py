"""The ``torch-npu`` format: the settings an Ascend training script needs beside the policy.

torch_npu's ``ACL_PRECISION_MODE`` decides what the NPU does with fp32 operators, which
autocast does not touch: ``allow_fp32_to_fp16`` runs fp32 matrix ops in fp16 silently (910A's
default), ``must_keep_origin_dtype`` runs them in fp32 (the default from 910B on). torch_npu
accepts no other value. The per-layer dtypes themselves come from ``policy.apply``.
Written from torch_npu's documented API (shared/NPU.md); no Ascend chip ran it.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

import autoprec.formats as formats
from autoprec.exports._common import (
    comment,
    names,
    note_lines,
    policy_label,
    warn,
    write,
)
from autoprec.exports._owned import export_folder, record_written
from autoprec.exports.registry import FORMATS, ExportRequest
from autoprec.exports.yaml_file import POLICY_FILE, export_yaml
from autoprec.policy import Policy

SETTINGS_FILE, _ = FILES = FORMATS["torch-npu"].files
KEEP_ORIGIN = "must_keep_origin_dtype"
FP32_TO_FP16 = "allow_fp32_to_fp16"


def precision_mode(policy: Policy, model: nn.Module | None = None) -> tuple[str, str, list[str]]:
    """torch_npu's ACL_PRECISION_MODE for the policy, the reason in a sentence, and notes on
    what the two modes cannot say. Only a policy that runs no layer in fp32 or bf16 of its
    own accord gets ``allow_fp32_to_fp16``: with a model, the layers autocast keeps in fp32
    on the NPU anyway (norms, embeddings: no matrix ops, which are what that mode reduces) do
    not count; without one, the policy's rules decide."""
    if model is not None:
        resolved = policy.resolve(model, "npu")
        autocast_fp32 = Policy.uniform("fp16").resolve(model, "npu")
        fp32 = {n for n, d in resolved.items() if formats.get(d).reference}
        kept = [n for n in resolved if n in fp32 and not formats.get(autocast_fp32[n]).reference]
        bf16 = [n for n, d in resolved.items() if _unsaid(d)]
        kept_text = f"{len(kept)} layer(s) in fp32 ({names(kept)})"
        bf16_text = f"{len(bf16)} layer(s) in bf16 ({names(bf16)})"
    else:
        declared = [policy.default, *(rule.dtype for rule in policy.rules)]
        kept = list({d for d in declared if formats.get(d).reference})
        bf16 = list({d for d in declared if _unsaid(d)})
        kept_text = "layers in fp32 (its default or a rule says fp32; no model to tell which)"
        bf16_text = "layers in bf16 (its default or a rule says bf16)"
    notes = []
    if bf16:
        notes.append(
            "torch_npu's ACL_PRECISION_MODE has no bf16 mode (only allow_fp32_to_fp16 and "
            f"must_keep_origin_dtype): the policy's {bf16_text} run in bf16 through autocast "
            "alone (policy.apply), which needs an NPU with bf16 (910B and later, "
            "torch.npu.is_bf16_supported()); the mode only keeps the ops autocast leaves in "
            "fp32 from being reduced to fp16"
        )
    if kept:
        return (
            KEEP_ORIGIN,
            f"the policy keeps {kept_text}; under {FP32_TO_FP16} the NPU runs fp32 matrix ops "
            "in fp16 silently, so those layers would not be fp32.",
            notes,
        )
    if bf16:
        return (
            KEEP_ORIGIN,
            f"the policy runs {bf16_text}; {FP32_TO_FP16} would reduce what stays in fp32 to "
            "fp16, whose range a bf16 policy avoids.",
            notes,
        )
    return (
        FP32_TO_FP16,
        "every layer the policy assigns runs in fp16, so no matrix op is meant to run in fp32; "
        f"{FP32_TO_FP16} (910A's default) changes nothing the policy placed, and "
        f"{KEEP_ORIGIN} would be as correct.",
        notes,
    )


def _unsaid(dtype: str) -> bool:
    """Whether ``dtype`` is a format autocast runs below fp32 that ACL's modes do not name
    (bf16: they reduce fp32 to torch's float16 only)."""
    made = formats.get(dtype)
    return made.autocasts and made.low_precision and made.torch_name != "float16"


def _hf32_lines(hf32: bool | None) -> list[str]:
    if hf32 is None:
        return comment(
            "HF32: the policy leaves the device's defaults (torch.npu.matmul.allow_hf32 off, "
            "torch.npu.conv.allow_hf32 on: fp32 convolutions run in HF32), so nothing is set."
        )
    return [
        *comment(
            f"HF32 {'on' if hf32 else 'off'}, as the policy says (policy.apply sets the same "
            "while it is installed; these lines also cover code outside it, e.g. evaluation)."
        ),
        f"torch.npu.matmul.allow_hf32 = {hf32!r}",
        f"torch.npu.conv.allow_hf32 = {hf32!r}",
    ]


def export_torch_npu(
    policy: Policy, out_dir: str | Path, model: nn.Module | None = None
) -> list[Path]:
    """Write ``npu_settings.py`` (ACL_PRECISION_MODE, the HF32 switches, and the three lines
    that load and apply the policy with torch_npu) and the ``policy.yaml`` it loads. The
    model is optional: with it, the mode is chosen from the dtypes each layer really runs
    in on the NPU; without it, from the policy's rules (never less safe, sometimes stricter).
    """
    folder = export_folder(out_dir, FILES)
    mode, reason, notes = precision_mode(policy, model)
    header = [
        *comment(
            f"autoprec {policy_label(policy)} for a torch_npu (Ascend) training "
            "script. Paste these lines where the script has built `model` (fp32, on the NPU), "
            f"and keep {POLICY_FILE} beside the script (or change its path below). Written "
            "from torch_npu's documented API; it was not run here (no Ascend chip)."
        ),
        "#",
        *comment(f"ACL_PRECISION_MODE = {mode}: {reason}"),
        *comment(
            "torch_npu accepts only allow_fp32_to_fp16 and must_keep_origin_dtype; set it "
            "before the model runs."
        ),
        *note_lines(notes),
    ]
    if policy.tf32 is not None:
        header += comment("The policy's tf32 switch is a CUDA setting: not used on Ascend.")
    body = [
        "import torch",
        "import torch_npu  # noqa: F401  (registers torch.npu)",
        "",
        "import autoprec",
        "",
        f"torch.npu.set_option({json.dumps({'ACL_PRECISION_MODE': mode})})",
        *_hf32_lines(policy.hf32),
        "",
        f"policy = autoprec.load_policy({json.dumps(POLICY_FILE)})",
        'prec = policy.apply(model, device="npu")  # then: with prec.autocast(): ...',
    ]
    path = write(folder / SETTINGS_FILE, "\n".join([*header, "", *body]) + "\n")
    written = [path, *export_yaml(policy, folder)]
    warn(notes)
    return record_written(folder, written, FILES)


def export(r: ExportRequest) -> list[Path]:
    return export_torch_npu(r.policy, r.out_dir, r.model)
