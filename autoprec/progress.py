"""The command line's view of a running search: a progress bar and one line per phase,
on stderr (the results go to stdout)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from autoprec.errors import redact
from autoprec.profile.sensitivity import Profile
from autoprec.study._events import Callbacks
from autoprec.study._events import Progress as Standing
from autoprec.study._records import Result, TrialRecord
from autoprec.study.confirmation import ConfirmationCheck
from autoprec.study.summary import best_record


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# The bar: tqdm's own, with our estimate of the time left in its postfix instead of
# tqdm's (which counts the time since the bar opened, not the trials').
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


class Progress(Callbacks):
    """The search's progress on stderr: a tqdm bar with trial n of N, the time left and
    the best so far, and one line for each phase around it: the estimate of the trials'
    time before the first. ``started_s`` (`time.perf_counter`): when the command began,
    for `took`."""

    def __init__(self, enabled: bool = True, started_s: float | None = None) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.started_s = time.perf_counter() if started_s is None else started_s
        self.workers = 1
        self.estimate_s: float | None = None  # the trials' time, before the first

    def waiting(self, holder: str | None) -> None:
        _say(f"waiting for {holder} to set the study up (parent run, baseline) ...")

    def profiling(self) -> None:
        _say("profiling every layer's numerical risk ...")

    def profiled(self, profile: Profile, path: Path) -> None:
        top = ", ".join(f"{m.name} ({m.reason})" for m in profile.modules[:3])
        _say(f"riskiest: {top}; profile in {path}")

    def training_fp32(self, path: Path) -> None:
        _say(f"training the fp32 model once (kept as {path}) ...")

    def baseline(self) -> None:
        _say("running the fp32 baseline ...")

    def workers_started(
        self, workers: int, devices: list[str], cores: int, threads: int, kind: str
    ) -> None:
        where = (
            f"sharing {cores} CPU cores ({threads} thread{'s' if threads > 1 else ''} "
            "each; expect little gain past one worker per core)"
            if kind == "cpu"
            else "pinned to " + ", ".join(devices)
        )
        _say(f"{workers} workers, {where}")
        self.workers = workers

    def trials_start(self, progress: Standing) -> None:
        if progress.done < progress.total:
            self.estimate_s = progress.remaining_s(self.workers)
            _say(estimate_line(progress, self.workers))
        if not self.enabled:
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=progress.total,
            initial=progress.done,
            unit="trial",
            desc="search",
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format=BAR_FORMAT,
            postfix=self._postfix(progress),
        )

    def trial_end(self, record: TrialRecord, progress: Standing) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(self._postfix(progress), refresh=False)
            self.bar.update(1)  # drawn once, with the new figures

    def confirming(self, count: int) -> None:
        self._close()
        _say(f"timing the {count - 1} fastest policies and the baseline side by side ...")

    def confirmation_start(self, label: str, steps: int) -> None:
        self._close()
        _say(f"confirming {label} over {steps} steps ...")

    def confirmation_end(self, check: ConfirmationCheck) -> None:
        _say(f"  {check.line()}")

    def exhausted(self, done: int) -> None:
        _say("\nthe space seems exhausted: the sampler keeps proposing measured policies")

    def done(self, summary: dict[str, Any]) -> None:
        self._close()

    def warning(self, message: str) -> None:
        line = f"autoprec: warning: {redact(message)}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            _say(line)

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def took(self, phases_s: dict[str, float]) -> str:
        """The closing line: what the command took, of it the trial loop's part
        (summary.json's ``phase_time_s``), and what was estimated for it."""
        line = f"took: {duration(time.perf_counter() - self.started_s)}"
        if self.estimate_s is None:
            return line
        trials = duration(phases_s.get("trials", 0.0))
        return f"{line}, the trials {trials} (estimated ~{duration(self.estimate_s)})"

    def _postfix(self, progress: Standing) -> str:
        """The bar's figures: the time left, while trials are, and the best so far."""
        best = best_record(progress.records, progress.baseline, progress.prefer)
        left = progress.remaining_s(self.workers)
        shown = f"~{duration(left)} left, " if progress.done < progress.total else ""
        return shown + f"best {best.number}: {best_figures(best.result)}"


def estimate_line(progress: Standing, workers: int = 1) -> str:
    """What the trials left will take, before the first: from the baseline's trial, or
    in a continued study from the trials measured so far."""
    left = progress.total - progress.done
    trials = f"{left} trial{'s' if left != 1 else ''}"
    at_once = f", {workers} at a time" if workers > 1 else ""
    total = f"~{duration(progress.remaining_s(workers))}"
    each = f"{progress.trial_s:.1f} s a trial"
    if progress.done == 0:
        return f"estimate: {total} for {trials}{at_once} (baseline {each})"
    return f"estimate: {total} for the {trials} left{at_once} ({each} so far)"


def duration(seconds: float) -> str:
    """Seconds as a person reads them: ``40 s``, ``3 min 20 s``, ``1 h 05 min``."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def best_figures(result: Result) -> str:
    """The figures the bar shows for the best so far: the result's own time metric
    (latency when serving, step time when training), its memory and its accuracy."""

    def number(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    return (
        f"{result.TIME_LABEL} {number(result.time_ms, '.2f')} ms, "
        f"{number(result.peak_memory_mb, '.2f')} MB, "
        f"acc {number(result.accuracy, '.3f')}"
    )
