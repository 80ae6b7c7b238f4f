"""What really runs, observed: the device tables in `autoprec.devices` are a first guess,
and one watched forward of the real model on a real batch replaces it.

Name lists cannot cover every module: transformers' own norms (``LlamaRMSNorm``,
``T5LayerNorm``) are plain ``nn.Module`` subclasses that upcast inside and return fp32,
and users write layers of their own. So `learn` runs each leaf with parameters alone, on
the inputs it received in one fp32 forward of the model, under autocast in each low dtype
the device supports: once with those inputs cast down and once as they came (fp32), each
run as a training step runs it (train mode, gradients on, forward and backward: oneDNN
builds other kernels for training than for inference, and which ones it has depends on the
CPU's instruction set). What its output's dtype is then tells how autocast treats the
module on this device kind; a module that runs only on inputs already cast (oneDNN's LSTM
on the CPU) always gets them cast, and a forward or backward that fails even so tells that
the dtype cannot run there: a policy that puts it there is refused before training
(`autoprec.policy`), with the kernel's reason. Where the low dtypes disagree, the
verdict that casts wins (`_PRECEDENCE`).
The findings are recorded per device kind and module class
(`autoprec.devices.record_behaviour`), so every fresh copy of the model, the plan, the
space and the profile follow the same rule.

Where autocast fails a module in a low dtype, its inputs cast or not, and a training step
of the module cast to that dtype (parameters and inputs, autocast off) runs, the dtype is
one its class lands in by cast (`autoprec.devices.record_cast`, `lands_by_cast`): the
plan then casts its parameters on the fly instead of refusing it.

Without a batch, `probe` runs each leaf class that neither the tables nor `learn` know
(torch's own the tables do not name, such as LSTM and GRU, and any other class) alone in
the same way, on an input made from its parameters (`synthesized_inputs`: a norm's weight
gives the input's last dim), and records what it finds beneath what `learn` watches
(`autoprec.devices.record_probed`); a module no input can be made for keeps the tables'
word.

`observed_dtypes` reads, for one policy, the dtype of each leaf's output in one forward
under that policy: the truth `Policy.resolve(model, device, example=batch)` reports, and
without a batch, where the plan cannot tell (a leaf that follows its uncast input), on an
input made up for the whole model (`synthesized_run`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.structures import map_tensors, tensors, to_device
from autoprec.devices import (
    DTYPES,
    Backend,
    autocast_behaviour,
    cast_dtypes,
    get_backend,
    learned_behaviour,
    record_behaviour,
    record_cast,
    record_failure,
    record_probed,
    table_behaviour,
    was_probed,
)
from autoprec.precision.plan import parameterised_leaves

if TYPE_CHECKING:
    from autoprec.precision.view import PolicyView
    from autoprec.tasks.base import Task

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def first_floating_dtype(output: Any) -> str | None:
    """The dtype name of the first floating tensor in a (nested) output, if any."""
    floating = _floats(output)
    return _NAMES.get(floating[0].dtype) if floating else None


def casts_inputs(kind: str, module: nn.Module, dtype: str, uniform: bool) -> bool:
    """Whether a plan casts the floating inputs of ``module`` (a leaf with parameters put
    in ``dtype``) to that dtype before it runs, on this device kind: always for a module
    that runs only on inputs already cast (an LSTM on the CPU), and for one that runs in
    its input's dtype (a norm on the CPU) unless the policy is ``uniform`` (plain
    autocast, which leaves its input as it arrives). The one rule the plan
    (`autoprec.policy.Policy.plan`) and the profile's deviation test both follow, so that
    the profile measures each module as a policy would run it."""
    if formats.get(dtype).reference:
        return False
    behaviour = autocast_behaviour(kind, module)
    return behaviour == "cast" or (behaviour == "input" and not uniform)


def lands_by_cast(kind: str, module: nn.Module, dtype: str) -> bool:
    """Whether a plan lands ``module`` in ``dtype`` by a cast on this device kind: its
    parameters (cast on the fly, the fp32 ones kept for the optimizer) and its floating
    inputs in the dtype, autocast off; where autocast was seen to fail it there, cast inputs
    or not, and such a cast to run (`learn`, `probe`). The one rule the plan and the
    profile follow."""
    return dtype in cast_dtypes(kind, module)


def _capture_inputs(
    model: nn.Module, run: Any, wanted: list[tuple[str, nn.Module]]
) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Each wanted leaf's first (args, kwargs), from one fp32 forward without gradients."""
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    handles = []
    for name, module in wanted:

        def hook(module: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            captured.setdefault(name, (args, kwargs))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), _evaluating(model):
            run(model)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def layer_inputs(model: nn.Module, run: Any) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Each leaf with parameters that ``run(model)`` calls, mapped to the (args, kwargs)
    it first received, from one fp32 forward without gradients (for `train_step`)."""
    return _capture_inputs(model, run, parameterised_leaves(model))


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode for a watched forward (no running statistics updated, no dropout drawn),
    then the mode the model was in."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def _behaviour(
    module: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]], kind: str, low: str
) -> str | None:
    """How autocast in ``low`` treats ``module`` on this device kind: ``fp32``, ``input``,
    ``cast`` or ``region`` (see `autoprec.devices.autocast_behaviour`); raises what running
    it in ``low`` with its inputs cast down raises (forward or backward). Both runs are
    training steps (`train_step`): a kernel that runs for inference but not for training
    (oneDNN's fp16 LSTM on some CPUs) must not decide how training runs it."""
    down = first_floating_dtype(train_step(module, inputs, kind, low, cast=True))
    if formats.known(down) and formats.get(str(down)).reference:
        return down  # "fp32": autocast keeps it in fp32
    try:
        given = first_floating_dtype(train_step(module, inputs, kind, low, cast=False))
    except Exception:  # runs only on inputs already cast: an LSTM on the CPU
        return "cast" if down == low else None
    if given == low:
        return "region"
    if down == low:
        return "input"
    return None


def train_step(
    module: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    kind: str,
    low: str,
    cast: bool,
    by_cast: bool = False,
) -> Any:
    """One forward and backward of a bare copy of ``module`` as a training step runs it:
    train mode, gradients on, floating inputs that require gradients (they come from
    earlier layers), under autocast in ``low``; ``cast``: with those inputs cast down
    first, as a region that casts its inputs hands them; ``by_cast``: with its parameters
    and inputs in ``low`` and autocast off, as a region that lands it by cast runs it
    (`lands_by_cast`). Returns the forward's outputs."""
    trial = _bare_copy(module).train()
    dtype = DTYPES[low]
    cast = cast or by_cast
    if by_cast:
        for parameter in trial.parameters():
            if parameter.is_floating_point():
                parameter.data = parameter.data.to(dtype)

    def leaf(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor
        tensor = tensor.detach().to(dtype) if cast else tensor.detach().clone()
        return tensor.requires_grad_(True)

    args, kwargs = map_tensors(leaf, inputs)
    with torch.enable_grad():
        with torch.autocast(kind, dtype=dtype, enabled=not by_cast):
            outputs = trial(*args, **kwargs)
        backward = [t for t in _floats(outputs) if t.requires_grad]
        if backward:
            torch.stack([t.float().sum() for t in backward]).sum().backward()
    return outputs


# Where the low dtypes disagree, the verdict that casts more wins: casting the inputs of a
# module that runs on cast inputs is always safe, leaving them uncast is not.
_PRECEDENCE = ("cast", "input", "region", "fp32")


def _combined(found: str | None, behaviour: str | None) -> str | None:
    candidates = [b for b in (found, behaviour) if b is not None]
    return min(candidates, key=_PRECEDENCE.index, default=None)


def _bare_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` without the hooks anyone put on it (theirs must not see the
    watched runs)."""
    trial = copy.deepcopy(module)
    for name in (
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
    ):
        hooks = getattr(trial, name, None)
        if hooks is not None:
            hooks.clear()
    return trial


def _floats(output: Any) -> list[torch.Tensor]:
    return [t for t in tensors(output) if t.is_floating_point()]


def _backend(device: str | torch.device | Backend | None) -> Backend:
    return device if isinstance(device, Backend) else get_backend(device or "cpu")


def _lows(backend: Backend) -> list[str]:
    low = [f for f in formats.all_formats() if f.autocasts and f.low_precision]
    low.sort(key=lambda f: -f.limits.range_bits)
    return [f.name for f in low if backend.supports(f.name)]


def _verdict(
    module: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    backend: Backend,
    failures: bool,
) -> str | None:
    """How autocast treats ``module`` run alone on ``inputs``, in each low dtype the
    backend supports (`_behaviour`, combined by `_PRECEDENCE`). A dtype autocast fails it
    in, its inputs cast or not, is recorded as one its class lands in by a cast where a
    training step of the module cast to it runs (`lands_by_cast`), else, with
    ``failures``, as one its class cannot run in."""
    found = None
    for low in _lows(backend):
        try:
            behaviour = _behaviour(module, inputs, backend.kind, low)
        except Exception as error:  # any failure of the library's kernel is the finding
            reason = f"{type(error).__name__}: {error}"
            if _runs(module, inputs, backend.kind, low):
                record_cast(backend.kind, type(module), low, reason)
            elif failures:
                record_failure(backend.kind, type(module), low, reason)
            continue
        found = _combined(found, behaviour)
    return found


def _runs(
    module: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]], kind: str, dtype: str
) -> bool:
    """Whether a training step of ``module`` with its parameters and inputs in ``dtype``,
    autocast off, runs on ``inputs`` (forward and backward)."""
    try:
        train_step(module, inputs, kind, dtype, cast=True, by_cast=True)
    except Exception:  # no kernel for this dtype, or not an input the module takes
        return False
    return True


def learn(model: nn.Module, run: Any, device: str | torch.device | Backend | None) -> None:
    """Watch ``run(model)`` (one forward on a real batch) and record, for each class of
    leaf with parameters not yet known on this device kind, how autocast treats it and
    which low dtypes cannot run it. ``model`` is left as it was."""
    backend = _backend(device)
    kind = backend.kind
    wanted = [
        (n, m) for n, m in parameterised_leaves(model) if learned_behaviour(kind, type(m)) is None
    ]
    if not wanted:
        return
    captured = _capture_inputs(model, run, wanted)
    for name, module in wanted:
        if name not in captured or learned_behaviour(kind, type(module)) is not None:
            continue
        found = _verdict(module, captured[name], backend, failures=True)
        if found is not None:
            record_behaviour(kind, type(module), found)


def probe(model: nn.Module, device: str | torch.device | Backend | None) -> None:
    """Record, for each leaf with parameters whose class neither a watched forward
    (`learn`) nor the tables know on this device kind (torch's own norms and embeddings
    are in the tables; its LSTM and GRU are not), how autocast treats it, without a
    batch: one module of each class and parameter dtypes runs alone on an input made from
    its parameters (`synthesized_inputs`), as `learn` runs a leaf on the inputs it
    received; so ``resolve`` without an example, ``apply`` and the plan know a norm that
    upcasts inside (transformers' RMSNorms, T5's LayerNorm) from one that follows its
    input (Gemma's). A module no input can be made for (a convolution of its own, one of
    several inputs) keeps the tables' word: the region's dtype. A low dtype a cast runs it
    in where autocast fails is recorded as one it lands in by cast; one that fails both
    ways, as one its class cannot run in, only where a training step in fp32 runs on the
    same made-up input (then the failure is the dtype's, and ``apply`` refuses it before
    anything runs). Runs only where the model's parameters are on the backend's device
    kind; ``model`` and the caller's random stream are left as they were."""
    backend = _backend(device)
    kind = backend.kind
    first = next(model.parameters(), None)
    if first is None or first.device.type != kind:
        return  # nothing runs on that device kind here
    with torch.random.fork_rng(devices=[]):
        for _, module in parameterised_leaves(model):
            if learned_behaviour(kind, type(module)) is not None or was_probed(kind, module):
                continue
            own = type(module).forward.__module__.startswith("torch.")
            if own and table_behaviour(kind, module) != "region":
                continue  # the tables name torch's own norms and embeddings
            inputs = synthesized_inputs(module)
            if inputs is None:
                record_probed(kind, module, None)
                continue
            # A dtype that fails where fp32 trains on the same input is the module's own.
            trains = _runs(module, inputs, kind, "fp32")
            record_probed(kind, module, _verdict(module, inputs, backend, failures=trains))


def synthesized_inputs(module: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A small fp32 input (batch 2, length 3) that ``module`` runs on, its last dim taken
    from the shape of its first parameter (a norm's weight; a Linear's or Conv1D's input
    features, tried as each of the weight's dims); None where none runs (a convolution, an
    embedding, a module that takes several inputs)."""
    weight = next(module.parameters(recurse=False), None)
    if weight is None:
        return None
    trial = _bare_copy(module).eval()
    generator = torch.Generator().manual_seed(0)
    for width in dict.fromkeys(reversed(weight.shape)):
        x = torch.randn(2, 3, width, generator=generator).to(weight.device)
        try:
            with torch.no_grad():
                output = trial(x)
        except Exception:  # not an input this module takes
            continue
        if first_floating_dtype(output) is not None:
            return (x,), {}
    return None


def synthesized_run(model: nn.Module) -> Any:
    """``model -> outputs`` on an input made up for the whole model, where one runs in one
    fp32 forward: transformers' ``dummy_inputs`` where the model has them, else the input
    `synthesized_inputs` makes for its first leaf with parameters; None where neither runs
    (the caller then keeps the plan's word)."""
    leaves = parameterised_leaves(model)
    first = next(model.parameters(), None)
    dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, dict) and first is not None:
        inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = ((), to_device(dummy, first.device))
    else:
        inputs = synthesized_inputs(leaves[0][1]) if leaves else None
    if inputs is None:
        return None
    args, kwargs = inputs

    def run(module: nn.Module) -> Any:
        return module(*args, **kwargs)

    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), _evaluating(model):
            run(model)
    except Exception:  # the model takes another input
        return None
    return run


def observed_dtypes(
    model: nn.Module,
    policy: PolicyView,
    run: Any,
    device: str | torch.device | Backend | None,
    module: str | None = None,
) -> dict[str, str]:
    """Each leaf with parameters that ``run(model)`` calls, mapped to the dtype of the
    first floating tensor it returns under ``policy`` (what forward hooks see)."""
    seen: dict[str, str] = {}
    handles = []
    for name, leaf in parameterised_leaves(model):

        def hook(leaf: nn.Module, args: Any, output: Any, name: str = name) -> None:
            dtype = first_floating_dtype(output)
            if dtype is not None:
                seen.setdefault(name, dtype)

        handles.append(leaf.register_forward_hook(hook))
    prec = policy.apply(model, device, module)
    try:
        with torch.no_grad(), _evaluating(model), prec.autocast():
            run(model)
    finally:
        prec.remove()
        for handle in handles:
            handle.remove()
    return seen


def watch_task(task: Task, model: nn.Module, backend: Backend) -> None:
    """`learn` from one forward of ``model`` (or a copy on the backend's device) on the
    task's first validation batch, so that the plan, the space and the profile know how
    autocast treats each of its layers there; the caller's random stream is kept. Where
    every leaf class is known on this device kind already (each trial after the first),
    no batch is drawn."""
    leaves = parameterised_leaves(model)
    if all(learned_behaviour(backend.kind, type(m)) is not None for _, m in leaves):
        return
    with torch.random.fork_rng(devices=[]):
        example = task.first_val_batch().to(backend.device)
        first = next(model.parameters(), None)
        on_device = first is None or first.device == backend.device
        probe = model if on_device else copy.deepcopy(model).to(backend.device)
        with backend.selected():
            learn(probe, example.run, backend)
