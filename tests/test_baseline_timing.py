"""The fp32 baseline is timed on a quiet process: the MLflow writer's first work (the store
made, the parent run and the profile logged) is done before the baseline's steps run, rather
than beside them, where it takes a core from torch's threads."""

from __future__ import annotations

import pytest

import autoprec
from autoprec import tracking
from autoprec.trials import training
from tests.contract_tasks import make_tiny_task

pytestmark = pytest.mark.slow  # a real search

STEPS = 20  # more than the warm-up's steps (2x the untimed 5, plus 2), which run first


def test_the_baseline_is_timed_with_the_mlflow_writer_idle(in_tmp, monkeypatch):
    trackers: list[tracking.Tracker] = []
    made = tracking.Tracker.__init__

    def keep(self, *args, **kwargs):
        made(self, *args, **kwargs)
        trackers.append(self)

    runs: list[tuple[int, int]] = []
    run_trial = training.run_trial

    def spy(task, policy, backend, budget, *args, **kwargs):
        pending = sum(t._jobs.unfinished_tasks for t in trackers)
        runs.append((budget.steps, pending))
        return run_trial(task, policy, backend, budget, *args, **kwargs)

    monkeypatch.setattr(tracking.Tracker, "__init__", keep)
    monkeypatch.setattr(training, "run_trial", spy)
    result = autoprec.search(
        make_tiny_task(), trials=1, steps=STEPS, study="quiet", device="cpu", confirm_top=0
    )
    assert trackers, "the search wrote no MLflow runs"
    measured = [pending for steps, pending in runs if steps == STEPS]
    assert len(measured) >= 2  # the baseline first, then the trial
    assert measured[0] == 0, f"{measured[0]} MLflow writes queued beside the baseline"
    assert result.summary["baseline"]["metrics"]["step_time_ms"] > 0
