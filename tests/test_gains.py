"""The search's final line, on small real searches: a speed figure comes from the
side-by-side re-timing or says that it does not, and a win of fp32 says why and who came
closest."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoprec.report.gains import speed_words
from tests.test_cli import TASK_FILE


def _search(folder, study: str, *extra: str, task: str = "task.py:factory") -> tuple[str, dict]:
    args = ["--task", task, "--trials", "2", "--steps", "10", "--study", study]
    done = subprocess.run(
        [sys.executable, "-m", "autoprec.cli", "search", *args, "--no-progress", *extra],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    final = [line for line in done.stdout.splitlines() if line.startswith("best: ")]
    assert len(final) == 1, done.stdout
    return final[0], json.loads((folder / "runs" / study / "summary.json").read_text())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gains")
    (folder / "task.py").write_text(TASK_FILE)
    return folder


@pytest.mark.slow  # a whole search end to end: the everyday subset skips it
def test_speed_claims_come_from_the_side_by_side_timing(folder):
    # The built-in MLP, whose uniform fp16 the CPU runs slower than fp32 where it has no
    # fp16 kernels: the line says so; where fp16 wins, it says by how much side by side.
    line, summary = _search(folder, "speedy", "--confirm-top", "2", task="digits-mlp")
    confirmed = {
        str(row["number"]): row["metrics"]["confirmed_step_time_ms"]
        for row in [summary["baseline"], *summary["trials"]]
        if "confirmed_step_time_ms" in row["metrics"]
    }
    assert "baseline" in confirmed and len(confirmed) >= 2
    best = str(summary["best"]["number"])
    assert "not re-timed" not in line
    if best == "baseline":  # fp32 wins: why, and how close the best re-timed policy came
        speedups = {k: confirmed["baseline"] / t for k, t in confirmed.items() if k != best}
        closest = max(speedups, key=speedups.get)
        assert "on this CPU" in line and "side by side" in line
        assert f"the closest, trial {closest}" in line
        assert f"was {speed_words(speedups[closest])}, accuracy " in line
    else:
        speedup = confirmed["baseline"] / confirmed[best]
        assert f"best: trial {best}" in line
        assert f"{speed_words(speedup)} side by side with fp32" in line


def test_a_memory_search_says_its_speed_was_not_retimed(folder):
    line, summary = _search(folder, "lean", "--prefer", "memory")
    assert summary["step_times_confirmed"] == []
    best = summary["best"]
    # On the CPU memory is an estimate from byte counts: the low-precision policy wins.
    assert best["number"] != "baseline"
    assert "side by side with fp32, " not in line  # no re-timed claim
    assert "speed not re-timed side by side with fp32 (--prefer memory re-times nothing)" in line
    own = summary["baseline"]["metrics"]["step_time_ms"] / best["metrics"]["step_time_ms"]
    assert line.endswith(f"{speed_words(own)} in the trials' own timing")
    assert "less memory" in line


@pytest.mark.slow
def test_fp32_chosen_because_low_precision_overflowed_says_so(folder):
    """The shipped overflow task: uniform fp16 overflows in the forward pass, whatever
    the machine's speed."""
    line, summary = _search(folder, "overflowing", "--trials", "1", task="digits-overflow")
    assert summary["best"]["number"] == "baseline"
    trial = summary["trials"][0]
    assert trial["state"] == "pruned" and "overflow" in trial["reason"]
    assert line.startswith("best: the fp32 baseline - no low-precision trial finished (1 pruned)")
    assert f"trial 0 (uniform-fp16) was pruned: {trial['reason']}" in line


def _table_keys(stdout: str) -> set[str]:
    """The trial column of the printed table (rows up to its notes)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["trial", "accuracy"])
    keys = set()
    for line in lines[start + 1 :]:
        cells = line.split()
        if not cells or cells[:2] == ["*", "chosen"]:
            break
        keys.add(cells[1] if cells[0] == "*" else cells[0])
    return keys


def test_the_closest_the_last_line_names_is_in_the_table(folder):
    """issue 28: the closing line named "the closest, trial 4", which the table did not
    show. Through the CLI: whatever trial the line names is a row of the table; and where
    that trial is off the Pareto front, the table still shows it, and says why."""
    import re
    from dataclasses import replace

    from autoprec.report import front_table
    from autoprec.report.gains import closest_entry, gains_line
    from autoprec.study.summary_schema import Best, Summary

    args = ["--task", "task.py:factory", "--trials", "3", "--steps", "10", "--study", "named"]
    done = subprocess.run(
        [sys.executable, "-m", "autoprec.cli", "search", *args, "--no-progress"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _table_keys(done.stdout)
    for named in re.findall(r"the closest, trial (\d+)", done.stdout):
        assert named in rows, done.stdout

    summary = Summary.from_json(json.loads((folder / "runs/named/summary.json").read_text()))
    summary = replace(summary, best=Best.of(summary.baseline, 1.0, 0.0))  # fp32 chosen
    closest = closest_entry(summary)
    assert closest is not None and not closest.is_baseline
    off_front = replace(
        summary,
        trials=[replace(t, pareto=False) if t.key == closest.key else t for t in summary.trials],
    )
    table = front_table(off_front)
    assert f"the closest, {closest.name}" in gains_line(off_front)
    assert str(closest.key) in _table_keys(table)
    assert f"and {closest.name}, the closest" in table
