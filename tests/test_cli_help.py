"""What `autoprec --help` tells a user: every option of every subcommand says what it is
for, the description names both kinds of search, and `--version` answers."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

from autoprec.cli import _build_parser, main


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_is_walked():
    names = set(_subcommands(_build_parser()))
    assert names == {"search", "profile", "best", "resolve", "report", "compare", "ui", "export"}


@pytest.mark.parametrize("name", sorted(_subcommands(_build_parser())))
def test_every_option_has_help(name):
    parser = _build_parser()
    sub = _subcommands(parser)[name]
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    listed = {c.dest: c.help for c in action._choices_actions}
    assert (listed.get(name) or "").strip(), f"{name}: no help line in `autoprec --help`"
    silent = [a.option_strings[0] for a in sub._actions if not (a.help or "").strip()]
    assert silent == [], f"autoprec {name}: options without help: {silent}"
    assert "(default: False)" not in sub.format_help()


def test_the_description_names_serving_and_int8():
    description = _build_parser().description
    assert "int8" in description and "serv" in description and "train" in description


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.strip() == f"autoprec {version('autoprec')}"


HEAVY = ("torch", "mlflow", "optuna")
COMMANDS = ("search", "profile", "best", "resolve", "report", "compare", "ui", "export")


def test_version_and_every_help_import_no_torch_mlflow_or_optuna():
    """`--version` and each `--help` answer from the parser alone (which would otherwise
    take seconds to import torch): checked in a fresh interpreter, which modules came in."""
    code = textwrap.dedent(
        f"""
        import contextlib, io, sys
        from autoprec.cli import main
        for argv in (["--version"], ["--help"], *([c, "--help"] for c in {COMMANDS!r})):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    main(argv)
                except SystemExit as stopped:
                    assert stopped.code == 0, (argv, stopped.code)
            assert out.getvalue().strip(), argv
        print(",".join(m for m in {HEAVY!r} if m in sys.modules))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"imported by --help/--version: {done.stdout.strip()}"


def test_the_console_script_prints_the_version_and_the_help():
    script = Path(sys.executable).with_name("autoprec")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "autoprec.cli"]
    done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == f"autoprec {version('autoprec')}"
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: autoprec")
    for command_name in COMMANDS:
        assert command_name in done.stdout


def test_the_cli_names_are_the_registries_names():
    """The names the parser offers without importing torch are those the code runs."""
    from autoprec._util import names as _names
    from autoprec.study import config
    from autoprec.tasks import BUILTIN_TASKS, DEFAULT_TASK
    from autoprec.tracking import DEFAULT_TRACKING_URI

    assert tuple(BUILTIN_TASKS) == _names.BUILTIN_TASK_NAMES
    assert _names.DEFAULT_TASK == DEFAULT_TASK
    assert _names.DEFAULT_STORAGE == config.DEFAULT_STORAGE
    assert _names.DEFAULT_TRACKING_URI == DEFAULT_TRACKING_URI
    assert _names.SAMPLERS == config.SAMPLERS
    assert _names.HEARTBEAT_INTERVAL_S == config.HEARTBEAT_INTERVAL_S


def test_the_top_level_help_names_fp8_and_no_default_is_said_twice():
    parser = _build_parser()
    assert "fp8" in parser.format_help()
    for name, sub in _subcommands(parser).items():
        formatter = sub.formatter_class(prog=name)
        for action in sub._actions:
            shown = formatter._get_help_string(action) or ""
            if shown != (action.help or ""):  # the formatter appends "(default: ...)"
                assert "default" not in (action.help or ""), f"{name} {action.option_strings}"
