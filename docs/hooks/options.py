"""An mkdocs hook: the option reference is built from the ``autoprec`` command's own parser
(``autoprec.cli``), so the docs say what ``--help`` says and cannot drift from it.

A page that holds the line ``<!-- autoprec options -->`` gets, in its place, one section per
subcommand: its description and a table per argument group (option, what it does with its
default, as ``--help`` prints them; for ``autoprec search``, also where a ``--config`` file
holds the setting, from the same declaration, `autoprec.settings`).
"""

from __future__ import annotations

import argparse
import html
from typing import Any

MARKER = "<!-- autoprec options -->"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell: no pipes, no newlines, no HTML."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "&#124;")


def _option(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    if not action.option_strings:
        return f"`{formatter._metavar_formatter(action, action.dest)(1)[0]}`"
    if action.nargs == 0:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    metavar = formatter._format_args(action, action.dest.upper())
    return ", ".join(f"`{o} {metavar}`" for o in action.option_strings)


def _table(
    actions: list[argparse.Action], parser: argparse.ArgumentParser, keys: dict[str, str]
) -> list[str]:
    """A group's rows; ``keys``: each setting's place in a config file, by its dest."""
    formatter = parser._get_formatter()
    rows = ["| option | what it does |", "|---|---|"]
    if any(action.dest in keys for action in actions):
        rows = ["| option | what it does | in a --config file |", "|---|---|---|"]
    for action in actions:
        if isinstance(action, argparse._SubParsersAction):
            rows = ["| command | what it does |", "|---|---|"]
            rows += [
                f"| `autoprec {c.dest}` | {_cell(c.help or '')} |" for c in action._choices_actions
            ]
            continue
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        help_text = formatter._expand_help(action) if action.help else ""
        if action.required and action.option_strings:
            help_text = f"required: {help_text}"
        option = _option(action, formatter).replace("|", "&#124;")
        key = f" `{keys[action.dest]}` |" if action.dest in keys else (" |" if keys else "")
        rows.append(f"| {option} | {_cell(help_text)} |{key}")
    return rows if len(rows) > 2 else []


def _parser_section(
    title: str,
    parser: argparse.ArgumentParser,
    summary: str = "",
    keys: dict[str, str] | None = None,
) -> list[str]:
    lines = [f"## {title}", ""]
    if parser.description or summary:
        lines += [_cell(parser.description or summary), ""]
    for group in parser._action_groups:
        declared = {a.dest: keys[a.dest] for a in group._group_actions if a.dest in (keys or {})}
        rows = _table(group._group_actions, parser, declared)
        if not rows:
            continue
        title = {"positional arguments": "commands"}.get(group.title or "", group.title)
        lines += [f"**{title}**", "", *rows, ""]
    return lines


def option_reference() -> str:
    from autoprec.cli import _build_parser
    from autoprec.settings import options

    keys = {o.name: f"{o.section}.{o.name}" for o in options()}

    parser = _build_parser()
    lines = _parser_section("autoprec", parser)
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {c.dest: c.help or "" for c in commands._choices_actions}
    for name, sub in _subcommands(parser).items():
        declared = keys if name == "search" else None
        lines += _parser_section(f"autoprec {name}", sub, summaries.get(name, ""), declared)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, option_reference())
