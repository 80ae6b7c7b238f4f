"""Every ``autoprec search`` setting is declared once (`autoprec.settings`): the command's
options, a ``--config`` file's sections, ``--print-config`` and the docs' option reference
all say the same names and defaults, a config file round-trips as a user types it, a bad
one is refused in one line, and a study's fingerprint is what it was before."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from autoprec.cli import _build_parser, main
from autoprec.settings import SECTIONS, options, study_keys, to_yaml
from autoprec.study import SearchConfig

REPO = Path(__file__).resolve().parents[1]


def _autoprec(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``autoprec ...`` as a user types it (the console script beside this Python)."""
    script = Path(sys.executable).with_name("autoprec")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "autoprec.cli"]
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run(
        [*command, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600
    )


def _search_parser() -> argparse.ArgumentParser:
    parser = _build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["search"]


def _shown(value):
    """A default as ``--help`` shows it."""
    return list(value) if isinstance(value, tuple) else value


def test_the_parser_the_config_file_and_the_docs_say_the_same_settings(tmp_path):
    declared = list(options())
    assert len(declared) == 35 and len({o.flag for o in declared}) == len(declared)

    # the parser: an option per setting, in its section's group, with its default and help
    search = _search_parser()
    actions = {a.dest: a for a in search._actions}
    groups = {a.dest: g.title for g in search._action_groups for a in g._group_actions}
    titles = {s.key: s.title for s in SECTIONS}
    for o in declared:
        action = actions[o.name]
        assert o.flag in action.option_strings, o.name
        assert groups[o.name] == titles[o.section], o.name
        assert action.help == o.help
        if action.nargs == 0:  # a switch: --compile sets True, --no-early-stopping False
            assert action.const is not o.default, o.name
        assert action.default == (True if o.switch and o.default else _shown(o.default))

    # --print-config: every setting under its section; the defaults, the mode settled
    printed = _autoprec("search", "--print-config", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    sections = yaml.safe_load(printed.stdout)
    assert list(sections) == [s.key for s in SECTIONS]
    for o in declared:
        expected = "training" if o.name == "mode" else _shown(o.default)
        assert sections[o.section][o.name] == expected, o.name
    assert printed.stdout == to_yaml(
        {o.name: "training" if o.name == "mode" else o.default for o in declared}
    )

    # the docs' option reference: a row per option under its section's title, its
    # default as --help says it, and its place in a config file
    spec = importlib.util.spec_from_file_location("options_hook", REPO / "docs/hooks/options.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    reference = hook.option_reference().split("## autoprec search\n", 1)[1].split("\n## ")[0]
    tables = {
        part.split("**", 1)[0]: part for part in reference.split("\n**")[1:]
    }  # group title -> its table
    for o in declared:
        table = tables[titles[o.section]]
        row = next((r for r in table.splitlines() if r.startswith(f"| `{o.flag}")), None)
        assert row is not None, f"{o.flag} not under {titles[o.section]!r}"
        assert row.endswith(f"| `{o.section}.{o.name}` |"), row
        if o.default is not None and not o.switch:
            assert f"(default: {_shown(o.default)})" in row, row


def test_print_config_then_config_round_trips_as_typed(tmp_path):
    first = _autoprec("search", "--print-config", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "search.yaml").write_text(first.stdout)
    again = _autoprec("search", "--config", "search.yaml", "--print-config", cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr

    # flags override the file, and what they made round-trips too
    changed = _autoprec(
        "search", "--config", "search.yaml", "--mode", "serving", "--scenario", "edge",
        "--emulate", "fp8", "--batch-sizes", "1,8", "--no-early-stopping", "--trials", "5",
        "--print-config", cwd=tmp_path,
    )  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    sections = yaml.safe_load(changed.stdout)
    assert sections["what"]["trials"] == 5 and sections["what"]["mode"] == "serving"
    assert sections["serving"]["scenario"] == "edge"
    assert sections["serving"]["batch_sizes"] == "1,8"
    assert sections["where"]["emulate"] == ["fp8"]
    assert sections["choice"]["early_stopping"] is False
    (tmp_path / "edge.yaml").write_text(changed.stdout)
    back = _autoprec("search", "--config", "edge.yaml", "--print-config", cwd=tmp_path)
    assert back.returncode == 0 and back.stdout == changed.stdout, back.stderr
    assert not (tmp_path / "runs").exists()  # nothing was searched, no store made


@pytest.mark.slow  # a whole search end to end: the everyday subset skips it
def test_a_search_from_a_config_file(tmp_path):
    """A file of only a few settings, the rest at their defaults; a flag overrides it."""
    (tmp_path / "out").mkdir()  # a sqlite store's folder must exist (but the default runs/)
    (tmp_path / "search.yaml").write_text(
        "# a short search of the built-in task\n"
        "what:\n  trials: 2\n  steps: 12\n"
        "where:\n  study: from-file\n  runs_dir: out\n"
        "  storage: sqlite:///out/optuna.db\n  tracking_uri: sqlite:///out/mlflow.db\n"
        "choice:\n  sampler: random\n  confirm_top: 0\n"
    )
    done = _autoprec(
        "search", "--config", "search.yaml", "--trials", "1", "--no-progress", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "best policy: out/from-file/best_policy.yaml" in done.stdout
    summary = yaml.safe_load((tmp_path / "out/from-file/summary.json").read_text())
    settings = summary["settings"]
    assert (settings["trials"], settings["steps"], settings["sampler"]) == (1, 12, "random")
    assert settings["task"] == "digits-mlp"


BAD_FILES = [
    ("what:\n  trials: many\n", "search.yaml: what.trials: expected a positive integer, got"),
    ("what:\n  trails: 3\n", "search.yaml: what.trails: unknown setting (section what has"),
    ("wat:\n  trials: 3\n", "search.yaml: unknown section 'wat' (expected what, serving,"),
    ("serving:\n  int8: fast\n", "search.yaml: serving.int8: expected one of auto, off,"),
    ("where:\n  emulate: fp8\n", "search.yaml: where.emulate: expected a list, each one of fp8"),
    ("what: [\n", "search.yaml: line 2: not a YAML file"),
    ("- trials\n", "search.yaml: expected sections what, serving, where,"),
    ("what:\n  trials: 0\n", "--trials: expected a positive integer, got 0 (what.trials in"),
    ("what:\n  steps: 10\nlonger:\n  confirm_steps: 5\n", "--confirm-steps: expected an"),
    ("where: !!python/object/apply:os.system [echo hi]\n", "search.yaml: line 1: not plain"),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES, ids=[m for _, m in BAD_FILES])
def test_a_bad_config_file_is_one_line_and_exit_2(text, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "search.yaml").write_text(text)
    assert main(["search", "--config", "search.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoprec search: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_a_missing_config_file_in_a_real_process(tmp_path):
    done = _autoprec("search", "--config", "nowhere.yaml", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("autoprec search: error: nowhere.yaml: cannot read")
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


# What a default search of the built-in task (1 trial of 5 steps) recorded as its
# fingerprint before the settings were declared in one place: a continued study of then
# must be told nothing changed.
FINGERPRINT_BEFORE = {
    "task": "digits-mlp",
    "mode": "training",
    "steps": 5,
    "seed": 0,
    "device": "cpu",
    "emulated": "",
    "nproc_per_trial": 1,
    "parallel": None,
    "compile": False,
    "trial_schedule": "as-is",
    "train_steps": 50,
    "forecast": "infeasible",
    "space": "digits-mlp",
    "space_fingerprint": "e46b3524cb05",
}


# ... and what it holds since the settings that choose the best were found to change the
# study's records (best_policy.yaml, summary.json): a study fingerprinted before them is
# checked on them as its summary.json says (tests/test_study_settings.py).
FINGERPRINT_CHOICE = {
    "accuracy_tolerance": 0.01,
    "prefer": "speed",
    "sampler": "random",
    "confirm_top": 0,
    "early_stopping": True,
    "confirm_steps": None,
}


def test_the_fingerprint_comes_from_the_declaration_and_is_unchanged(tmp_path, monkeypatch):
    from autoprec.study import SearchConfig, search

    monkeypatch.chdir(tmp_path)
    config = SearchConfig(trials=1, steps=5, device="cpu", sampler="random", confirm_top=0)
    search("digits-mlp", None, config)
    study = optuna.load_study(study_name="digits-mlp", storage="sqlite:///runs/optuna.db")
    recorded = study.user_attrs["autoprec.fingerprint"]
    before = [k for k in recorded if k in FINGERPRINT_BEFORE]
    assert before == list(FINGERPRINT_BEFORE)  # in the same order
    assert {k: recorded[k] for k in before} == FINGERPRINT_BEFORE
    assert {k: v for k, v in recorded.items() if k not in before} == FINGERPRINT_CHOICE
    # every key is a declared setting's (launched trials' "backend" only where there are,
    # "guard" only where the search ran under it)
    assert set(recorded) == set(study_keys("training")) - {"backend", "guard"}


def test_the_serving_mode_answers_to_its_earlier_name(tmp_path):
    """``--mode inference`` (the serving mode's name before it had one) is the serving
    mode: on the command line, in a config file and from Python."""
    typed = _autoprec("search", "--mode", "inference", "--print-config", cwd=tmp_path)
    assert typed.returncode == 0, typed.stderr
    assert yaml.safe_load(typed.stdout)["what"]["mode"] == "serving"
    (tmp_path / "old.yaml").write_text("what:\n  mode: inference\n")
    read = _autoprec("search", "--config", "old.yaml", "--print-config", cwd=tmp_path)
    assert read.returncode == 0, read.stderr
    assert yaml.safe_load(read.stdout)["what"]["mode"] == "serving"
    assert SearchConfig(mode="inference", scenario="edge").mode == "serving"
    assert "{training,serving}" in _autoprec("search", "--help", cwd=tmp_path).stdout
