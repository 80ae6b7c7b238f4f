"""What each leaf of a model runs in under a policy, and what is read from that.

`resolve` is the dtype each leaf computes in under autocast, as the plan says and a
watched forward shows (``Policy.resolve``); `resolve_served`, the dtype its weights are
converted to for serving (``Policy.resolve_served``). A mode resolves a policy by one or
the other (`autoprec.trials.Mode.resolve_policy`), and `identity`, `layer_table` and
`share` ask the mode: what a trial of the policy measures, each layer's row of the
summary's table, and the share of parameters in low precision.

A policy is data (`autoprec.policy`); this module reads it and never changes it.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec.devices import Backend, autocast_behaviour, device_kind, get_backend
from autoprec.errors import PolicyError
from autoprec.modes import Mode, mode_of
from autoprec.numerics.observe import learn, observed_dtypes, probe, synthesized_run
from autoprec.optim.state import TrainingState
from autoprec.precision.landing import device_of, matched_leaves, plan
from autoprec.precision.plan import low_precision_share, own_parameters

if TYPE_CHECKING:
    from autoprec.precision.view import PolicyView


def int8_capable(module: nn.Module) -> bool:
    """Whether a layer can be served in int8: an ``nn.Linear`` or transformers' Conv1D.
    Subclasses are not: they may be read by their parent rather than called
    (MultiheadAttention's ``out_proj``), or change what the forward does."""
    return type(module) is nn.Linear or type(module).__name__ == "Conv1D"


def _served_refusal(policy: PolicyView, dtype: str, module: nn.Module) -> str | None:
    """Why a layer cannot be served in ``dtype`` (None: it can): a quantizing format's
    own word on the layer, by the method the policy records for it."""
    served = formats.get(dtype)
    method = policy.quantization.method(dtype)
    return served.serving_layer_refusal(
        module, None if method is None else served.method(method, "")
    )


def resolve(
    policy: PolicyView,
    model: nn.Module,
    device: str | torch.device | Backend | None = None,
    module: str | None = None,
    example: Any = None,
) -> dict[str, str]:
    """Every leaf module with parameters mapped to the dtype it computes and outputs on
    the device kind of ``device`` under autocast (``Policy.resolve``, which says how)."""
    here = get_backend(device_of(model))
    if isinstance(device, Backend) and device.kind == here.kind:
        here = device  # with what it emulates
    if device_kind(device, model) != here.kind:
        return plan(policy, model, device, module).leaf_dtypes  # nothing to watch there
    run = None if example is None else _runner(example, here)
    if run is not None:
        learn(model, run, here)
    probe(model, here)
    guess = plan(policy, model, here, module).leaf_dtypes
    if example is None:
        if _follows_uncast_input(policy, model, guess, here.kind):
            run = synthesized_run(model)
        if run is None:
            return guess
    try:
        seen = observed_dtypes(model, policy, run, here, module)
    except PolicyError:
        if example is not None:
            raise
        return guess  # a policy this device refuses (fp8 unemulated): nothing to watch
    # A converted layer (fp8) hands on its region's dtype; what it computes in is its own.
    return {
        name: dtype if formats.get(dtype).converts else seen.get(name, dtype)
        for name, dtype in guess.items()
    }


def resolve_served(policy: PolicyView, model: nn.Module) -> dict[str, str]:
    """Every leaf with parameters mapped to the dtype its weights are converted to for
    serving (``Policy.resolve_served``, which says how)."""
    resolved: dict[str, str] = {}
    for name, module, dtype in matched_leaves(policy, model):
        if dtype is None:
            dtype = policy.default
            if _served_refusal(policy, dtype, module) is not None:
                dtype = formats.reference().name
        resolved[name] = dtype
    return resolved


def identity(
    policy: PolicyView,
    model: nn.Module | None = None,
    device: str | torch.device | Backend | None = None,
    mode: str | Mode | None = None,
) -> str:
    """What a trial of the policy measures in ``mode``, as a short hash
    (``Policy.identity``, which says what goes in)."""
    found = mode_of(mode)
    if model is not None:
        dtypes = found.resolve_policy(policy, model, device)
    else:
        dtypes = {f"rules[{i}]": rule.dtype for i, rule in enumerate(policy.rules)}
        dtypes["default"] = policy.default
    # Trials that train nothing scale no loss.
    scaled = found.trains and any(formats.get(d).scales_loss for d in dtypes.values())
    scaling = policy.loss_scale.to_dict() if scaled else {"mode": "none"}
    measured: list[Any] = [dtypes, scaling, policy.tf32, policy.hf32]
    if any(formats.get(d).recipes for d in dtypes.values()):  # only then: others keep theirs
        measured.append(policy.fp8_recipe)
    if policy.reduce_dtype is not None:  # likewise
        measured.append({"reduce_dtype": policy.reduce_dtype})
    optimizer_states = policy.optimizer_states
    if found.trains and not optimizer_states.all_fp32(model):  # likewise
        states = optimizer_states.by_module(model) if model is not None else optimizer_states
        library = optimizer_states.library
        extra = {"library": library} if library != "torchao" else {}  # old identities kept
        measured.append({"optimizer": repr(states), **extra})
    text = json.dumps(measured, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def layer_table(
    policy: PolicyView,
    model: nn.Module,
    device: str | torch.device | Backend | None = None,
    mode: str | Mode | None = None,
    example: Any = None,
) -> list[dict[str, Any]]:
    """Each leaf module with parameters: name, type, parameter count and the dtype it
    runs in as ``mode`` resolves it, and where the mode's trials train, how it lands in
    that dtype (``lands``: `autoprec.precision.plan.Plan.landings`) and its training
    state (``Policy.layer_table``)."""
    modules = dict(model.named_modules())
    found = mode_of(mode)
    resolved = found.resolve_policy(policy, model, device, example)
    rows = [
        {
            "name": name or "(model)",
            "type": type(modules[name]).__name__,
            "params": own_parameters(modules[name]),
            "dtype": dtype,
        }
        for name, dtype in resolved.items()
    ]
    if found.trains:
        landings = plan(policy, model, device).landings
        for row, name in zip(rows, resolved, strict=True):
            row["lands"] = landings[name]
    if found.trains and not policy.optimizer_states.is_default:
        states = policy.optimizer_states.by_module(model)
        for row, name in zip(rows, resolved, strict=True):
            row["state"] = states.get(name, TrainingState()).describe()
    return rows


def share(
    policy: PolicyView,
    model: nn.Module,
    device: str | torch.device | Backend | None = None,
    mode: str | Mode | None = None,
    example: Any = None,
) -> float:
    """Share of the model's parameters below fp32 as ``mode`` resolves them
    (``Policy.low_precision_share``)."""
    resolved = mode_of(mode).resolve_policy(policy, model, device, example)
    return low_precision_share(model, resolved)


def _follows_uncast_input(
    policy: PolicyView, model: nn.Module, leaf_dtypes: dict[str, str], kind: str
) -> bool:
    """Whether a leaf the plan puts below fp32 runs in the dtype its input arrives in,
    uncast: under a uniform policy (plain autocast) a plan casts no such input, so what
    the leaf runs in depends on the layer before it, which the plan cannot tell."""
    if policy.rules:
        return False  # a policy with rules casts the inputs of each such leaf
    modules = dict(model.named_modules())
    return any(
        formats.get(dtype).autocasts
        and formats.get(dtype).low_precision
        and autocast_behaviour(kind, modules[name]) == "input"
        for name, dtype in leaf_dtypes.items()
    )


def _runner(example: Any, backend: Backend) -> Any:
    """``model -> outputs`` for an example batch, on the backend's device."""
    from autoprec.tasks.base import Batch

    batch = example if isinstance(example, Batch) else Batch.of(example)
    return batch.to(backend.device).run
