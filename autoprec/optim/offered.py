"""The optimizer states a search offers on its own, without an ``optimizer_states`` section:
under ``--prefer memory``, and in a space that says ``optimizer_states: auto`` (the shipped
``default``), wherever the task trains with Adam or AdamW.

The choices come from the library that is installed: torchao's ``fp32``, ``8bit``,
``4bit`` and ``fp8-bf16`` (MS-AMP O2-like moments), else bitsandbytes' ``fp32`` and
``8bit``. The groups are the embeddings (where the model has one) and the rest, so the
space's anchors are there: every state in 8 bits with the embeddings in fp32, and (with
torchao) MS-AMP O2-like moments. Where neither library is installed, one line says so and
how to install one, and the search goes on without states. A model whose parameters are
all under 4,096 elements (whose states both libraries keep in fp32) is offered none.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.errors import PolicyError
from autoprec.optim.optimizer import import_bitsandbytes
from autoprec.optim.space import StateChoice, StateSpace
from autoprec.optim.state import StateGroup

# The kinds offered per library: fp32 (the baseline's), the 8-bit recipe, the least memory
# (4bit) and MS-AMP O2-like moments (torchao only). bf16 and fp8 states are left out: each
# kind costs a compile of torchao's step on the CPU, and neither stores less than 8bit.
OFFERED_KINDS = {
    "torchao": ("fp32", "8bit", "4bit", "fp8-bf16"),
    "bitsandbytes": ("fp32", "8bit"),
}
INSTALL_HINT = "pip install torchao, or pip install 'autoprec[torchao]'"
# Both libraries keep the states of tensors under 4,096 elements in fp32: a model with no
# larger parameter has nothing to gain.
QUANTISED_MIN_ELEMENTS = 4096


@dataclass(frozen=True)
class OfferedStates:
    """The states offered (None: none) and, where none are for want of a library, the one
    line that says so."""

    states: StateSpace | None
    note: str | None = None


def offered_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> OfferedStates:
    """The state space for ``model`` trained by ``optimizer`` (the task's, built over its
    parameters): per-group states where it is Adam or AdamW that these libraries' optimizers
    can follow and some parameter is large enough to be quantised, from the first library
    installed (torchao, then bitsandbytes)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    if not trains_with_adam(optimizer) or not any(
        p.numel() >= QUANTISED_MIN_ELEMENTS for p in parameters
    ):
        return OfferedStates(None)
    library = installed_library()
    if library is None:
        return OfferedStates(
            None,
            "optimizer states: neither torchao nor bitsandbytes is installed, so the search "
            f"keeps every optimizer state in fp32 ({INSTALL_HINT})",
        )
    if library == "bitsandbytes" and not _bitsandbytes_follows(optimizer):
        return OfferedStates(
            None,
            "optimizer states: bitsandbytes' 8-bit Adam cannot follow the task's "
            f"{type(optimizer).__name__} (amsgrad, or Adam's weight decay), so the search "
            f"keeps every optimizer state in fp32 ({INSTALL_HINT})",
        )
    kinds = OFFERED_KINDS[library]
    embeddings = StateGroup((), ("Embedding",), "fp32", name="embeddings")
    rest = StateGroup(("*",), (), "fp32", name="rest")
    groups = (
        StateChoice("embeddings", embeddings, kinds, optional=True),
        StateChoice("rest", rest, kinds),
    )
    return OfferedStates(StateSpace(groups, library=library))


def trains_with_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the libraries' Adam can stand in for ``optimizer``: torch's Adam or AdamW
    (not maximising, not differentiable), as `autoprec.optim.optimizer` requires."""
    defaults: dict[str, Any] = optimizer.defaults
    if not isinstance(optimizer, torch.optim.Adam):
        return False
    return not (defaults.get("maximize") or defaults.get("differentiable"))


def installed_library() -> str | None:
    """torchao where its optimizers import, else bitsandbytes where it imports, else None."""
    from autoprec.serving.quantizers import import_torchao

    try:
        import_torchao()  # quietly: its import-time noise is not the user's to see
        importlib.import_module("torchao.optim")
        return "torchao"
    except ImportError:
        pass
    try:
        import_bitsandbytes()
    except PolicyError:  # not installed
        return None
    return "bitsandbytes"


def _bitsandbytes_follows(optimizer: torch.optim.Optimizer) -> bool:
    """Whether bitsandbytes' 8-bit Adam takes ``optimizer``'s settings: no amsgrad, and
    weight decay only decoupled (AdamW's)."""
    defaults: dict[str, Any] = optimizer.defaults
    adamw = isinstance(optimizer, torch.optim.AdamW) or bool(defaults.get("decoupled_weight_decay"))
    return not defaults.get("amsgrad") and (adamw or not defaults.get("weight_decay"))
