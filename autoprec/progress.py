"""The command line's view of a running search: a progress bar and one line per phase,
on stderr (the results go to stdout)."""

from __future__ import annotations

import sys
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


class Progress(Callbacks):
    """The search's progress on stderr: a tqdm bar with trial n of N, the best so far and
    the ETA, and one line for each phase around it."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.bar: Any = None

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

    def trials_start(self, progress: Standing) -> None:
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
        )
        self._show_best(progress)

    def trial_end(self, record: TrialRecord, progress: Standing) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self._show_best(progress)

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

    def _show_best(self, progress: Standing) -> None:
        best = best_record(progress.records, progress.baseline, progress.prefer)
        self.bar.set_postfix_str(f"best {best.number}: {best_figures(best.result)}")


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
