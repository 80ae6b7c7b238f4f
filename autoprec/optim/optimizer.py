"""The per-group optimizer a policy's ``optimizer`` section describes, built from the
libraries' own classes.

``policy.optimizer(model, torch.optim.AdamW, lr=1e-3)`` makes one optimizer per training
state the policy names (`autoprec.optim.state`): the user's own class for fp32 states
and fp32 masters, torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` (``Adam*`` for
``torch.optim.Adam``) for the quantised kinds, and torchao's Adam step (``_AdamBase``, the
code all of them share) with bf16 buffers for bf16 states and bf16 masters. They come back
as one `PolicyOptimizer`, an ``torch.optim.Optimizer`` whose ``param_groups`` are theirs
(so LR schedulers and loss scalers see every parameter) and whose ``step``, ``zero_grad``,
``state_dict`` and ``load_state_dict`` go to each of them.

With ``library: bitsandbytes`` every part is a ``bitsandbytes.optim.AdamW8bit``
(``Adam8bit``), and the parameters of an fp32 part get
``GlobalOptimManager.override_config(param, "optim_bits", 32)``, as bitsandbytes documents
for embeddings: bitsandbytes steps each parameter on its own, so this trains bit for bit as
one such optimizer with the same overrides (tested on the CPU; its CUDA kernels never ran
here).

torchao steps every parameter on its own through ``torch.compile(single_param_adam)``;
the compiled code is cached on that function, so later optimizers (other trials in one
process) reuse it where shapes, dtypes and state kinds repeat.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from autoprec.errors import PolicyError
from autoprec.optim.state import OptimizerStates, TrainingState, in_reference

OptimizerFactory = Callable[..., torch.optim.Optimizer]
_ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
# bitsandbytes' optim_bits for each state kind it implements.
BITSANDBYTES_BITS = {"fp32": 32, "8bit": 8}
_NO_CACHE_HASH = r".* does not implement _stable_hash_for_caching"


def build_optimizer(
    states: OptimizerStates,
    model: nn.Module,
    optimizer: type[torch.optim.Optimizer] | OptimizerFactory = torch.optim.AdamW,
    **hyperparameters: Any,
) -> PolicyOptimizer:
    """One optimizer per training state over ``model``'s trainable parameters.

    ``optimizer``: an optimizer class, called as ``optimizer(params, **hyperparameters)``,
    or a factory ``(params) -> Optimizer`` (a task's); its class and defaults (lr, betas,
    eps, weight decay, amsgrad) are what the torchao optimizers of the other groups take.
    Parameters whose master is bf16 are stored in bf16 here, in place."""
    assigned = states.assign(model)
    parameters = dict(model.named_parameters())
    by_state: dict[TrainingState, list[nn.Parameter]] = {}
    for name, state in assigned.items():
        by_state.setdefault(state, []).append(parameters[name])
    reference = optimizer(list(parameters[n] for n in assigned), **hyperparameters)
    parts: list[tuple[TrainingState, torch.optim.Optimizer]] = []
    for state, params in by_state.items():
        if states.library == "bitsandbytes":
            parts.append((state, _bitsandbytes_optimizer(state, params, reference)))
            continue
        if state == TrainingState():
            parts.append((state, optimizer(params, **hyperparameters)))
            continue
        if not in_reference(state.master):  # bf16
            with torch.no_grad():
                for param in params:
                    param.data = param.data.to(torch.bfloat16)
        parts.append((state, _torchao_optimizer(state, params, reference)))
    return PolicyOptimizer(parts)


def state_buffer(
    state: str, parameter: torch.Tensor, reference: torch.optim.Optimizer, signed: bool
) -> torch.Tensor:
    """An empty buffer in which the optimizer a state kind builds (from ``reference``'s
    class and defaults) would store one of ``parameter``'s moments (``signed``: the first),
    made by that optimizer itself: torchao's blockwise state where it quantises the
    parameter, a plain tensor (fp32, or bf16 for bf16 states) where it does not. Copying a
    moment in quantises it as a trial's optimizer would (`autoprec.numerics.state_health`)."""
    if in_reference(state):
        return torch.zeros_like(parameter, dtype=torch.float32)
    alone = nn.Parameter(parameter.detach(), requires_grad=False)  # its storage, not a copy
    optimizer = _torchao_optimizer(TrainingState(state), [alone], reference)
    buffer: torch.Tensor = optimizer._new_buffer(parameter, signed)  # type: ignore[attr-defined]
    return buffer


