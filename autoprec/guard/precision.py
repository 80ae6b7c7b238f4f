"""`GuardedPrecision`: the `Precision` a guarded ``policy.apply`` returns.

The loop is the same loop (``prec.autocast()``, ``prec.backward(loss)``,
``prec.step(optimizer)``); the guard works at its step boundaries:

- **Watch.** Every ``check_every``-th step's first forward runs under the numerics
  watcher (`autoprec.numerics.telemetry.GradientMonitor`: every module's largest |output|
  and its share of subnormal outputs, fp8 layers' casts, one host transfer); other steps
  carry no hook and no host sync beyond the loss scaler's own. Gradients are guarded by
  the check every step makes (the scaler's, or the guard's own without scaling) and the
  rollback: a trend of theirs promotes nothing (the zoo's flushing gradients train on),
  and watching them cost as much as the rest of a watched step.
- **Promote.** After a watched step, the forecast is fitted again to what the run has
  shown so far (`autoprec.guard.changes.promotions`); a layer at risk within the horizon is
  promoted before the next forward: the regions are planned anew from the effective policy
  and installed on the same modules. The weights stay the fp32 master weights they were,
  the optimizers and their state are untouched, an fp8 layer's Linear comes back (its
  scales were per-step casts), and the loss scale carries on.
- **Roll back.** A step whose gradients were not finite where loss scaling does not explain
  it (the forward overflowed, the scale is at its floor, or nothing scales the loss)
  restores the last snapshot (`autoprec.guard.snapshot`), promotes the layer that first
  produced a non-finite value, and, where the loop draws its batches through
  ``prec.guarded(batches)``, trains the lost steps again on the same batches.
- **Record.** Every change (`autoprec.guard.changes.Change`) is kept in ``prec.changes``, in
  ``state_dict()`` (a resumed run continues with the promoted policy), logged on the
  ``autoprec`` logger, and in the active MLflow run where there is one (`record_to_mlflow`).

Without loss scaling the guard checks the gradients for inf and NaN before each step
(one host sync, the one GradScaler's ``step`` makes) and skips a step that has them, so
that no non-finite value ever reaches the weights.

Under DDP or FSDP2 every rank decides together: each check's promotions and each
failure's verdict are one all-reduce (the maximum) of a vector over the layers, so every
rank installs the same regions at the same step.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoprec.devices import Backend
from autoprec.errors import GuardError
from autoprec.guard.changes import (
    NARROW,
    PROMOTE,
    ROLLBACK,
    Change,
    fp8_promotions,
    horizon,
    inside_margin,
    owning_leaves,
    promoted_policy,
    promotions,
    widening,
)
from autoprec.guard.settings import WIDTH, Guard
from autoprec.guard.snapshot import Snapshot, SnapshotStore
from autoprec.numerics.forecast import RangeSeries, forecast
from autoprec.numerics.telemetry import GradientMonitor, first_nonfinite_layer
from autoprec.precision.hooks import Precision
from autoprec.precision.plan import Plan

if TYPE_CHECKING:
    from autoprec.precision.view import PolicyView

_log = logging.getLogger("autoprec")
# Watched points kept per layer: the trend is fitted to the recent run, on as many points as
# a trial's forecast has (autoprec.trials.training.TELEMETRY_POINTS, 30); the fit's cost
# grows with the count.
WINDOW = 32
REFIT_SHARE = 0.1  # the trends are refitted once the run has grown by a tenth (_fit_due)
_SERIES_LISTS = ("steps", "act_max", "act_subnormal")


class GuardedPrecision(Precision):
    """A `Precision` whose policy the guard may widen as the run goes (the module's
    docstring). ``policy`` is the effective policy, ``changes`` what changed so far."""

    checks_gradients = True

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        policy: PolicyView,
        backend: Backend,
        settings: Guard,
        replan: Callable[[PolicyView], Plan],
        placement: str = "",
    ) -> None:
        self.settings = settings
        self._replan = replan  # the plan of the effective policy on this model and device
        self._placement = placement  # the submodule the policy landed on ("": the model)
        self.base_policy = policy
        self.policy = policy
        self.changes: list[Change] = []
        self.step_count = 0  # optimizer steps finished: the guard's clock
        self.rollbacks = 0
        self.fitted_at: int | None = None  # the step of the last fit of the trends
        self.series = RangeSeries()
        self._monitor: GradientMonitor | None = None
        super().__init__(model, plan, policy.loss_scale, backend)
        self._store = SnapshotStore(settings.snapshot_dir)
        self._snapshot: Snapshot | None = None  # being taken: complete after the step
        self._snapshot_due = True  # the run's first step is its first copy
        self._optimizers: list[torch.optim.Optimizer] = []
        self._tracked: list[Any] = []
        self._recorded: list[Any] = []  # the batches drawn since the last copy
        self._replay: deque[Any] = deque()
        self._drawing = False  # the loop draws its batches through ``guarded``
        self._in_step = False
        self._forward_seen = False
        self._stepped_seen = False
        self._skipped = False
        self._failure: tuple[str, str] | None = None  # (layer, why) of this step's failure
        self._scale_used = self.scaler.scale
        self._losses: list[torch.Tensor] = []  # this step's (one per accumulated batch)
        # This step's inputs to the model, one per forward with gradients (as the losses).
        self._inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._input_hook = model.register_forward_pre_hook(self._keep_inputs, with_kwargs=True)

    # -- the hooks a loop calls ---------------------------------------------------------

    def convert_module(self, model: nn.Module) -> nn.Module:
        super().convert_module(model)
        # The watcher's module list follows the modules installed (fp8 layers swapped
        # in or out); the series it fills stays the run's.
        self._monitor = GradientMonitor(model)
        self._monitor.ranges = self.series
        return model

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        self._finish_step()
        if self._snapshot_due:
            self._begin_snapshot()
        self._in_step = True
        outer = super().autocast()
        if self._forward_seen or not self._checks_now or not torch.is_grad_enabled():
            return outer  # an evaluation's forward (no grad) is not the step's to watch
        self._forward_seen = True
        assert self._monitor is not None
        stack = contextlib.ExitStack()
        stack.enter_context(self._monitor.activations(self.step_count))
        stack.enter_context(outer)
        return stack

    def backward(self, loss: torch.Tensor) -> None:
        self.note_loss(loss)
        super().backward(loss)

    def note_loss(self, loss: torch.Tensor) -> None:
        """What `backward` keeps of the loss (a non-finite one means the forward overflowed),
        for a framework that back-propagates the scaled loss itself (Lightning, accelerate)."""
        self._finish_step()
        self._in_step = True
        self._losses.append(loss.detach())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale and step unless the gradients are not finite (checked here even without
        loss scaling); a failure loss scaling does not explain is diagnosed now, while the
        gradients and the unchanged weights are still there, and handled at the boundary."""
        self._in_step = True
        index = self._index_of(optimizer)
        if self._snapshot is not None:
            self._snapshot.add_optimizer(index, optimizer)
        if not self._stepped_seen:
            self._scale_used = self.scaler.scale
        if self.scaler.settings.enabled:
            stepped = self.scaler.step(optimizer)
        else:
            found = self.scaler.nonfinite(optimizer)
            if self.scaler.reduce_found_inf is None and _sharded(optimizer) and _several_ranks():
                found = bool(self._all_reduce_max([float(found)])[0])  # a shard's own inf
            stepped = not found
            if stepped:
                optimizer.step()
        self._update_pending = True
        if not stepped:
            self._skipped = True
            if self._failure is None:
                self._failure = self._diagnose(optimizer)
        self._stepped_seen = True
        return stepped

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state and the guard's: its clock, its changes (from which the
        effective policy is rebuilt) and the ranges it has watched. A checkpoint is a copy
        point: the guard's next snapshot is taken here, so that a run resumed from this
        checkpoint and the run that went on roll back alike."""
        self._finish_step()
        state = super().state_dict()
        state["guard"] = {
            "settings": self.settings.to_dict(),
            "step": self.step_count,
            "rollbacks": self.rollbacks,
            "fitted_at": self.fitted_at,
            "changes": [change.to_dict() for change in self.changes],
            "series": _series_state(self.series),
        }
        self._mark_snapshot()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        guard = state.get("guard")
        if guard is None:
            return  # an unguarded run's checkpoint: the guard starts watching here
        self.step_count = int(guard["step"])
        self.rollbacks = int(guard.get("rollbacks", 0))
        self.fitted_at = guard.get("fitted_at")
        self.changes = [Change.from_dict(c) for c in guard["changes"]]
        self.series = _series_from_state(guard["series"])
        self._reinstall()
        self._new_step()
        self._mark_snapshot()

    def remove(self) -> None:
        self._input_hook.remove()
        super().remove()

    # -- what the guard offers beyond the hooks -----------------------------------------

    def guarded(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches`` as they come, and after a rollback the batches of the lost steps
        again, in order, so that the loop trains them again under the promoted policy."""
        source = iter(batches)
        self._drawing = True
        try:
            while True:
                self._finish_step()
                if self._replay:
                    item = self._replay.popleft()
                else:
                    try:
                        item = next(source)
                    except StopIteration:
                        return
                self._recorded.append(item)
                yield item
        finally:
            self._drawing = False

    def track(self, *objects: Any) -> None:
        """Objects whose ``state_dict``/``load_state_dict`` a rollback restores with the
        weights (a learning-rate scheduler), so that the lost steps train again alike."""
        self._tracked.extend(objects)

    def current_policy(self) -> str:
        """The effective policy, the guard's promotions included, as YAML."""
        self._finish_step()
        return self.policy.to_yaml()

    @property
    def snapshot_bytes(self) -> int:
        """Host bytes the guard's copy holds (0 on disk or before the first)."""
        held = self._store.load() if self._store.path is None else None
        return 0 if held is None else held.nbytes

    def summary(self) -> str:
        """What the guarded run changed and why, one line each."""
        self._finish_step()
        head = (
            f"guard: {self.step_count} steps, checked every {self.settings.check_every}; "
            f"{len(self.changes)} change(s), {self.rollbacks} rollback(s)"
        )
        return "\n".join([head, *(f"  {change.describe()}" for change in self.changes)])

    # -- the step boundary --------------------------------------------------------------

    @property
    def _checks_now(self) -> bool:
        return self.step_count % self.settings.check_every == 0

    def _finish_step(self) -> None:
        """Close the step that ran since the last boundary: handle its failure, check the
        ranges where it was watched, and move the clock on."""
        if not (self._in_step and self._stepped_seen):
            return
        self.update()
        step = self.step_count
        if self._snapshot is not None:
            self._store.keep(self._snapshot)
            self._snapshot = None
        failure = self._agreed_failure(step)
        checked = self._checks_now and not self._skipped
        self._new_step()
        if failure is not None:
            self._roll_back(step, *failure)
            return
        self.step_count = step + 1
        if checked:
            self._check(step)
        if self.step_count % self.settings.snapshot_every == 0:
            self._mark_snapshot()

    def _new_step(self) -> None:
        """Forget what the step just closed saw: the next one starts clean."""
        self._in_step = self._forward_seen = self._stepped_seen = self._skipped = False
        self._failure = None
        self._losses.clear()
        self._inputs.clear()

    def _mark_snapshot(self) -> None:
        self._snapshot_due = True
        self._recorded.clear()

    def _begin_snapshot(self) -> None:
        self._snapshot_due = False
        self._snapshot = Snapshot(self.step_count, self.model, self.scaler.state_dict())
        for index, obj in enumerate(self._tracked):
            self._snapshot.add_tracked(index, obj.state_dict())

    def _check(self, step: int) -> None:
        """Fit the ranges watched so far and promote the layers at risk."""
        assert self._monitor is not None
        self._monitor.collect()  # this step's watched forward, in one transfer
        narrow = _narrow_series(self.series)
        leaf_dtypes = self.plan.leaf_dtypes
        found: list[Change] = []
        if narrow.steps and self._fit_due(step, narrow):
            self.fitted_at = step
            ahead = forecast(narrow, horizon(step, self.settings), step + 1)
            found = promotions(ahead, step, leaf_dtypes, self.settings)
        if self.plan.fp8_recipe is not None:
            found += fp8_promotions(self._monitor.fp8, step, leaf_dtypes, self.settings)
        found = self._agreed(found, step)
        if found:
            self._promote(found)

    def _fit_due(self, step: int, narrow: RangeSeries) -> bool:
        """Whether this check refits the trends: once the run has grown by ``REFIT_SHARE``
        since the last fit (every check early on), or where a layer's latest largest
        |output| is already inside the margin. A crossing projected at 2x the steps is seen
        by a fit at half of it at the latest, so fitting less often late in a run misses
        nothing the horizon shows; what comes faster than that is the rollback's."""
        since = step - (-1 if self.fitted_at is None else self.fitted_at)
        if since >= max(self.settings.check_every, REFIT_SHARE * step):
            return True
        return inside_margin(narrow, self.settings.margin_bits)

    def _agreed(self, found: list[Change], step: int) -> list[Change]:
        """This rank's promotions made every rank's: the widest target any rank chose for
        each leaf (one all-reduce); leaves only another rank chose come as one change."""
        if not _several_ranks():
            return found
        leaves = list(self.plan.leaf_dtypes)
        position = {leaf: i for i, leaf in enumerate(leaves)}
        codes = [0.0] * len(leaves)
        for change in found:
            for leaf in change.leaves:
                i = position[leaf]
                codes[i] = max(codes[i], WIDTH[change.to_dtype] + 1)
        agreed = self._all_reduce_max(codes)
        mine = {leaf for change in found for leaf in change.leaves}
        by_target: dict[str, list[str]] = {}
        for leaf, code in zip(leaves, agreed, strict=True):
            if code and leaf not in mine:
                target = next(d for d, w in WIDTH.items() if w + 1 == int(code))
                by_target.setdefault(target, []).append(leaf)
        for target, others in by_target.items():
            narrowest = min((self.plan.leaf_dtypes[leaf] for leaf in others), key=WIDTH.__getitem__)
            found.append(
                Change(
                    step,
                    PROMOTE,
                    others[0],
                    tuple(others),
                    narrowest,
                    target,
                    "another rank's headroom check",
                )
            )
        return found

    def _agreed_failure(self, step: int) -> tuple[str, str] | None:
        """This step's failure as every rank sees it: a failure on any rank is one on all,
        and the culprit is the one the lowest failing rank named (one all-reduce): ranks
        that diagnose their own inputs may name different layers, and each promoting its
        own would leave them in different regions."""
        if not self._skipped or not _several_ranks():
            return self._failure
        import torch.distributed as dist

        names = [name for name, _ in self.model.named_modules()]
        codes = [0.0] * (len(names) + 1)  # each a failing rank's (world - rank): MAX, lowest
        if self._failure is not None:
            codes[0] = float(dist.get_world_size() - dist.get_rank())
            if self._failure[0] in names:
                codes[1 + names.index(self._failure[0])] = codes[0]
        agreed = self._all_reduce_max(codes)
        if not agreed[0]:
            return None
        named = [name for name, code in zip(names, agreed[1:], strict=True) if code == agreed[0]]
        why = "another rank's step was not finite" if self._failure is None else self._failure[1]
        return (named[0] if named else "", why)

    def _all_reduce_max(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        device = self.backend.device if dist.get_backend() == "nccl" else torch.device("cpu")
        tensor = torch.tensor(values, dtype=torch.float32, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.cpu().tolist()

    def _diagnose(self, optimizer: torch.optim.Optimizer) -> tuple[str, str] | None:
        """Why this step's gradients were not finite, where loss scaling does not explain
        it, and which layer first produced a non-finite value (None: the scaler's
        ordinary back-off)."""
        finite = [bool(torch.isfinite(loss).all()) for loss in self._losses]
        broke_at = finite.index(False) if False in finite else None
        forward_broke = broke_at is not None
        if _several_ranks():  # every rank runs the diagnostic forward, or none does
            forward_broke = bool(self._all_reduce_max([float(forward_broke)])[0])
        settings = self.scaler.settings
        if forward_broke:
            why = "the loss was not finite: the forward overflowed, which loss scaling cannot help"
        elif not settings.enabled:
            why = "gradients were not finite and nothing scales the loss"
        elif settings.mode == "static" or self.scaler.at_floor:
            why = f"gradients were not finite at the loss scale's floor ({self._scale_used:g})"
        else:
            return None
        # Every rank runs the diagnostic forward where any broke (under FSDP2 it gathers).
        layer = (
            self._forward_culprit(-1 if broke_at is None else broke_at) if forward_broke else None
        )
        if layer is None:
            layer = _gradient_culprit(self.model, self.plan.leaf_dtypes, optimizer)
        return layer or "", why

    def _forward_culprit(self, index: int) -> str | None:
        """The first module whose output was not finite, on the step's ``index``-th inputs
        (the batch whose loss was not) again."""
        if not self._inputs:
            return None
        args, kwargs = self._inputs[min(index, len(self._inputs) - 1)]  # -1: the last
        model = self.model

        def run() -> None:
            with Precision.autocast(self):
                model(*args, **kwargs)

        was_training = model.training
        try:
            return first_nonfinite_layer(model, run)
        finally:
            model.train(was_training)

    def _keep_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled():
            self._inputs.append((args, kwargs))

    def _roll_back(self, step: int, layer: str, why: str) -> None:
        """Go back to the last copy, promote the culprit, and queue the lost batches."""
        snapshot = self._store.load()
        owner, owned = owning_leaves(layer, self.plan.leaf_dtypes)
        widened = widening(owned, self.plan.leaf_dtypes, self.settings)
        if snapshot is None or widened is None:
            narrowest = min(
                (self.plan.leaf_dtypes[leaf] for leaf in owned),
                key=WIDTH.__getitem__,
                default="fp32",
            )
            where = f"{layer} ({narrowest})" if layer else "no layer"
            raise GuardError(
                f"guard: step {step} failed ({why}) and cannot be mended: the first "
                f"non-finite value came from {where}, which the guard's promote "
                f"({', '.join(self.settings.promote)}) cannot widen"
            )
        if self.rollbacks >= self.settings.max_rollbacks:
            raise GuardError(
                f"guard: step {step} failed ({why}) after {self.rollbacks} rollbacks, "
                f"guard.max_rollbacks; the effective policy so far: prec.current_policy()"
            )
        narrowest, target, leaves = widened
        scaler_state = snapshot.restore(self.model, self._optimizers, self._tracked)
        self.scaler.load_state_dict(scaler_state)
        self._update_pending = False
        self.rollbacks += 1
        replayed = self._drawing
        if replayed:
            self._replay = deque([*self._recorded, *self._replay])
        self._recorded.clear()
        change = Change(
            step,
            ROLLBACK,
            layer or owner,
            leaves,
            narrowest,
            target,
            why,
            restored_step=snapshot.step,
            replayed=replayed,
        )
        self.step_count = snapshot.step
        _truncate(self.series, snapshot.step)
        self._promote([change])
        self._snapshot_due = True

    def _promote(self, found: list[Change]) -> None:
        self.changes.extend(found)
        self._reinstall()
        for change in found:
            _log.warning("autoprec guard: %s", change.describe())
        record_to_mlflow(self.changes)

    def _reinstall(self) -> None:
        """Plan the effective policy anew and install its regions on the same modules."""
        prefix = f"{self._placement}." if self._placement else ""
        self.policy = promoted_policy(self.base_policy, self.changes, prefix)
        self.plan = self._replan(self.policy)
        self.convert_module(self.model)

    def _index_of(self, optimizer: torch.optim.Optimizer) -> int:
        for index, known in enumerate(self._optimizers):
            if known is optimizer:
                return index
        self._optimizers.append(optimizer)
        return len(self._optimizers) - 1


def _sharded(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer steps sharded (FSDP2) gradients, whose inf only the rank
    holding that shard sees."""
    return any(
        hasattr(param.grad, "_local_tensor")
        for group in optimizer.param_groups
        for param in group["params"]
        if param.grad is not None
    )


def _gradient_culprit(
    model: nn.Module, leaf_dtypes: dict[str, str], optimizer: torch.optim.Optimizer
) -> str | None:
    """The low-precision leaf whose parameters' gradients are not finite, latest in the
    forward's order (the first the backward reached); any such leaf where none is low."""
    broken = []
    for name, module in model.named_modules():
        if name not in leaf_dtypes:
            continue
        for param in module.parameters(recurse=False):
            grad = param.grad
            if grad is not None and not bool(
                torch.isfinite(getattr(grad, "_local_tensor", grad)).all()
            ):
                broken.append(name)
                break
    low = [name for name in broken if WIDTH.get(leaf_dtypes[name], 3) < WIDTH["fp32"]]
    chosen = low or broken
    return chosen[-1] if chosen else None


def _narrow_series(series: RangeSeries) -> RangeSeries:
    """The layers whose outputs are held in a narrow dtype, their last ``WINDOW`` points
    (the series itself is cut to them too: a long run's memory stays bounded)."""
    narrow = RangeSeries()
    for layer in series.steps:
        for name in _SERIES_LISTS:
            del getattr(series, name)[layer][:-WINDOW]
        if series.dtypes.get(layer) in NARROW:
            for name in _SERIES_LISTS:
                getattr(narrow, name)[layer] = list(getattr(series, name)[layer])
            narrow.dtypes[layer] = series.dtypes[layer]
    return narrow


def _truncate(series: RangeSeries, step: int) -> None:
    """Drop the points observed at ``step`` or later: the steps a rollback undid."""
    for layer, steps in series.steps.items():
        keep = sum(1 for s in steps if s < step)
        for name in _SERIES_LISTS:
            del getattr(series, name)[layer][keep:]


def _series_state(series: RangeSeries) -> dict[str, Any]:
    """The series, its last ``WINDOW`` points a layer, as plain data for a checkpoint."""
    trimmed: dict[str, Any] = {"dtypes": dict(series.dtypes)}
    for name in _SERIES_LISTS:
        values = getattr(series, name)
        trimmed[name] = {layer: list(points[-WINDOW:]) for layer, points in values.items()}
    return trimmed


def _series_from_state(state: dict[str, Any]) -> RangeSeries:
    series = RangeSeries(dtypes=dict(state["dtypes"]))
    for name in _SERIES_LISTS:
        setattr(series, name, {layer: list(points) for layer, points in state[name].items()})
    return series


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def record_to_mlflow(changes: list[Change]) -> None:
    """The changes in the active MLflow run, where the program has one: each as an event
    (the metric ``guard.changes`` at its step, the whole list as ``guard/changes.json``)
    and a tag (``autoprec.guard``: the count and the last change). Nothing where MLflow is
    not imported: the guard never starts a run or imports MLflow itself."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None or not changes:
        return
    last = changes[-1]
    mlflow.log_metric("guard.changes", len(changes), step=last.step)
    mlflow.log_dict({"changes": [c.to_dict() for c in changes]}, "guard/changes.json")
    mlflow.set_tag("autoprec.guard", f"{len(changes)} change(s); last: {last.describe()}"[:4000])
