"""The ``trainer`` format: a training policy's optimizer in transformers' Trainer.

Where one Trainer ``optim`` string builds exactly the optimizer the policy describes on the
model (`trainer_optim`), ``trainer_optimizer.py`` sets ``TrainingArguments(optim=...)`` and
the Trainer builds it; otherwise (per-group states the Trainer has no string for) it passes
``optimizers=(policy.optimizer(model, torch.optim.AdamW, ...), None)`` to the Trainer, built by
`autoprec.integrations.transformers.policy_optimizers` from the ``policy.yaml`` beside it.

The strings, as transformers 5 builds them (``trainer_optimizer.py``; checked against 5.24):

- ``adamw_torch``: ``torch.optim.AdamW``, where every state is fp32 (library torchao);
- ``adamw_torch_8bit``: ``torchao.optim.AdamW8bit`` (block 256, no stochastic rounding),
  where every state is 8-bit (library torchao);
- ``adamw_bnb_8bit``: bitsandbytes' AdamW with ``optim_bits=8``, the Trainer overriding every
  ``nn.Embedding``'s weight to 32 bits, where exactly those parameters' states are fp32 and
  every other is 8-bit (library bitsandbytes).

``adamw_torch_4bit`` is not offered: the Trainer passes ``block_size=256`` to torchao's
``AdamW4bit``, whose own (and the policy's) is 128. Masters must be fp32 for any string. The
Trainer's own optimizer exempts biases and norms from weight decay; ``policy.optimizer``
decays every parameter, so the two agree where ``weight_decay`` is 0.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from autoprec.exports._common import (
    comment,
    docstring,
    parameters_by_state,
    policy_label,
    require,
)
from autoprec.exports._owned import export_folder
from autoprec.exports.registry import FORMATS, ExportRequest
from autoprec.exports.yaml_file import POLICY_FILE, export_code_beside_policy
from autoprec.optim.state import TrainingState, in_reference
from autoprec.policy import Policy

SNIPPET_FILE, _ = FILES = FORMATS["trainer"].files
# The Trainer's optim string for a policy whose every parameter keeps one state, by library.
_UNIFORM = {("torchao", "fp32"): "adamw_torch", ("torchao", "8bit"): "adamw_torch_8bit"}


def trainer_optim(policy: Policy, model: nn.Module) -> str | None:
    """The Trainer ``optim`` string that builds on ``model`` the optimizer the policy
    describes, or None where no string does (see the module docstring)."""
    grouped = parameters_by_state(policy, model, "trainer")
    if not all(in_reference(state.master) for state in grouped):
        return None
    library = policy.optimizer_states.library
    if library == "bitsandbytes":
        embeddings = {
            f"{name}.weight" if name else "weight"
            for name, module in model.named_modules()
            if isinstance(module, nn.Embedding) and module.weight.requires_grad
        }
        fp32 = set(grouped.get(TrainingState("fp32"), []))
        return "adamw_bnb_8bit" if fp32 == embeddings else None
    if len(grouped) != 1:
        return None
    return _UNIFORM.get((library, next(iter(grouped)).state))


def export_trainer(
    policy: Policy, out_dir: str | Path, model: nn.Module | None = None
) -> list[Path]:
    """Write ``trainer_optimizer.py`` (``training_arguments(output_dir, ...)`` and
    ``optimizers(model, args)``, what ``Trainer(..., args=..., optimizers=...)`` takes) and
    ``policy.yaml``."""
    require(model, "a model (the fp32 module, for its parameter names)", "trainer")
    assert model is not None
    optim = trainer_optim(policy, model)
    folder = export_folder(out_dir, FILES)
    if optim is not None:
        how = (
            f"the Trainer's own optim={optim!r} builds the optimizer the policy describes on "
            f"{type(model).__name__}: training_arguments sets it and optimizers returns "
            "(None, None)."
        )
    else:
        how = (
            "no Trainer optim string holds the policy's per-group states: optimizers(model, "
            "args) builds the policy's optimizer (from policy.yaml beside this file) with "
            "args' learning rate, betas, epsilon and weight decay, for "
            "Trainer(..., optimizers=optimizers(model, args))."
        )
    lines = [
        *docstring(
            [
                f"autoprec {policy_label(policy)}: its optimizer in transformers' Trainer.",
                "",
                *comment(how, "", ""),
            ]
        ),
        "",
        "from pathlib import Path",
        "",
        "import torch",
        "import transformers",
        "",
        f"OPTIM = {optim!r}",
        f"POLICY_FILE = Path(__file__).with_name({POLICY_FILE!r})",
        "",
        "",
        "def training_arguments(output_dir: str, **kwargs) -> transformers.TrainingArguments:",
        "    if OPTIM is not None:",
        "        kwargs.setdefault('optim', OPTIM)",
        "    return transformers.TrainingArguments(output_dir=output_dir, **kwargs)",
        "",
        "",
        "def optimizers(",
        "    model: torch.nn.Module, args: transformers.TrainingArguments",
        ") -> tuple[torch.optim.Optimizer | None, None]:",
        "    if OPTIM is not None:",
        "        return None, None  # the Trainer builds its own from args.optim",
        "    import autoprec",
        "    from autoprec.integrations.transformers import policy_optimizers",
        "",
        "    return policy_optimizers(autoprec.load_policy(POLICY_FILE), model, args)",
        "",
    ]
    return export_code_beside_policy(policy, folder / SNIPPET_FILE, lines, FILES)


def export(r: ExportRequest) -> list[Path]:
    return export_trainer(r.policy, r.out_dir, r.model)
