"""Bounded inputs: the real run's length (``--train-steps``) has a bound, and the
schedule is learnt in bounded memory; a full Optuna store stops the search in one line,
at once, rather than after a long wait for an outage to end; options that mean nothing
for the task are said so."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import autoprec
from autoprec.cli import main
from autoprec.errors import AutoprecError
from autoprec.study import _studies
from autoprec.trials.schedule import (
    MAX_LR_SAMPLES,
    MAX_TRAIN_STEPS,
    schedule_warning,
    trial_schedule_settings,
)
from tests.contract_tasks import make_tiny_task

REPO = Path(__file__).resolve().parents[1]

_AT_THE_BOUND = textwrap.dedent(
    f"""
    import json, sys
    sys.path.insert(0, {str(REPO)!r})
    import autoprec
    from autoprec.trials.schedule import learn_lr_shape, schedule_warning, MAX_TRAIN_STEPS
    from tests.contract_tasks import scheduled

    task = scheduled()
    model = task.model()
    shape = learn_lr_shape(task, model, MAX_TRAIN_STEPS, head=200)
    config = autoprec.SearchConfig(steps=10, train_steps=MAX_TRAIN_STEPS)
    print(json.dumps({{
        "rates": len(shape.lrs), "steps": shape.steps, "stride": shape.stride,
        "peak_step": shape.peak_step, "peak_lr": shape.peak_lr,
        "head_peak_lr": shape.head_peak_lr, "first": shape.lrs[0],
        "warning": schedule_warning(task, model, config),
    }}))
    """
)


def test_train_steps_at_its_bound_learn_the_schedule_in_bounded_memory():
    """A million scheduler steps: a few seconds, at most MAX_LR_SAMPLES rates kept; the
    peak and a trial's largest rate are exact all the same."""
    done = subprocess.run(
        [sys.executable, "-c", _AT_THE_BOUND],
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang, never a measured time
    )
    assert done.returncode == 0, done.stderr
    shape = json.loads(done.stdout)
    assert shape["steps"] == MAX_TRAIN_STEPS
    assert shape["rates"] <= MAX_LR_SAMPLES + 1 and shape["stride"] > 1
    # LambdaLR's warm-up: factor (step + 1) / 50, reaching 1 at step 49.
    assert shape["peak_step"] == 49 and shape["head_peak_lr"] == shape["peak_lr"]
    assert shape["first"] == pytest.approx(shape["peak_lr"] / 50)
    assert "warms up to" in shape["warning"] and "sees 20% of the warm-up" in shape["warning"]


def test_train_steps_past_the_bound_are_refused():
    autoprec.SearchConfig(train_steps=MAX_TRAIN_STEPS)
    with pytest.raises(AutoprecError, match=f"--train-steps {MAX_TRAIN_STEPS + 1}: at most"):
        autoprec.SearchConfig(train_steps=MAX_TRAIN_STEPS + 1)


def test_a_compressed_schedule_for_a_task_without_one_is_said_and_recorded_as_asked():
    """Its trials train as-is, but the study records what was asked: a continuation that
    asks otherwise is refused (tests/test_study_settings.py)."""
    task = make_tiny_task()
    config = autoprec.SearchConfig(steps=10, trial_schedule="compressed")
    warning = schedule_warning(task, task.model(), config)
    assert warning is not None and "has no learning-rate scheduler to compress" in warning
    assert trial_schedule_settings(config)["trial_schedule"] == "compressed"


def test_fp8_is_a_flat_serving_keyword_as_int8_is():
    config = autoprec.SearchConfig(mode="serving", fp8="off", int8="off")
    assert (config.serving.fp8, config.serving.int8) == ("off", "off")
    for keyword in ("fp8", "int8"):
        with pytest.raises(AutoprecError, match=f"--{keyword}: only with --mode serving"):
            autoprec.SearchConfig(**{keyword: "off"})


def test_a_full_optuna_store_stops_the_search_in_one_line(in_tmp, monkeypatch, capsys):
    """sqlite's own "database or disk is full" (a page limit on every connection, where
    the disk would fill): one line and exit 2, with no outage retried."""
    plain = _studies._sqlite_pragmas

    def full(connection, record):
        plain(connection, record)
        cursor = connection.cursor()
        pages = cursor.execute("PRAGMA page_count").fetchone()[0]
        cursor.execute(f"PRAGMA max_page_count = {pages}")
        cursor.close()

    monkeypatch.setattr(_studies, "_sqlite_pragmas", full)
    task = f"{REPO}/tests/contract_tasks.py:tiny"
    argv = ["search", "--no-progress", "--task", task, "--trials", "2", "--steps", "6"]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "the Optuna storage cannot be written" in err and "disk is full" in err, err
    assert "unreachable" not in err and "trying again" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("autoprec search: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
