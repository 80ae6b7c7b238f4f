"""One numerics watcher: hooks that count what flows through a model's modules.

`Watcher` owns the mechanism that telemetry and the profile share: forward hooks on
every module but the root (with keyword arguments, so that inputs can be seen), tensor
hooks on module outputs for the gradients that reach them (tensor hooks, so that an
in-place operation after a module, such as ``ReLU(inplace=True)``, still works), a pass
over the parameter gradients of the leaves that hold parameters (a parameter shared by
two modules counted once), and which modules ran.

What is counted is the caller's business: a `Counts` maps one tensor (or, for
``calls``, one module call) to a vector of counts computed on its device without a
host sync. The vectors wait until `Watcher.collect`, which moves them all to the host in
one transfer and adds them to ``totals`` per (module, kind), ``latest`` keeping the
collect's own for per-step series: one transfer per observed step, however many modules
and tensors were counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from autoprec._util.structures import tensors
from autoprec.precision.plan import parameterised_leaves

# The kinds of totals: a module's floating inputs (positional and keyword), its floating
# outputs, the gradients that reach those outputs, its parameters' gradients, and whole
# calls (the module's arguments and output together).
INPUT = "input"
OUTPUT = "output"
OUTPUT_GRAD = "output_grad"
PARAM_GRAD = "param_grad"
CALL = "call"


@dataclass(frozen=True)
class Counts:
    """How one kind of value is counted. ``count`` returns a 1-D float64 vector on the
    device of what it counts, without a host sync: from one tensor, or for ``calls`` from
    one module call's ``(args, kwargs, output)``. The columns in ``maxima`` accumulate as
    the largest value seen, the others as sums."""

    count: Callable[..., torch.Tensor]
    maxima: Collection[int] = frozenset()


class Watcher:
    """Per-(module, kind) totals of the counts that callers ask for, gathered by hooks and
    moved to the host in one transfer per `collect`.

    ``modules`` are the watched modules (all but the root), ``leaves`` those whose
    parameter gradients are counted, ``ran`` the names of the modules that ran inside a
    `forward` block, and ``totals`` maps (module name, kind) to the accumulated vector.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = [(n, m) for n, m in model.named_modules() if m is not model]
        self.leaves = parameterised_leaves(model)
        self.ran: set[str] = set()
        self.totals: dict[tuple[str, str], list[float]] = {}
        # This collect's own counts (one observed step's), merged as the totals are.
        self.latest: dict[tuple[str, str], list[float]] = {}
        self._pending: list[tuple[str, str, torch.Tensor, Counts]] = []

    @contextlib.contextmanager
    def forward(
        self,
        *,
        outputs: Counts | None = None,
        output_grads: Counts | None = None,
        inputs: Counts | None = None,
        calls: Counts | None = None,
    ) -> Iterator[None]:
        """Count, for every module that runs in this block, its calls, its floating
        inputs, its floating outputs and the gradients that reach those outputs (when the
        backward pass runs, in the block or after it)."""

        def hook(name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            self.ran.add(name)
            with torch.no_grad():
                if calls is not None:
                    self._pending.append((name, CALL, calls.count(args, kwargs, output), calls))
                if inputs is not None:
                    for tensor in tensors((args, kwargs)):
                        self._add(name, INPUT, tensor, inputs)
                for tensor in tensors(output):
                    if outputs is not None:
                        self._add(name, OUTPUT, tensor, outputs)
                    if output_grads is not None and tensor.requires_grad:
                        tensor.register_hook(
                            partial(self._add, name, OUTPUT_GRAD, counts=output_grads)
                        )

        handles = [
            module.register_forward_hook(partial(hook, name), with_kwargs=True)
            for name, module in self.modules
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def parameter_gradients(self, counts: Counts) -> None:
        """Count the parameter gradients of the leaves that hold parameters, a parameter
        shared by two modules once (under the first)."""
        seen: set[int] = set()
        for name, module in self.leaves:
            for param in module.parameters(recurse=False):
                if param.grad is not None and id(param) not in seen:
                    seen.add(id(param))
                    grad = getattr(param.grad, "_local_tensor", param.grad)  # a shard's
                    self._add(name, PARAM_GRAD, grad, counts)

    def count(self, name: str, kind: str, tensor: torch.Tensor, counts: Counts) -> None:
        """Count one tensor under (``name``, ``kind``) from a caller's own hook (fp8
        telemetry), so that it reaches the host in the same transfer as the rest."""
        self._add(name, kind, tensor, counts)

    def _add(self, name: str, kind: str, tensor: torch.Tensor, counts: Counts) -> None:
        """Count one tensor under (``name``, ``kind``), if it is floating and not empty."""
        if tensor.is_floating_point() and tensor.numel():
            with torch.no_grad():
                self._pending.append((name, kind, counts.count(tensor), counts))

    def collect(self) -> list[tuple[str, str]]:
        """Move the pending count vectors to the host in one transfer and add them to
        ``totals``; return the (module, kind) keys that changed, in order of first count."""
        if not self._pending:
            self.latest = {}
            return []
        vectors = [vector for _, _, vector, _ in self._pending]
        device = next((v.device for v in vectors if v.device.type != "cpu"), vectors[0].device)
        same_device = [v if v.device == device else v.to(device) for v in vectors]
        values = torch.cat(same_device).double().cpu().tolist()
        self.latest = {}
        offset = 0
        for name, kind, vector, counts in self._pending:
            row = values[offset : offset + vector.numel()]
            offset += vector.numel()
            for merged in (self.totals, self.latest):
                total = merged.get((name, kind))
                if total is None:
                    merged[(name, kind)] = list(row)
                    continue
                for i, value in enumerate(row):
                    total[i] = max(total[i], value) if i in counts.maxima else total[i] + value
        self._pending.clear()
        return list(self.latest)
