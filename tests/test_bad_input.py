"""Bad input given to the real command: one line on stderr that names the file or field,
exit status 2, no traceback, and nothing written (no store created, no file changed)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from autoprec.errors import redact

NAN_TASK = textwrap.dedent(
    """
    import torch
    from torch import nn
    import autoprec

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x) * float("nan")

    def make():
        x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
        return autoprec.Task(
            "nan-task",
            Broken,
            lambda seed: [(x[:32], y[:32])] * 500,
            lambda: [(x[32:], y[32:])],
            loss=nn.functional.cross_entropy,
        )
    """
)


class _Pickled:
    """Unpickling this runs a command that leaves a file behind."""

    def __reduce__(self):
        return (os.system, ("touch PWNED",))


SUMMARY = {
    "study": "s",
    "mode": "training",
    "settings": {"task": "digits-mlp", "device": "cpu"},
    "accuracy_tolerance": 0.01,
    "prefer": "speed",
    "baseline": {
        "number": "baseline",
        "state": "complete",
        "metrics": {"accuracy": 0.9, "peak_memory_mb": 1.0, "step_time_ms": 2.0},
        "params": {"dtype.all": "fp32"},
        "feasible": True,
        "pareto": True,
    },
    "trials": [],
}


def _summary(**changes):
    return json.dumps({**SUMMARY, **changes})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with a bad file of every kind, and no runs/ store yet."""
    root = tmp_path_factory.mktemp("bad")
    (root / "nan_task.py").write_text(NAN_TASK)
    torch.save({"fc1.weight": "a string"}, root / "string.pt")
    torch.save({"model": {"fc1.weight": 3}}, root / "int.pt")
    torch.save({"fc1.weight": _Pickled()}, root / "pickled.pt")
    (root / "raw.pt").write_bytes(pickle.dumps({"fc1.weight": _Pickled()}))
    files = {
        "dup_policy.yaml": "default: fp16\nrules: []\ndefault: fp32\n",
        "dup_rule.yaml": "rules:\n  - {patterns: [fc1], dtype: bf16, dtype: fp16}\n",
        "dup_space.yaml": "groups:\n- {name: a, patterns: ['*']}\ngroups: auto\n",
        "int8_space.yaml": "dtypes: [fp32, int8]\ngroups: auto\n",
        "list_space.yaml": "- fp32\n- fp16\n",
        "number_dtype.yaml": "default: 16\n",
        "empty.yaml": "",
        "big_policy.yaml": "default: fp32\nrules:\n"
        + "".join(f"  - {{patterns: [l{i}], dtype: fp16}}\n" for i in range(12000)),
        "aliases.yaml": "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n"
            for a, b in zip("abcde", "bcdef", strict=True)
        ),
    }
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "latin1.yaml").write_bytes("default: fp32 # caf\xe9\n".encode("latin-1"))
    (root / "a_folder.yaml").mkdir()
    for study, text in {
        "list": "[]",
        "empty": "{}",
        "nosettings": _summary(settings=None),
        "trials": _summary(trials={"0": 1}),
        "row": _summary(trials=[1]),
        "state": _summary(baseline={**SUMMARY["baseline"], "state": 3}),
        "best": _summary(best={**SUMMARY["baseline"], "number": 7}),
        "deep": "[" * 100_000 + "]" * 100_000,
    }.items():
        (root / "runs" / study).mkdir(parents=True)
        (root / "runs" / study / "summary.json").write_text(text)
        (root / "runs" / study / "best_policy.yaml").write_text("default: fp32\n")
    return root


