"""Compiled trials: a trial's model under ``torch.compile``, its graph breaks counted and
its compile time kept apart from its step time.

Float8 layers are fast only compiled (torchao's casts and scales fuse into the matmuls),
so a search may ask for every trial to run compiled (``autoprec search --compile``, or
``Task(compile=True)``), whatever its policy: fp32, autocast regions with their casts and
hooks, fp16 with the loss scaler, fp8 layers. What is compiled is the model's call (its
forward and the backward AOTAutograd derives from it), as torchao's and torchtitan's
users compile it; the loss, the scaler and the optimizer step run as the user's loop runs
them. A compiled trial records:

- ``compile_s``: the wall time of the steps during which torch.compile compiled (the first
  compiled step, and any step that compiled again); the step time leaves them out;
- ``graph_breaks``: the graph breaks Dynamo counted while compiling the trial's model
  (``torch._dynamo.utils.counters["graph_break"]``, read before and after; a model that
  compiles again counts its breaks again).

Each trial starts from an empty compile cache (`fresh_compiler`), so that its compile time
and its breaks are its own rather than a cache hit of the trial before (inductor's code
caches on disk stay, as they do between a user's runs).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

# How many distinct reasons a report keeps (their first lines): enough to say what broke.
MAX_BREAK_REASONS = 5


@dataclass(frozen=True)
class CompileReport:
    """What compiling a trial's model cost, and how whole it compiled."""

    graph_breaks: int  # as Dynamo counted them over the trial's compilations
    compile_s: float  # wall time of the steps that compiled
    compiling_steps: int  # how many steps compiled (1 unless something recompiled)
    break_reasons: tuple[str, ...] = ()  # the first line of each distinct reason


@dataclass
class StepWatch:
    """Whether torch.compile compiled during one step (known when the step has ended)."""

    compiled: bool = False


def fresh_compiler() -> None:
    """Empty Dynamo's cache of compiled frames, so that what compiles next compiles anew."""
    torch._dynamo.reset()


def _counters() -> tuple[int, Counter[str]]:
    """Frames Dynamo compiled so far, and its graph breaks by reason (process totals)."""
    counters = torch._dynamo.utils.counters
    return int(counters["frames"]["total"]), Counter(counters["graph_break"])


class Compilation:
    """A trial's model as its steps call it: under ``torch.compile`` when ``enabled``,
    else the model itself, with the compile time and graph breaks of its steps.

    ``eager`` steps (telemetry's, whose hooks would break the graph) call the model
    itself; a compiled step is watched (`step`) to tell whether it compiled. ``fresh``:
    empty the compile cache first (a side-by-side timing makes its candidates without,
    after emptying it once)."""

    def __init__(
        self,
        model: nn.Module,
        enabled: bool,
        now_s: Callable[[], float],
        fresh: bool = True,
    ) -> None:
        self.eager = model
        self.enabled = enabled
        self._now_s = now_s
        if enabled and fresh:
            fresh_compiler()
        self.module: nn.Module = torch.compile(model) if enabled else model  # type: ignore[assignment]
        self._frames_at_start, self._breaks_at_start = _counters()
        self.compile_s = 0.0
        self.compiling_steps = 0

    def forward_model(self, eager: bool = False) -> nn.Module:
        """What a step calls: the compiled model, or the model itself (``eager``)."""
        return self.eager if eager or not self.enabled else self.module

    @contextlib.contextmanager
    def step(self) -> Iterator[StepWatch]:
        """Watch one step: if torch.compile compiled during it, its wall time (device
        synchronised) is compile time, and ``compiled`` says so."""
        watch = StepWatch()
        if not self.enabled:
            yield watch
            return
        frames, _ = _counters()
        started_s = self._now_s()
        yield watch
        if _counters()[0] != frames:
            watch.compiled = True
            self.compile_s += self._now_s() - started_s
            self.compiling_steps += 1

    def report(self) -> CompileReport | None:
        """The compile time and the graph breaks so far (None: not compiled)."""
        if not self.enabled:
            return None
        _, breaks = _counters()
        new = breaks - self._breaks_at_start
        reasons = tuple(reason.strip().splitlines()[0] for reason in new)
        return CompileReport(
            graph_breaks=sum(new.values()),
            compile_s=self.compile_s,
            compiling_steps=self.compiling_steps,
            break_reasons=tuple(dict.fromkeys(reasons))[:MAX_BREAK_REASONS],
        )
