"""What ``Policy.apply`` returns: the hooks a training loop calls.

```python
prec = policy.apply(model, device="cuda")
with prec.autocast():
    out = model(x)
loss = loss_fn(out.float(), y)
prec.backward(loss)            # scales the loss if the policy says so
stepped = prec.step(optimizer)  # unscale, skip on overflow, update the scale
```

Master weights stay fp32: nothing converts the model; autocast casts on the fly. The
outer region is one ``torch.autocast`` over the whole forward; modules whose dtype
differs get a region of their own, installed by replacing their ``forward`` with a
thin wrapper. An fp32 region casts its floating-point inputs up and disables autocast,
so an fp32 layer really runs in fp32 inside an fp16 or bf16 region. A uniform policy
installs no wrapper at all and costs what plain ``torch.autocast`` costs.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoprec.devices import DTYPES, Backend
from autoprec.scaling import LossScaler

if TYPE_CHECKING:
    from autoprec.policy import Plan, Policy


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple | list):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class _Region:
    """A module's forward run in its own dtype, whatever region surrounds it.

    An fp32 region casts its inputs up. A low-precision region inside fp32 surroundings
    casts its outputs up, since the fp32 layers after it run without autocast."""

    def __init__(self, forward: Any, device_type: str, dtype: str, around: str) -> None:
        self.forward = forward
        self.device_type = device_type
        self.dtype = dtype
        self.upcast_outputs = dtype != "fp32" and around == "fp32"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.dtype == "fp32":
            args, kwargs = _cast_floats((args, kwargs), torch.float32)
            with torch.autocast(self.device_type, enabled=False):
                return self.forward(*args, **kwargs)
        with torch.autocast(self.device_type, dtype=DTYPES[self.dtype]):
            outputs = self.forward(*args, **kwargs)
        return _cast_floats(outputs, torch.float32) if self.upcast_outputs else outputs


class Precision:
    """Forward context, backward, optimizer step and checkpoint state for one policy."""

    def __init__(self, model: nn.Module, policy: Policy, backend: Backend, plan: Plan) -> None:
        self.model = model
        self.policy = policy
        self.backend = backend
        self.plan = plan
        self.scaler = LossScaler(policy.loss_scale)
        self._previous_switches = backend.set_switches(policy.tf32, policy.hf32)
        self.switches = backend.switches()
        modules = dict(model.named_modules())
        self._installed: list[tuple[nn.Module, Any]] = []
        for name, dtype in plan.regions:
            module = modules[name]
            previous = module.__dict__.get("forward")
            module.forward = _Region(module.forward, backend.kind, dtype, plan.outer_dtype)
            self._installed.append((module, previous))

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling)."""
        return self.scaler.scale

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The outer region for the forward pass (and the loss, which runs in fp32 anyway)."""
        if self.plan.outer_dtype == "fp32" and not self.plan.regions:
            return contextlib.nullcontext()
        return self.backend.autocast(self.plan.outer_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss.float()).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale gradients in place before clipping them; True if any overflowed."""
        return self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, step unless gradients overflowed, update the scale. Returns whether it
        stepped."""
        stepped = self.scaler.step(optimizer)
        self.scaler.update()
        return stepped

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["loss_scaler"])

    def remove(self) -> None:
        """Take the regions off the model and restore the device switches."""
        for module, previous in self._installed:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._installed.clear()
        self.backend.restore_switches(self._previous_switches)
