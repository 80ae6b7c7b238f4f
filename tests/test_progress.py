"""The progress bar, with real searches: it shows each mode's own time for the best so far
(latency when serving, step time when training), and nothing a display does wrong stops
or kills a study."""

from __future__ import annotations

import json
import subprocess
import sys

import mlflow
import pytest

import autoprec
from autoprec.progress import Progress, duration
from autoprec.study import Callbacks


def _parent_status(folder, study: str) -> str:
    summary = json.loads((folder / "runs" / study / "summary.json").read_text())
    client = mlflow.MlflowClient(f"sqlite:///{folder / 'runs' / 'mlflow.db'}")
    return client.get_run(summary["mlflow_parent_run_id"]).info.status


def _best_postfix(stderr: str) -> str:
    """The bar's last "best ..." figures."""
    assert "best " in stderr, stderr
    return stderr.rsplit("best ", 1)[1].split("]", 1)[0]


@pytest.mark.slow  # the README test's quick runs check the same bar
def test_the_serving_bar_shows_the_latency_of_the_best(in_tmp, capsys):
    config = autoprec.SearchConfig(
        trials=2, steps=12, device="cpu", mode="serving", scenario="edge", confirm_top=0
    )
    autoprec.search("digits-mlp", config=config, callbacks=Progress(enabled=True))
    shown = _best_postfix(capsys.readouterr().err)
    assert ": latency " in shown and " ms, " in shown and " MB, acc " in shown
    assert _parent_status(in_tmp, "digits-mlp-edge") == "FINISHED"


@pytest.mark.slow  # the README test's quick runs check the same bar
def test_the_training_bar_shows_the_step_time_of_the_best(in_tmp, tiny_task, capsys):
    config = autoprec.SearchConfig(trials=2, steps=6, device="cpu", confirm_top=0)
    autoprec.search(tiny_task, config=config, callbacks=Progress(enabled=True))
    shown = _best_postfix(capsys.readouterr().err)
    assert ": step " in shown and " ms, " in shown and " MB, acc " in shown


class _Broken(Callbacks):
    """A display with a bug in every trial event."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def trials_start(self, progress):
        raise AttributeError("no such figure")

    def trial_end(self, record, progress):
        raise AttributeError("no such figure")

    def warning(self, message: str) -> None:
        self.warnings.append(message)


def test_a_broken_display_never_stops_or_kills_a_study(in_tmp, tiny_task):
    config = autoprec.SearchConfig(trials=2, steps=6, device="cpu", study="tiny", confirm_top=0)
    broken = _Broken()
    result = autoprec.search(tiny_task, config=config, callbacks=broken)
    assert len(result.summary["trials"]) == 2
    assert _parent_status(in_tmp, "tiny") == "FINISHED"
    # One warning per broken event, not one per call.
    assert sorted(w.split(" failed", 1)[0] for w in broken.warnings) == [
        "_Broken.trial_end",
        "_Broken.trials_start",
    ]
    # Continuing the finished study runs the display again: the study stays FINISHED.
    again = _Broken()
    autoprec.search(tiny_task, config=config, callbacks=again)
    assert [w.split(" failed", 1)[0] for w in again.warnings] == ["_Broken.trials_start"]
    assert _parent_status(in_tmp, "tiny") == "FINISHED"


def test_ctrl_c_in_a_display_still_stops_the_search(in_tmp, tiny_task):
    class CtrlC(Callbacks):
        def trial_end(self, record, progress):
            raise KeyboardInterrupt

    config = autoprec.SearchConfig(trials=3, steps=6, device="cpu", study="tiny", confirm_top=0)
    with pytest.raises(KeyboardInterrupt):
        autoprec.search(tiny_task, config=config, callbacks=CtrlC())


def test_callbacks_are_reachable_as_the_docs_write_them():
    """``class Log(autoprec.Callbacks)`` in a fresh process, as the docs' Python API page
    (docs/python-api.md) writes it; and ``autoprec.search`` is the function that runs one."""
    code = (
        "import autoprec\n"
        "class Log(autoprec.Callbacks):\n"
        "    pass\n"
        "from autoprec.study import search\n"
        "assert autoprec.search is search\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_search_says_how_long_it_will_take_and_what_it_took(in_tmp, tiny_task, capsys):
    """Before the first trial, the estimate from the baseline's trial; in the bar, the time
    left from the trials so far; at the end, what it took (the CLI's closing line)."""
    progress = Progress(enabled=True)
    config = autoprec.SearchConfig(trials=3, steps=6, device="cpu", confirm_top=0)
    result = autoprec.search(tiny_task, config=config, callbacks=progress)
    err = capsys.readouterr().err
    baseline_s = result.summary["baseline"]["metrics"]["run_time_s"]
    each = f"{baseline_s:.1f}"
    estimate = f"estimate: ~{duration(3 * baseline_s)} for 3 trials (baseline {each} s a trial)"
    assert estimate in err.splitlines(), err
    assert err.index(estimate) < err.index("search:")  # before the first trial
    assert " left, best " in err  # the bar, while trials are left
    assert progress.estimate_s == pytest.approx(3 * baseline_s)
    took = progress.took(result.summary["phase_time_s"])
    assert took.startswith("took: ") and f"(estimated ~{duration(3 * baseline_s)})" in took
    # A continued study with every trial measured has nothing left to estimate.
    again = Progress(enabled=False)
    autoprec.search(tiny_task, config=config, callbacks=again)
    assert "estimate:" not in capsys.readouterr().err
    assert again.estimate_s is None


def test_durations_read_as_a_person_reads_them():
    assert [duration(s) for s in (0.4, 40.2, 59.6, 200, 3599, 3700)] == [
        "0 s",
        "40 s",
        "1 min 00 s",
        "3 min 20 s",
        "59 min 59 s",
        "1 h 01 min",
    ]
