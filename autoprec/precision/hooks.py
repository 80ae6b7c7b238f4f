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
so an fp32 layer really runs in fp32 inside an fp16 or bf16 region. A module that
autocast does not cover (BatchNorm; LayerNorm and GroupNorm on the CPU) runs in the
dtype of its input, so in low precision it gets a region that casts its inputs down.
At every region's border, for any module (a user's own included), no floating input
enters in the other low dtype: a bf16 input of an fp16 region is cast up to fp32 there,
so that ``torch.cat``, ``stack`` or an add inside never meet fp16 beside bf16 (autocast
refuses them), and a low region's outputs leave in fp32 where its surroundings differ.
A module autocast cannot run in its dtype on this device, where a cast of it runs
(``RegionSpec.cast_parameters``), runs with autocast off, its inputs cast and its own
parameters read as their casts (`parameters_cast`): master weights stay fp32 there too.
Casts map over nested inputs and outputs (tuples, dicts, ``ModelOutput``) and keep
their container types. A uniform policy on a model without such modules installs no
wrapper at all and costs what plain ``torch.autocast`` costs.

fp8 layers are swapped for torchao's ``Float8Linear`` (`autoprec.formats.fp8`; same Parameters),
get no region of their own and run inside the region around them, as torchao's users run
them under one ``torch.autocast``; ``remove`` swaps the original Linear layers back.

Where the regions go is `autoprec.precision.plan.boundaries`' answer, the one serving's casts use
too, and `Precision` has the hooks every precision mode has (`PrecisionHooks`:
``convert_module``, ``forward_context``, ``convert_input``, ``convert_output``), as
serving's `autoprec.serving.conversion.ServingPrecision` has.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.structures import cast_floats, upcast_floats_except
from autoprec.devices import Backend
from autoprec.precision.loss_scale import LossScale
from autoprec.precision.plan import Plan
from autoprec.precision.scaling import LossScaler


@runtime_checkable
class PrecisionHooks(Protocol):
    """What every precision mode gives the code that runs a model (Lightning Fabric's
    precision plugins have the same shape): training's `Precision` and serving's
    `autoprec.serving.conversion.ServingPrecision`. A loop calls these and never asks which
    mode it is in."""

    def convert_module(self, model: nn.Module) -> nn.Module:
        """The model made to run in the mode's dtypes (training: regions installed in
        place; serving: a converted copy)."""
        ...

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """What the forward runs in."""
        ...

    def convert_input(self, data: Any) -> Any:
        """The inputs as the model's first layers take them."""
        ...

    def convert_output(self, data: Any) -> Any:
        """The outputs as the loss, the metric or a client takes them: floats in fp32."""
        ...


class Region:
    """A module's forward run in its own dtype, whatever region surrounds it.

    The rule at every border, for any module (a user's own included): no floating input
    enters in another low dtype than the region's. An fp32 region casts its floating
    inputs up and disables autocast. A low-precision region enters autocast in its dtype;
    with ``cast_inputs`` it casts its floating inputs to that dtype first (for modules that
    run in their input's dtype), and otherwise casts those in the other low dtype up to
    fp32 (lossless: a bf16 input of an fp16 region), which autocast then treats as it
    treats any fp32 tensor; so ``torch.cat``, ``stack`` or a residual add in the module
    never meet fp16 beside bf16 (autocast refuses them). fp32 inputs keep fp32's range
    (an additive mask at fp32's minimum stays finite). Where a low-precision region sits
    inside surroundings of another dtype (fp32, or the other low dtype), `Precision` casts
    its outputs up to fp32 with a forward hook, so that hooks on the module itself see
    what it computed.
    """

    def __init__(
        self,
        forward: Any,
        device_type: str,
        dtype: str,
        cast_inputs: bool,
        cast_parameters_of: nn.Module | None = None,
    ) -> None:
        self.forward = forward
        self.device_type = device_type
        self.dtype = dtype
        self.reference = formats.get(dtype).reference
        self.torch_dtype = formats.get(dtype).torch_dtype()
        self.cast_inputs = cast_inputs or self.reference or cast_parameters_of is not None
        self.cast_parameters_of = cast_parameters_of

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.cast_inputs:
            args, kwargs = cast_floats((args, kwargs), self.torch_dtype)
        else:
            args, kwargs = upcast_floats_except((args, kwargs), (self.torch_dtype,))
        if self.cast_parameters_of is not None:
            with (
                torch.autocast(self.device_type, enabled=False),
                parameters_cast(self.cast_parameters_of, self.torch_dtype),
            ):
                return self.forward(*args, **kwargs)
        if self.reference:
            with torch.autocast(self.device_type, enabled=False):
                return self.forward(*args, **kwargs)
        with torch.autocast(self.device_type, dtype=self.torch_dtype):
            return self.forward(*args, **kwargs)


