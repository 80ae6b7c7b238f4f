"""What `autoprec --help` tells a user: every option of every subcommand says what it is
for, the description names both kinds of search, and `--version` answers."""

from __future__ import annotations

import argparse
from importlib.metadata import version

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
