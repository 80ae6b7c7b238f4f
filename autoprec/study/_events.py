"""What a search reports while it runs: one method per event.

Subclass `Callbacks` and override what you need (each method does nothing here); the
CLI's progress bar and a worker's log are two such subclasses. Pass one to
``autoprec.search(..., callbacks=...)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autoprec.policy import Policy
    from autoprec.profile.sensitivity import Profile
    from autoprec.study._records import TrialRecord
    from autoprec.study.confirmation import ConfirmationCheck


@dataclass(frozen=True)
class Progress:
    """Where the study stands: ``done`` of ``total`` trials measured, every measured
    record, the fp32 baseline, and the preference the best is chosen by."""

    done: int
    total: int
    records: list[TrialRecord]
    baseline: TrialRecord
    prefer: str

    @property
    def trial_s(self) -> float:
        """Seconds a trial takes: the mean own time of the trials measured so far, or the
        fp32 baseline's before any."""
        times_s = [r.result.run_time_s for r in self.records]
        return sum(times_s) / len(times_s) if times_s else self.baseline.result.run_time_s

    def remaining_s(self, workers: int = 1) -> float:
        """Seconds the trials left will take, ``workers`` at a time, at `trial_s` each."""
        left = max(0, self.total - self.done)
        return -(-left // max(1, workers)) * self.trial_s


class Callbacks:
    """Events of a search, in the order they come."""

    def waiting(self, holder: str | None) -> None:
        """Another process holds the study's set-up lease; this one waits for it."""

    def profiling(self) -> None:
        """The sensitivity profile begins (once per study)."""

    def profiled(self, profile: Profile, path: Path) -> None:
        """The profile is done and written to ``path``."""

    def training_fp32(self, path: Path) -> None:
        """A serving search trains the fp32 model it converts (once per study, when no
        checkpoint was given) and keeps it at ``path``."""

    def baseline(self) -> None:
        """The fp32 baseline begins (once per study)."""

    def workers_started(
        self, workers: int, devices: list[str], cores: int, threads: int, kind: str
    ) -> None:
        """Worker processes were started on this host."""

    def trials_start(self, progress: Progress) -> None:
        """The trials begin (``progress.done`` may be above 0 in a continued study)."""

    def trial_start(self, number: int, policy: Policy) -> None:
        """A trial of this process begins training."""

    def trial_end(self, record: TrialRecord, progress: Progress) -> None:
        """A trial was measured and recorded (here or, with workers, elsewhere)."""

    def exhausted(self, done: int) -> None:
        """The sampler keeps proposing measured policies: the trials stop early."""

    def confirming(self, count: int) -> None:
        """``count`` policies (the baseline among them) are timed again side by side."""

    def confirmation_start(self, label: str, steps: int) -> None:
        """A long confirmation run (``--confirm-steps``) of ``label`` (or of ``fp32``, the
        reference trained as long) begins: ``steps`` steps."""

    def confirmation_end(self, check: ConfirmationCheck) -> None:
        """A candidate was confirmed over the long run: whether it held, and why not."""

    def done(self, summary: dict[str, Any]) -> None:
        """The summary is written."""

    def warning(self, message: str) -> None:
        """Something the user should know that does not stop the search (a tracking
        store that went away, say); logged to the ``autoprec`` logger here."""
        logging.getLogger("autoprec").warning(message)


class Guarded(Callbacks):
    """Another `Callbacks` whose errors never stop the search: a progress display or a
    user's callback that raises is reported once per event as a warning, and the study
    goes on (a broken display once crashed every serving search, and marked the parent
    run of a finished study KILLED). Ctrl-C and other non-``Exception`` errors pass."""

    def __init__(self, inner: Callbacks) -> None:
        self.inner = inner
        self.failed: set[str] = set()

    def _call(self, event: str, *args: Any) -> None:
        try:
            getattr(self.inner, event)(*args)
        except Exception as error:  # a user's callback must not stop the search
            if event in self.failed:
                return
            self.failed.add(event)
            name = type(self.inner).__name__
            self.warning(f"{name}.{event} failed ({error!r}); the search goes on")

    def warning(self, message: str) -> None:
        try:
            self.inner.warning(message)
        except Exception:  # the display cannot say it either: the log still can
            logging.getLogger("autoprec").warning(message)


def _guarded(event: str) -> Any:
    def call(self: Guarded, *args: Any) -> None:
        self._call(event, *args)

    call.__name__ = event
    call.__doc__ = getattr(Callbacks, event).__doc__
    return call


for _event in (name for name in vars(Callbacks) if not name.startswith("_")):
    if _event != "warning":
        setattr(Guarded, _event, _guarded(_event))