def _torchao_optimizer(
    state: TrainingState, params: list[nn.Parameter], reference: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    from autoprec.formats.methods import import_torchao

    import_torchao()  # quietly: its import-time noise is not the user's to see
    import torchao.optim as ao

    # At the first compile of each of torchao's state subclasses torch says that it has no
    # hash for AOT autograd's cache: a note to torchao, not the user's to see.
    warnings.filterwarnings("ignore", message=_NO_CACHE_HASH, category=UserWarning)
    adamw, kwargs = _adam_defaults(reference, state, "torchao")
    stochastic = not in_reference(state.master)  # bf16 masters
    quantised = {
        "8bit": (ao.AdamW8bit, ao.Adam8bit),
        "4bit": (ao.AdamW4bit, ao.Adam4bit),
        "fp8": (ao.AdamWFp8, ao.AdamFp8),
    }
    if state.state in quantised:
        cls = quantised[state.state][0 if adamw else 1]
        return cls(params, **kwargs, bf16_stochastic_round=stochastic)
    from autoprec.optim._torchao_adam import BUFFERED  # imports torchao: only where used

    return BUFFERED[state.state](params, adamw, stochastic, **kwargs)


def _adam_defaults(
    reference: torch.optim.Optimizer, state: TrainingState, library: str
) -> tuple[bool, dict[str, Any]]:
    """Whether ``reference`` (the user's optimizer) is AdamW, and its hyperparameters as the
    library's Adam takes them; PolicyError where the library's Adam cannot follow it."""
    defaults = reference.defaults
    if not isinstance(reference, torch.optim.Adam):
        raise PolicyError(
            f"optimizer.state {state.state}: {library}'s states are Adam's and AdamW's; "
            f"the task's optimizer is {type(reference).__name__}"
        )
    for flag in ("maximize", "differentiable"):
        if defaults.get(flag):
            raise PolicyError(f"optimizer: {library}'s Adam has no {flag}=True")
    adamw = isinstance(reference, torch.optim.AdamW) or bool(defaults.get("decoupled_weight_decay"))
    kwargs = {key: defaults[key] for key in _ADAM_HYPERPARAMETERS if key in defaults}
    if isinstance(kwargs.get("lr"), torch.Tensor):
        kwargs["lr"] = float(kwargs["lr"])
    kwargs["betas"] = tuple(float(b) for b in kwargs.get("betas", (0.9, 0.999)))
    return adamw, kwargs


def import_bitsandbytes() -> Any:
    """bitsandbytes, imported where a policy asks for it (an optional dependency). On a CPU
    without its optional 4-bit matmul kernel it logs a warning at import that concerns no
    optimizer: not the user's to see."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise PolicyError(
            "optimizer.library: bitsandbytes is not installed (pip install bitsandbytes, "
            "or pip install 'autoprec[bitsandbytes]')"
        ) from None
    return bitsandbytes


def _bitsandbytes_optimizer(
    state: TrainingState, params: list[nn.Parameter], reference: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """bitsandbytes' 8-bit Adam over ``params``, each told its state's bits through the
    global manager (by ``id``: a stale entry of a freed parameter with the same id would
    otherwise apply)."""
    bnb = import_bitsandbytes()
    adamw, kwargs = _adam_defaults(reference, state, "bitsandbytes")
    if kwargs.pop("amsgrad", False):
        raise PolicyError("optimizer: bitsandbytes' 8-bit Adam has no amsgrad=True")
    if not adamw and kwargs.get("weight_decay"):
        raise PolicyError(
            "optimizer: bitsandbytes' Adam8bit decays weights as AdamW does (decoupled), "
            "not as torch.optim.Adam's weight_decay; use torch.optim.AdamW"
        )
    manager = bnb.optim.GlobalOptimManager.get_instance()
    for param in params:
        # A dict of its own for each parameter, set rather than updated: override_config
        # stores the dict it is given for every new id and updates the one already there,
        # which an earlier call may share with other ids (a freed parameter's included), so
        # one group's bits could reach another's parameter.
        manager.pid2config[id(param)] = {"optim_bits": BITSANDBYTES_BITS[state.state]}
    cls = bnb.optim.AdamW8bit if adamw else bnb.optim.Adam8bit
    return cls(params, **kwargs)  # type: ignore[no-any-return]


class _States(Mapping[Any, dict[str, Any]]):
    """The parts' ``state`` as one read-only mapping (parameter -> its state)."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self._parts = parts

    def __getitem__(self, key: Any) -> dict[str, Any]:
        for part in self._parts:
            if key in part.state:
                return part.state[key]
        for part in self._parts:  # a parameter not stepped yet: {} as torch's defaultdict
            if any(key is p for group in part.param_groups for p in group["params"]):
                return part.state[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        for part in self._parts:
            yield from part.state

    def __len__(self) -> int:
        return sum(len(part.state) for part in self._parts)


class PolicyOptimizer(torch.optim.Optimizer):
    """Several optimizers, one per training state, seen as one: ``param_groups`` are
    theirs (the same dicts, so a scheduler's lr reaches them), ``state`` is theirs read
    together, and ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` go to
    each. ``parts``: (training state, optimizer) pairs."""

    def __init__(self, parts: list[tuple[TrainingState, torch.optim.Optimizer]]) -> None:
        self.parts = parts
        groups = [group for _, part in parts for group in part.param_groups]
        super().__init__(groups, {})
        self.state = _States([part for _, part in parts])  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {
            "parts": [
                {"state": state.state, "master": state.master, "optimizer": part.state_dict()}
                for state, part in self.parts
            ]
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("parts") if isinstance(state_dict, dict) else None
        here = [(state.state, state.master) for state, _ in self.parts]
        found = [(p.get("state"), p.get("master")) for p in saved or [] if isinstance(p, dict)]
        if saved is None or found != here:
            raise PolicyError(
                f"optimizer state_dict: saved for training states {found}, this optimizer "
                f"has {here} (build it from the same policy and model)"
            )
        for (_, part), entry in zip(self.parts, saved, strict=True):
            part.load_state_dict(entry["optimizer"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "parts") and len(self.param_groups) >= sum(
            len(part.param_groups) for _, part in self.parts
        ):
            raise PolicyError(
                "PolicyOptimizer: parameters are grouped by the policy; "
                "add them to the model and build it again"
            )
        super().add_param_group(param_group)

    def describe(self) -> list[str]:
        """One line per part: its training state, its class and how many parameters."""
        return [
            f"{state.describe()}: {type(part).__module__}.{type(part).__name__}, "
            f"{sum(p.numel() for g in part.param_groups for p in g['params'])} parameters"
            for state, part in self.parts
        ]
