"""A policy in transformers' Trainer: ``PolicyTrainer(policy=policy, model=..., args=...)``.

`PolicyTrainer` is a ``transformers.Trainer`` that applies the policy to the model, runs every
forward (training and evaluation) in the policy's autocast, scales the loss, unscales the
gradients before the Trainer clips them (``max_grad_norm``) and logs their norm, and skips the
optimizer step on overflow, and with it the LR scheduler's step. The loss-scale state is saved
in each checkpoint (``scaler.pt``) and loaded back on resume.

How: the Precision stands where accelerate keeps a GradScaler (``accelerator.scaler``), so that
accelerate scales the loss in ``accelerator.backward``, steps the optimizer through it and
reports a skipped step, on which the Trainer leaves the LR scheduler alone, and the Trainer
saves and loads it as it would a GradScaler. Tested with transformers 5 on the CPU, one
process; DDP is expected to work (the regions sit on the module DDP wraps) but was not run.
DeepSpeed and FSDP bring their own mixed precision and are not supported.

A policy's optimizer states (its ``optimizer`` section) reach the Trainer as
``optimizers=policy_optimizers(policy, model, args)``: ``policy.optimizer(model,
torch.optim.AdamW, ...)`` with the arguments' learning rate, betas, epsilon and weight decay.
`PolicyTrainer` builds it so itself where its policy names states and no optimizer is given.
The Trainer's own optimizer exempts biases and norms from weight decay; this one decays
every parameter (the same where ``weight_decay`` is 0). Where a Trainer ``optim`` string
builds the same optimizer, `autoprec.exports.trainer_optim` names it.

``PolicyTrainer(..., policy=policy, guard=Guard())`` (or a policy with a ``guard:`` section)
guards the run (`autoprec.guard`): a low-precision layer at risk is promoted at a step
boundary, and a step that fails where loss scaling does not explain it rolls the weights, the
optimizer's state, the loss scaler and the LR scheduler back to the guard's last copy and
promotes the culprit. ``trainer.precision`` is then the `GuardedPrecision`: its ``changes``
and ``summary()``. Each log entry carries ``guard_changes`` and ``guard_rollbacks`` (counts
so far), the guard's summary is printed when training ends, and its state rides in
``scaler.pt``, so that a resumed run continues with the promoted policy. The Trainer draws
the batches itself, so a rollback does not replay the lost steps: the run goes on with the
next batch, and the guard's step count falls behind ``state.global_step`` by the steps undone.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from autoprec.guard.precision import GuardedPrecision
from autoprec.guard.settings import Guard
from autoprec.policy import Policy
from autoprec.precision.hooks import Precision

try:
    import transformers
    from accelerate.optimizer import AcceleratedOptimizer
except ImportError:
    raise ImportError(
        "autoprec.integrations.transformers needs transformers and accelerate: "
        "pip install transformers accelerate"
    ) from None

# TrainingArguments that would add the Trainer's own mixed precision on top of the policy's.
REFUSED_ARGUMENTS = ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval")


def policy_optimizers(
    policy: Policy, model: nn.Module, args: Any
) -> tuple[torch.optim.Optimizer, None]:
    """``(optimizer, None)`` for ``Trainer(..., optimizers=...)``: the per-group optimizer
    the policy describes for ``model``, with the TrainingArguments' AdamW hyperparameters;
    the Trainer makes its LR scheduler over it."""
    optimizer = policy.optimizer(
        model,
        torch.optim.AdamW,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )
    return optimizer, None


class _PrecisionScaler:
    """A Precision behind the GradScaler methods that accelerate and the Trainer call."""

    def __init__(self, precision: Precision) -> None:
        self.precision = precision

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        # What Precision.backward back-propagates (in fp32, the scale updated first);
        # accelerate calls backward on it. The scale is 1.0 without loss scaling.
        self.precision.note_loss(loss)
        return loss.float() * self.precision.loss_scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.precision.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        if closure is not None:
            raise ValueError("optimizer.step(closure): a policy steps the optimizer without one")
        return self.precision.step(optimizer)

    def update(self) -> None:
        self.precision.update()

    def state_dict(self) -> dict[str, Any]:
        return self.precision.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state)


class PolicyTrainer(transformers.Trainer):
    """A Trainer that trains its model under an autoprec policy; every other argument is the
    Trainer's. ``precision`` is the applied `autoprec.Precision` (its ``loss_scale``, say).

    On a model that wraps the searched one, the policy lands on the submodule it was found
    on, found by its rules; ``module="model"`` names it where several submodules fit.
    ``guard``: as in ``Policy.apply`` (a `Guard`, True for its defaults, None for the
    policy's own ``guard:`` section, False for none); a rollback restores and promotes but
    does not replay (the module's docstring)."""

    def __init__(
        self,
        model: nn.Module | None = None,
        args: Any = None,
        *more: Any,
        policy: Policy,
        module: str | None = None,
        guard: Guard | bool | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(policy, Policy):
            raise ValueError(f"PolicyTrainer(policy=...): expected a Policy, got {policy!r}")
        refused = [name for name in REFUSED_ARGUMENTS if getattr(args, name, False)]
        if refused:
            raise ValueError(
                f"PolicyTrainer: TrainingArguments({refused[0]}=True) would add the Trainer's own "
                "mixed precision to the policy's; leave fp16, bf16, fp16_full_eval and "
                "bf16_full_eval off"
            )
        if getattr(args, "tf32", None) is not None and policy.tf32 is not None:
            raise ValueError(
                "PolicyTrainer: TF32 is set by both TrainingArguments(tf32=...) and the policy's "
                "switches; set it in one place"
            )
        if kwargs.get("model_init") is not None:
            raise ValueError(
                "PolicyTrainer: model_init builds a new model for each run, which the policy is "
                "not applied to; pass model=..."
            )
        super().__init__(model, args, *more, **kwargs)
        if self.args.n_gpu > 1:
            raise ValueError(
                "PolicyTrainer: DataParallel (several GPUs in one process) copies modules without "
                "the policy's regions; launch one process per GPU (torchrun)"
            )
        self.policy = policy
        # The Trainer has placed the model on args.device by now (unless a sharding backend
        # places it later): the regions and the autocast are for that device's kind.
        assert self.model is not None  # the Trainer refuses no model without a model_init
        self.precision = policy.apply(self.model, self.args.device, module=module, guard=guard)
        self.accelerator.scaler = _PrecisionScaler(self.precision)
        self._guard_tracks: Any = None  # the LR scheduler the guard restores on a rollback
        if isinstance(self.precision, GuardedPrecision):
            self.add_callback(_GuardSummary(self.precision))

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The policy's per-group optimizer where its policy names optimizer states and none
        was given (`policy_optimizers`); else the Trainer's own."""
        target = model if model is not None else self.model
        if self.optimizer is None and not self.policy.optimizer_states.is_default:
            assert target is not None  # the Trainer refuses no model without a model_init
            self.optimizer = policy_optimizers(self.policy, target, self.args)[0]
        return super().create_optimizer(model)  # type: ignore[no-any-return]

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """The Trainer's LR scheduler (made here, or given as ``optimizers=``), which a
        guard's rollback restores with the weights."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if scheduler is not self._guard_tracks:
            self.precision.track(scheduler)
            self._guard_tracks = scheduler
        return scheduler

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log entry; a guarded run's carries ``guard_changes`` and
        ``guard_rollbacks``, the guard's counts so far."""
        if isinstance(self.precision, GuardedPrecision):
            logs = {
                **logs,
                "guard_changes": len(self.precision.changes),
                "guard_rollbacks": self.precision.rollbacks,
            }
        super().log(logs, *args, **kwargs)

    def autocast_smart_context_manager(
        self, cache_enabled: bool | None = True
    ) -> contextlib.AbstractContextManager:
        """The policy's autocast, which the Trainer enters around every forward and loss."""
        return self.precision.autocast()

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """The Trainer's step (forward, scaled backward); after the last micro-batch of an
        optimizer step, the gradients are unscaled, so that clipping and the logged grad_norm
        see true gradients (accelerate unscales only for its own fp16 mode)."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            optimizer = self.optimizer
            while isinstance(optimizer, AcceleratedOptimizer):
                optimizer = optimizer.optimizer
            assert optimizer is not None  # created before the first step
            self.precision.unscale_(optimizer)
        return loss


class _GuardSummary(transformers.TrainerCallback):
    """Prints the guard's summary (`GuardedPrecision.summary`) when training ends."""

    def __init__(self, precision: GuardedPrecision) -> None:
        self.precision = precision

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        summary = self.precision.summary()  # closes the last step first
        if state.is_world_process_zero:
            print(summary)
