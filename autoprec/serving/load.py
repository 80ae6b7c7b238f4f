"""A policy's served model for users: the fp32 model converted per layer as the policy
says, as the serving trials convert it (`autoprec.serving.conversion.convert_policy`)."""

from __future__ import annotations

import torch
from torch import nn

from autoprec.devices import Backend, get_backend
from autoprec.policy import Policy
from autoprec.serving.conversion import convert_policy


def load_served_model(
    model: nn.Module,
    policy: Policy,
    device: str | torch.device | Backend | None = None,
    int8: str | None = None,
) -> nn.Module:
    """``model`` (fp32, trained) converted for serving as ``policy`` says, in one call: a
    copy whose layers hold their weights in the policy's dtypes (int8 by ``int8``, default:
    the method the policy records, else the device's), inputs cast at the boundaries,
    outputs in fp32. It computes what the serving search's trial of that policy computed.

    A policy's TF32 (CUDA) or HF32 (Ascend) switch is process-wide, so it is set here for
    the whole process, as the trial had it; a policy without one leaves the device as is."""
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else "cpu"
    backend = get_backend(device)
    backend.set_switches(policy.tf32, policy.hf32)
    return convert_policy(model, policy, backend, int8)


# Its name before the serving mode had one name; still importable.
load_inference_model = load_served_model