def _snapshot(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _run(root, *args):
    return subprocess.run(
        [sys.executable, "-m", "autoprec.cli", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )


SEARCH = ["search", "--no-progress", "--trials", "2", "--steps", "5"]
SERVE = [*SEARCH, "--mode", "serving"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*SERVE, "--checkpoint", "string.pt"], "string.pt: entry 'fc1.weight' is a str"),
        ([*SERVE, "--checkpoint", "int.pt"], "int.pt: entry 'fc1.weight' is a int"),
        ([*SERVE, "--checkpoint", "pickled.pt"], "pickled.pt: holds Python objects"),
        ([*SERVE, "--checkpoint", "raw.pt"], "raw.pt: holds Python objects"),
        ([*SERVE, "--checkpoint", "a_folder.yaml"], "a_folder.yaml: not a torch checkpoint"),
        ([*SERVE, "--batch-sizes", "1,100000000"], "--batch-sizes '1,100000000': at most"),
        ([*SERVE, "--batch-size", "0"], "--batch-size"),
        ([*SEARCH, "--task", "nan_task.py:make"], "outputs are NaN on its first training"),
        ([*SEARCH, "--int8", "dynamic"], "--int8: only with --mode serving"),
        ([*SEARCH, "--int8", "off"], "--int8: only with --mode serving"),
        ([*SEARCH, "--space", "int8_space.yaml"], "int8_space.yaml: dtypes: int8 is for serving"),
        ([*SEARCH, "--space", "dup_space.yaml"], "line 3: key 'groups' given twice (first on"),
        ([*SEARCH, "--space", "list_space.yaml"], "list_space.yaml: expected a mapping"),
        ([*SEARCH, "--space", "empty.yaml"], "empty.yaml: expected a mapping"),
        ([*SEARCH, "--space", "a_folder.yaml"], "a_folder.yaml: is a folder"),
        ([*SEARCH, "--space", "latin1.yaml"], "latin1.yaml: not UTF-8 text"),
        ([*SEARCH, "--trials", "-3"], "--trials"),
        ([*SEARCH, "--steps", "0"], "steps"),
        (["resolve", "--policy", "dup_policy.yaml"], "dup_policy.yaml: line 3: key 'default'"),
        (["resolve", "--policy", "dup_rule.yaml"], "dup_rule.yaml: line 2: key 'dtype' given"),
        (["resolve", "--policy", "number_dtype.yaml"], "unknown dtype 16"),
        (["resolve", "--policy", "empty.yaml"], "empty.yaml: expected a mapping"),
        (["resolve", "--policy", "big_policy.yaml"], "KB, more than the 256 KB allowed"),
        (["resolve", "--policy", "aliases.yaml"], "anchors expand to more than"),
        (["resolve", "--policy", "latin1.yaml"], "not UTF-8 text"),
        (["resolve", "--policy", "a_folder.yaml"], "is a folder"),
        (["report", "--study", "list"], "summary.json: the top level: expected a mapping"),
        (["report", "--study", "empty"], "summary.json: mode: expected training or serving"),
        (["report", "--study", "nosettings"], "settings: expected a mapping, got nothing"),
        (["report", "--study", "trials"], "trials: expected a list"),
        (["report", "--study", "row"], "trials[0]: expected a mapping"),
        (["report", "--study", "state"], "baseline.state: expected one of"),
        (["report", "--study", "best"], "best.number: 7 is no trial"),
        (["report", "--study", "deep"], "summary.json: nested too deeply"),
        (["export", "--study", "list"], "summary.json: the top level"),
        (["export", "--study", "nosettings"], "settings: expected a mapping"),
        (["compare", "--study", "empty", "--study", "row"], "mode: expected training or serving"),
        (["ui", "--port", "99999"], "--port 99999: expected a port from 1 to 65535"),
        ([*SEARCH, "--study", "name\n"], "--study 'name\\n': use letters, digits"),
        ([*SERVE, "--train-steps", "100"], "--train-steps: only with --mode training"),
        ([*SERVE, "--trial-schedule", "compressed"], "--trial-schedule: only with --mode training"),
        ([*SERVE, "--forecast", "warn"], "--forecast: only with --mode training"),
        ([*SEARCH, "--fp8", "off"], "--fp8: only with --mode serving"),
        ([*SEARCH, "--train-steps", "10" * 8], "--train-steps 1010101010101010: at most 1000000"),
        ([*SEARCH, "--storage", "optuna.db"], "--storage 'optuna.db': not a database URL"),
        ([*SEARCH, "--storage", "postgresql://u@h:port/db"], "not a database URL"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(folder, args, message):
    before = _snapshot(folder)
    done = _run(folder, *args)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert _snapshot(folder) == before  # no store created, no file written
    assert not (folder / "PWNED").exists()


def test_a_large_policy_is_refused_before_it_is_parsed(folder):
    """5 MB of YAML took 71 s to parse; the size is checked first."""
    (folder / "huge.yaml").write_text("rules:\n" + "  - {patterns: [x], dtype: fp16}\n" * 170_000)
    from autoprec.errors import PolicyError
    from autoprec.policy import load_policy

    with pytest.raises(PolicyError, match=r"huge.yaml: 5\d{3} KB, more than the 256 KB"):
        load_policy(folder / "huge.yaml")
    (folder / "huge.yaml").unlink()


def test_a_merge_key_is_not_a_duplicate(tmp_path):
    from autoprec._util.files import load_yaml

    (tmp_path / "m.yaml").write_text("base: &b {x: 1, y: 2}\nover:\n  <<: *b\n  x: 3\n")
    from autoprec.errors import SpaceError

    assert load_yaml(tmp_path / "m.yaml", SpaceError)["over"] == {"x": 3, "y": 2}


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("postgresql://u:p4ss@h/db", "p4ss"),
        ("postgresql+psycopg://u:p4ss@h:5432/db?sslmode=require", "p4ss"),
        ("postgresql://u:p@ss:w@rd@db.example:5432/optuna", "p@ss:w@rd"),
        ("postgresql://u:p@ss/w@rd@db.example/optuna", "p@ss/w@rd"),
        ("postgresql://u@h/db?password=s3cret", "s3cret"),
        ("postgresql://h/db?user=u&password=s3cret&sslmode=require", "s3cret"),
        ("postgresql://u@h/db?sslmode=verify-full&sslpassword=k3y", "k3y"),
        ("mysql://root:r00t@localhost/optuna?charset=utf8", "r00t"),
        ("http://user:tr4ck@10.0.0.5:5000", "tr4ck"),
        ("https://user:tr@ck:er@mlflow.example/path?x=1", "tr@ck:er"),
        ("http://mlflow.example:5000/?token=t0k", "t0k"),
    ],
)
def test_redact_hides_every_password(url, secret):
    for text in (url, f"--storage {url!r}: cannot connect", f"a {url} and sqlite:///x.db"):
        shown = redact(text)
        assert secret not in shown, shown
        assert "***" in shown
    assert redact("sqlite:///runs/optuna.db") == "sqlite:///runs/optuna.db"


def test_a_password_in_a_bad_url_is_redacted_on_the_command_line(folder):
    done = _run(folder, *SEARCH, "--storage", "redis://u:p@ss@h/0?password=q1w2")
    assert done.returncode == 2
    assert "p@ss" not in done.stderr and "q1w2" not in done.stderr
    assert done.stderr.count("\n") == 1
