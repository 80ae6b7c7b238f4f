"""A policy as a Lightning precision plugin: ``Trainer(plugins=[PolicyPrecision(policy)])``.

The plugin applies the policy's regions to the LightningModule (or to the searched model it
holds, `autoprec.precision._placement`), runs every step (training, validation, test,
predict) in the policy's autocast, scales the loss, unscales gradients before Lightning clips
them, skips the optimizer step when they overflowed, and carries the loss-scale state in the
checkpoint.
`PolicyFabricPrecision` does the same for Fabric.

``PolicyPrecision(policy, guard=Guard())`` (or a policy with a ``guard:`` section) guards the
run (`autoprec.guard`): a low-precision layer at risk is promoted at a step boundary, a step
that fails where loss scaling does not explain it rolls the weights, the optimizers' state,
the loss scaler and the LR schedulers back to the guard's last copy and promotes the culprit,
and the guard's state (its changes, hence the promoted policy) rides in the checkpoint.
Lightning draws the batches itself, so a rollback here does not replay the lost steps: the
run goes on with the next batch, and the guard's step count falls behind
``trainer.global_step`` by the steps undone. `GuardCallback` logs the changes and prints the
guard's summary when training ends.

Master weights stay fp32, so the plugin reports Lightning's ``precision="32-true"``. Written
for the ``lightning`` package (2.2 or later), single-device strategies; DDP is expected to work
(the regions sit on the module that DDP wraps) but was not run, and FSDP and DeepSpeed, which
bring precision plugins of their own, are not supported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoprec._util.structures import cast_floats
from autoprec.errors import GuardError
from autoprec.guard.changes import Change
from autoprec.guard.precision import GuardedPrecision
from autoprec.guard.settings import Guard
from autoprec.policy import Policy
from autoprec.precision.hooks import Precision

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import Precision as LightningPrecision
    from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info
except ImportError:
    raise ImportError(
        "autoprec.integrations.lightning needs the lightning package: "
        "pip install 'autoprec[lightning]'"
    ) from None


class _Applied:
    """The policy, the module it is applied to (``submodule``: the dotted name of the part it
    lands on, None to find it), and its Precision while applied.

    Loss-scale state that arrives before the policy is applied (a checkpoint restored early)
    or outlives its removal (a teardown between ``fit`` and ``test``) is kept here, so that
    the scale goes on where it was."""

    def __init__(
        self,
        policy: Policy,
        submodule: str | None,
        emulate: tuple[str, ...],
        guard: Guard | bool | None = None,
    ) -> None:
        self.policy = policy
        self.submodule = submodule
        self.emulate = emulate
        self.guard = guard
        self.module: nn.Module | None = None
        self.precision: Precision | None = None
        self.state: dict[str, Any] | None = None

    def keep(self, module: nn.Module) -> None:
        if self.module is not module:
            self.remove()
            self.module = module

    def apply(self) -> Precision:
        """Apply the policy once, on the device the module's parameters are on now."""
        if self.precision is None:
            if self.module is None:
                raise ValueError("the policy has no module to apply to: set the module up first")
            self.precision = self.policy.apply(
                self.module, module=self.submodule, emulate=self.emulate, guard=self.guard
            )
            if self.state is not None:
                self.precision.load_state_dict(self.state)
        return self.precision

    def remove(self) -> None:
        if self.precision is not None:
            self.state = self.precision.state_dict()
            self.precision.remove()
            self.precision = None

    def state_dict(self) -> dict[str, Any]:
        if self.precision is not None:
            return self.precision.state_dict()
        return dict(self.state or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state
        if self.precision is not None:
            self.precision.load_state_dict(state)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        # What Precision.backward back-propagates (in fp32, the scale updated first), for a
        # framework that calls backward itself; the scale is 1.0 without loss scaling.
        precision = self.apply()
        precision.note_loss(loss)
        return loss.float() * precision.loss_scale

    def track(self, schedulers: list[Any]) -> None:
        """The LR schedulers a guard's rollback restores with the weights."""
        self.apply().track(*schedulers)

    def check_step_arguments(self, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(
                f"optimizer.step({', '.join(kwargs)}=...): a policy with loss scaling steps the "
                "optimizer itself and takes no step arguments"
            )


class PolicyPrecision(LightningPrecision):
    """Trains a LightningModule under an autoprec policy; pass it as ``plugins=[...]`` and
    leave ``Trainer(precision=...)`` out (Lightning refuses both at once).

    The policy lands on the submodule it was found on (the searched model, ``self.net``),
    found by its rules; ``module="net"`` names it where several submodules fit. ``emulate``:
    as in ``Policy.apply`` (``("fp8",)`` runs fp8 layers on the CPU, emulated). ``guard``: as
    in ``Policy.apply`` (a `Guard`, True for its defaults, None for the policy's own
    ``guard:`` section, False for none); a rollback restores and promotes but does not replay
    (the module's docstring)."""

    def __init__(
        self,
        policy: Policy,
        module: str | None = None,
        emulate: tuple[str, ...] = (),
        guard: Guard | bool | None = None,
    ) -> None:
        super().__init__()
        self._applied = _Applied(policy, module, emulate, guard)
        self._skipping_step = False

    def __repr__(self) -> str:
        return f"PolicyPrecision(policy={self._applied.policy.name or 'unnamed'!r})"

    @property
    def policy(self) -> Policy:
        return self._applied.policy

    @property
    def applied(self) -> Precision | None:
        """The policy's Precision while a run is on (a `GuardedPrecision` when guarded), None
        between runs. (Lightning's own ``precision`` attribute is its precision string.)"""
        return self._applied.precision

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling), also between runs."""
        if self._applied.precision is not None:
            return self._applied.precision.loss_scale
        state = self._applied.state_dict()
        if state:
            return float(state["loss_scaler"]["scale"])
        settings = self.policy.loss_scale
        return float(settings.init_scale) if settings.enabled else 1.0

    def convert_module(self, module: nn.Module) -> nn.Module:
        # Strategy.setup calls this before it moves the module to its device, and `connect`
        # after: the policy is applied there, so on CUDA the regions are CUDA autocast regions
        # (the order is Lightning's; only the CPU was run).
        self._applied.keep(module)
        return module

    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        # `model` may be the DDP wrapper; the regions go on the LightningModule kept above.
        if self._applied.module is None:
            self._applied.keep(model)
        self._applied.apply()
        self._applied.track([config.scheduler for config in lr_schedulers])
        return model, optimizers, lr_schedulers

    def forward_context(self) -> contextlib.AbstractContextManager:
        precision = self._applied.precision
        return precision.autocast() if precision is not None else contextlib.nullcontext()

    # Lightning's own pytorch Precision narrows fabric's signatures (the module, the
    # optimizer, the closure) the same way, with the same ignore.
    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        # Scaled here rather than in pre_backward, so on_before_backward sees the true loss.
        super().backward(self._applied.scaled(tensor), model, optimizer, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward, backward), unscale, let Lightning clip the true gradients,
        then step unless they overflowed; the scale is updated once per iteration (in manual
        optimization, with several optimizers, when the next backward begins)."""
        if not self.policy.loss_scale.enabled:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("LBFGS needs a closure per step and cannot be used with loss scaling")
        self._applied.check_step_arguments(kwargs)
        precision = self._applied.apply()
        closure_result = closure()
        # A training_step that returned None skipped backward: nothing to unscale or step
        # (as Lightning's MixedPrecision does).
        self._skipping_step = closure_result is None and model.automatic_optimization
        try:
            if not self._skipping_step:
                precision.unscale_(optimizer)
            self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, clipping
        finally:
            skipped, self._skipping_step = self._skipping_step, False
        if skipped:
            return closure_result
        precision.step(optimizer)
        if model.automatic_optimization:
            precision.update()
        return closure_result

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # In manual optimization self.clip_gradients comes before optimizer.step: unscale
        # first (a no-op when optimizer_step has unscaled already).
        if clip_val > 0 and not self._skipping_step:
            self._applied.apply().unscale_once_(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def state_dict(self) -> dict[str, Any]:
        return self._applied.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._applied.load_state_dict(state_dict)

    def teardown(self) -> None:
        """Take the regions off at the end of each fit/validate/test/predict; the next run
        applies the policy again, with the loss scale where it was."""
        self._applied.remove()


class PolicyFabricPrecision(FabricPrecision):
    """The same for Fabric: ``Fabric(plugins=[PolicyFabricPrecision(policy)])``, one module.

    Fabric moves the module after ``convert_module`` and has no hook after that, so the policy
    is applied at the first forward (or backward), on the module's device then. Fabric saves
    no precision state by itself: put the plugin in the state, ``fabric.save(path, {...,
    "precision": plugin})``, and ``fabric.load`` restores it. ``module``: as in
    `PolicyPrecision`."""

    def __init__(
        self, policy: Policy, module: str | None = None, emulate: tuple[str, ...] = ()
    ) -> None:
        super().__init__()
        self._applied = _Applied(policy, module, emulate)

    def __repr__(self) -> str:
        return f"PolicyFabricPrecision(policy={self._applied.policy.name or 'unnamed'!r})"

    @property
    def policy(self) -> Policy:
        return self._applied.policy

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling)."""
        return self._applied.apply().loss_scale

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self._applied.module is not None and self._applied.module is not module:
            raise ValueError(
                "PolicyFabricPrecision applies its policy to one module: set up only one"
            )
        self._applied.keep(module)
        return module

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self._applied.module is None:
            return contextlib.nullcontext()
        return self._applied.apply().autocast()

    def convert_output(self, data: Any) -> Any:
        """The model's floating outputs in fp32 (containers kept), as Fabric's
        MixedPrecision hands them back: a loss computed without ``.float()`` is fp32."""
        return cast_floats(data, torch.get_default_dtype())

    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        self._applied.scaled(tensor).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # Fabric's clip_gradients calls this first, so clipping sees true gradients.
        self._applied.apply().unscale_(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step unless the gradients overflowed (the scale is updated when the next backward
        begins, once for all optimizers stepped in between); returns whether it stepped."""
        if not self.policy.loss_scale.enabled:
            return super().optimizer_step(optimizer, **kwargs)
        self._applied.check_step_arguments(kwargs)
        return self._applied.apply().step(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self._applied.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._applied.load_state_dict(state_dict)

    def teardown(self) -> None:
        self._applied.remove()


class GuardCallback(pl.Callback):
    """Reports a guarded `PolicyPrecision`'s work: each change the guard makes is logged to
    the Trainer's loggers (the metrics ``guard/changes`` and ``guard/rollbacks``, counts so
    far, at the step the change was seen; the guard itself logs each change's line on the
    ``autoprec`` logger), and when training ends the guard's summary is printed on
    Lightning's console log. ``changes`` and ``summary`` keep the last fit's after the plugin
    has taken its regions off.

    The guard's state needs no callback: the plugin's state, which Lightning saves in every
    checkpoint, holds it, and a run resumed from one continues with the promoted policy."""

    def __init__(self) -> None:
        self.changes: list[Change] = []
        self.summary = ""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guarded = _guarded(trainer)
        # A resumed run's earlier changes came with its checkpoint: not news to log again.
        self.changes = [] if guarded is None else list(guarded.changes)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._report(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guarded = _guarded(trainer)
        if guarded is None:
            return
        self.summary = guarded.summary()  # closes the last step first
        self._report(trainer)
        rank_zero_info(self.summary)

    def _report(self, trainer: pl.Trainer) -> None:
        guarded = _guarded(trainer)
        if guarded is None or len(guarded.changes) == len(self.changes):
            return
        self.changes = list(guarded.changes)
        counts = {
            "guard/changes": float(len(self.changes)),
            "guard/rollbacks": float(guarded.rollbacks),
        }
        for logger in trainer.loggers:
            logger.log_metrics(counts, step=trainer.global_step)


def _guarded(trainer: pl.Trainer) -> GuardedPrecision | None:
    plugin = trainer.precision_plugin
    if not isinstance(plugin, PolicyPrecision):
        raise GuardError(
            f"GuardCallback reports a guarded PolicyPrecision; this Trainer's precision plugin "
            f"is {type(plugin).__name__}: pass plugins=[PolicyPrecision(policy, guard=Guard())]"
        )
    precision = plugin.applied
    return precision if isinstance(precision, GuardedPrecision) else None
