"""The command line: a task written only against the contract, and every kind of bad
input answered with one line and exit status 2, leaving the stores as they were."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from autoprec.cli import main

TASK_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn
    import autoprec

    def factory():
        g = torch.Generator().manual_seed(3)
        x = torch.randn(600, 12, generator=g)
        y = (x[:, :3].sum(dim=1) > 0).long()

        def train_data(seed):
            gen = torch.Generator().manual_seed(seed)
            while True:
                order = torch.randperm(500, generator=gen)
                for i in range(0, 500 - 50 + 1, 50):
                    yield x[order[i:i + 50]], y[order[i:i + 50]]

        return autoprec.Task(
            name="file-task",
            model=lambda: nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 2)),
            train_data=train_data,
            val_data=lambda: [(x[500:], y[500:])],
            loss=nn.functional.cross_entropy,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        )

    def short():
        task = factory()
        task.train_data = lambda seed: [(torch.randn(50, 12), torch.zeros(50).long())] * 3
        return task
    """
)


def _run(*args, cwd):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "autoprec.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A folder where a search with a task from a file has already run."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "task.py").write_text(TASK_FILE)
    done = _run(
        "search",
        "--task",
        "task.py:factory",
        "--trials",
        "6",
        "--steps",
        "40",
        "--no-progress",
        cwd=folder,
    )
    assert done.returncode == 0, done.stderr
    return folder, done


def _snapshot(folder):
    runs = folder / "runs"
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(runs.rglob("*"))
        if p.is_file()
    }


def test_search_with_a_task_file(project):
    folder, done = project
    summary = json.loads((folder / "runs/file-task/summary.json").read_text())
    assert len(summary["trials"]) == 6
    assert summary["settings"]["task"] == "file-task"
    assert summary["settings"]["space"] == "default"  # fits any model
    assert "best:" in done.stdout and "best_policy.yaml" in done.stdout
    assert "Traceback" not in done.stderr


def test_best_prints_the_policy(project, capsys, monkeypatch):
    folder, _ = project
    monkeypatch.chdir(folder)
    assert main(["best", "--study", "file-task", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    stored = json.loads((folder / "runs/file-task/summary.json").read_text())["best"]["policy"]
    assert printed == stored


def _write(folder, name, text):
    (folder / name).write_text(text)
    return name


BAD_SPACES = {
    "dtype.yaml": (
        "groups:\n- {name: all, patterns: ['*'], dtypes: [fp32, fp4]}\n",
        "unknown dtype 'fp4'",
    ),
    "pattern.yaml": ("groups:\n- {name: enc, patterns: [encoder]}\n", "matches no module"),
    "broken.yaml": ("groups: [\n", "not valid YAML"),
}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        *[
            (["search", "--task", "task.py:factory", "--space", name], msg)
            for name, (_, msg) in BAD_SPACES.items()
        ],
        (["search", "--task", "no_such_module:factory"], "cannot import no_such_module"),
        (["search", "--task", "missing.py:factory"], "no such file missing.py"),
        (["search", "--task", "task.py:nothere"], "has no attribute 'nothere'"),
        (["search", "--task", "digits"], "expected a built-in name"),
        (["search", "--task", "task.py:short", "--steps", "40"], "train_data ran out after 3"),
        (["search", "--task", "task.py:factory", "--device", "cuda"], "no CUDA device"),
        (["search", "--task", "task.py:factory", "--device", "tpu"], "unknown device"),
        (["search", "--task", "task.py:factory", "--trials", "0"], "--trials"),
        (["search", "--task", "task.py:factory", "--steps", "1"], "steps"),
        (["search", "--task", "task.py:factory", "--storage", "redis://x"], "--storage"),
        (["search", "--task", "task.py:factory", "--tracking-uri", "ftp://x"], "--tracking-uri"),
        (["search", "--task", "task.py:factory", "--study", "a b"], "--study"),
        (["search", "--task", "task.py:factory", "--steps", "20"], "steps=40"),
        (["search", "--task", "task.py:factory", "--accuracy-tolerance", "-1"], "tolerance"),
        (["best", "--study", "nope"], "no MLflow experiment"),
        (
            ["resolve", "--policy", "bad_policy.yaml", "--task", "task.py:factory"],
            "unknown dtype 'fp9'",
        ),
        (["resolve", "--policy", "none.yaml"], "cannot read"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(project, monkeypatch, capsys, args, message):
    folder, _ = project
    for name, (text, _) in BAD_SPACES.items():
        _write(folder, name, text)
    _write(folder, "bad_policy.yaml", "default: fp9\n")
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    before = _snapshot(folder)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
    assert "Traceback" not in err
    assert _snapshot(folder) == before


@pytest.mark.parametrize(
    "args",
    [["search", "--trials", "many"], ["search", "--prefer", "fast"], ["frobnicate"]],
)
def test_argument_errors_are_one_line(project, args):
    folder, _ = project
    done = _run(*args, cwd=folder)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_bad_input_in_a_real_process(project):
    folder, _ = project
    _write(folder, "dtype.yaml", BAD_SPACES["dtype.yaml"][0])
    before = _snapshot(folder)
    done = _run("search", "--task", "task.py:factory", "--space", "dtype.yaml", cwd=folder)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "autoprec search: error: dtype.yaml: groups[0].dtypes: unknown dtype 'fp4' "
        "(expected fp32, fp16, bf16, fp8 to train, or int8 to serve)"
    ]
    assert _snapshot(folder) == before


def test_help_answers_questions():
    done = subprocess.run(
        [sys.executable, "-m", "autoprec.cli", "search", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    for option in (
        "--task",
        "--space",
        "--trials",
        "--steps",
        "--device",
        "--study",
        "--storage",
        "--tracking-uri",
        "--seed",
        "--accuracy-tolerance",
        "--prefer",
    ):
        assert option in done.stdout
