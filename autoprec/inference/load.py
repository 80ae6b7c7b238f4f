"""A policy's served model: the fp32 model converted per layer as the policy says (the
conversion the serving trials measure, and `load_inference_model` for users)."""

from __future__ import annotations

import torch
from torch import nn

from autoprec.devices import Backend, get_backend
from autoprec.inference.convert import convert
from autoprec.policy import Policy, parameterised_leaves, share_of_parameters


def convert_policy(
    model: nn.Module, policy: Policy, backend: Backend, int8: str | None = None
) -> nn.Module:
    """``model`` converted for serving as ``policy`` says (a copy; see `convert`)."""
    return convert(model, policy.resolve_inference(model), backend, int8)


def low_precision_share(model: nn.Module, layer_dtypes: dict[str, str]) -> float:
    """Share of the model's parameters served below fp32 (leaves not named: fp32)."""
    served = {name: layer_dtypes.get(name, "fp32") for name, _ in parameterised_leaves(model)}
    return share_of_parameters(model, served)


def load_inference_model(
    model: nn.Module,
    policy: Policy,
    device: str | torch.device | Backend | None = None,
    int8: str | None = None,
) -> nn.Module:
    """``model`` (fp32, trained) converted for serving as ``policy`` says, in one call: a
    copy whose layers hold their weights in the policy's dtypes (int8 by ``int8``, default:
    the device's method), inputs cast at the boundaries, outputs in fp32. It computes what
    the serving search's trial of that policy computed.

    A policy's TF32 (CUDA) or HF32 (Ascend) switch is process-wide, so it is set here for
    the whole process, as the trial had it; a policy without one leaves the device as is."""
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else "cpu"
    backend = get_backend(device)
    backend.set_switches(policy.tf32, policy.hf32)
    return convert_policy(model, policy, backend, int8)