@contextlib.contextmanager
def parameters_cast(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """The module's own floating parameters read as their casts to ``dtype`` while the
    block runs, as autocast casts a matmul's weight: the cast is differentiable, so the
    gradients reach the fp32 Parameters, which the optimizer, ``state_dict`` and the
    guard keep seeing. (An RNN re-reads its weights when they change: torch's
    ``_update_flat_weights``.)"""
    own = dict(module._parameters)
    for name, parameter in own.items():
        if parameter is not None and parameter.is_floating_point():
            module._parameters[name] = parameter.to(dtype)  # type: ignore[assignment]
    try:
        yield
    finally:
        module._parameters.update(own)


def _upcast_outputs(module: nn.Module, args: Any, outputs: Any) -> Any:
    return cast_floats(outputs, torch.float32)


def _upcast_last(module: nn.Module) -> list[Any]:
    """A forward hook that casts the module's outputs up to fp32, kept the last of its
    forward hooks on every call, so hooks the user registers later (before or after
    ``apply``) still see what the module computed."""
    upcast = module.register_forward_hook(_upcast_outputs)

    def keep_last(*_: Any) -> None:
        hooks = module._forward_hooks
        assert isinstance(hooks, OrderedDict)  # torch keeps hooks in order (nn.Module)
        hooks.move_to_end(upcast.id)

    return [upcast, module.register_forward_pre_hook(keep_last)]


class Installed:
    """Regions installed on a model's modules, removable in one call."""

    def __init__(self, model: nn.Module, plan: Plan, device_type: str) -> None:
        modules = dict(model.named_modules())
        self._forwards: list[tuple[nn.Module, Any]] = []
        self._hooks: list[Any] = []
        for spec in plan.regions:
            module = modules[spec.name]
            previous = module.__dict__.get("forward")
            owner = module if spec.cast_parameters else None
            module.forward = Region(
                module.forward, device_type, spec.dtype, spec.cast_inputs, owner
            )
            self._forwards.append((module, previous))
            if formats.get(spec.dtype).low_precision and spec.around != spec.dtype:
                # Surroundings of another dtype may not take these outputs (autocast's cat
                # refuses fp16 beside bf16): hand them on in fp32, which every region takes.
                self._hooks.extend(_upcast_last(module))

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        for module, previous in reversed(self._forwards):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._hooks.clear()
        self._forwards.clear()


class Precision:
    """Forward context, backward, optimizer step and checkpoint state for one policy.

    With several optimizers, call ``step`` for each: the loss scale is updated once per
    iteration, when the next ``backward`` begins (or on ``update()``, ``state_dict()`` or
    reading ``loss_scale``), as torch's GradScaler updates once after all of them."""

    # Whether ``step`` checks the gradients for inf and NaN and skips such a step even
    # without loss scaling (the guard's does); without it a loop must not step on them.
    checks_gradients = False

    def __init__(
        self, model: nn.Module, plan: Plan, loss_scale: LossScale, backend: Backend
    ) -> None:
        self.model = model
        self.backend = backend
        self.plan = plan
        self.scaler = LossScaler(loss_scale)
        self._previous_switches = backend.set_switches(plan.tf32, plan.hf32)
        self.switches = backend.switches()
        self._installed: Installed | None = None
        self._converted: list[Any] = []  # each conversion format's, with ``remove()``
        self.convert_module(model)
        self._update_pending = False

    def convert_module(self, model: nn.Module) -> nn.Module:
        """The plan's regions installed on ``model`` and its fp8 layers converted (in
        place: master weights stay fp32, autocast casts on the fly, torchao casts fp8
        layers' operands); ``Policy.apply`` has called it already."""
        self._take_off()
        self.model = model
        self._installed = Installed(model, self.plan, self.backend.kind)
        for name, layers in self.plan.converted.items():
            found = formats.get(name)
            recipe = self.plan.fp8_recipe if found.recipes else None
            self._converted.append(found.convert(model, list(layers), recipe))
        return model

    def _take_off(self) -> None:
        while self._converted:
            self._converted.pop().remove()
        if self._installed is not None:
            self._installed.remove()

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The outer region (`autocast`), under the name every precision mode shares."""
        return self.autocast()

    def convert_input(self, data: Any) -> Any:
        """Inputs go in as they are: autocast and the regions cast them where they run."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Floating outputs in fp32, as the loss is computed (container types kept)."""
        return cast_floats(data, torch.float32)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling)."""
        self.update()
        return self.scaler.scale

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The outer region for the forward pass (and the loss, which runs in fp32 anyway)."""
        if formats.get(self.plan.outer_dtype).reference and not self.plan.regions:
            return contextlib.nullcontext()
        return self.backend.autocast(self.plan.outer_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.update()
        self.scaler.scale_loss(loss.float()).backward()

    def note_loss(self, loss: torch.Tensor) -> None:
        """The loss `backward` would have seen, from a framework that back-propagates the
        scaled loss itself (Lightning, accelerate). A guarded precision keeps it (a
        non-finite loss means the forward overflowed); this one needs nothing of it."""

    def track(self, *objects: Any) -> None:
        """Objects (an LR scheduler) a rollback restores with the weights; only a guarded
        precision rolls back, so this one keeps none."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale gradients in place before clipping them; True if any overflowed."""
        return self.scaler.unscale_(optimizer)

    def unscale_once_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale unless this iteration did already: for integrations whose hooks unscale
        before the user's own clipping may ask again (``unscale_`` twice raises, as in torch)."""
        if not self.scaler.unscaled(optimizer):
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, and step unless gradients overflowed; returns whether it stepped. The
        scale is updated once all of this iteration's optimizers have stepped."""
        stepped = self.scaler.step(optimizer)
        self._update_pending = True
        return stepped

    def update(self) -> None:
        """Finish the iteration: adjust the loss scale after this iteration's steps (a
        no-op when no optimizer stepped since the last update)."""
        if self._update_pending:
            self._update_pending = False
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        self.update()
        return {"loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._update_pending = False
        self.scaler.load_state_dict(state["loss_scaler"])

    def remove(self) -> None:
        """Take the regions off the model, put its fp8 layers' Linear modules back and
        restore the device switches."""
        self._take_off()
        self.backend.restore_switches(self._previous_switches)
