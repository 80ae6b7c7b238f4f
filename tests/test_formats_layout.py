"""No code outside `autoprec.formats` decides anything by a number format's name: it asks
the format's object (`autoprec.formats.get(name)`), so that a format registered from
outside the package is searched, applied, exported and drawn like the built-in ones.

The scan reads every module's source: a comparison (``==``, ``!=``, ``in``, ``not in``,
``is``, ``is not``) or a ``match`` case whose operand is a string naming a registered
format (a name, an alias, or an element type such as ``fp8_e4m3``), or one of the old name
constants ``FP32``, ``FP16``, ``BF16``, ``FP8``, ``INT8``, is an offence.
"""

from __future__ import annotations

import ast
from pathlib import Path

from autoprec import formats

PACKAGE = Path(__file__).resolve().parent.parent / "autoprec"
# The registry itself, and the transitional view the lead deletes once nothing imports it.
EXEMPT = (PACKAGE / "formats", PACKAGE / "dtypes.py")
CONSTANTS = frozenset({"FP32", "FP16", "BF16", "FP8", "INT8"})
EQUALITY = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _format_names() -> frozenset[str]:
    """Every spelling of a registered format: its name, its aliases, its element types."""
    found: set[str] = set()
    for made in formats.all_formats():
        found.update((made.name, *made.aliases, *made.element_limits()))
    return frozenset(found)


def _names_a_format(node: ast.AST, names: frozenset[str]) -> bool:
    """Whether ``node`` is a format's name: a string constant, a collection of them, or an
    old name constant (``FP16``, ``dtypes.FP16``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_format(element, names) for element in node.elts)
    if isinstance(node, ast.Name):
        return node.id in CONSTANTS
    if isinstance(node, ast.Attribute):
        return node.attr in CONSTANTS
    return False


def _pattern_names_a_format(pattern: ast.pattern, names: frozenset[str]) -> bool:
    """Whether a ``case`` pattern matches a format's name."""
    return any(
        isinstance(node, ast.MatchValue) and _names_a_format(node.value, names)
        for node in ast.walk(pattern)
    )


def _lines(source: str, names: frozenset[str]) -> list[int]:
    """The line of each comparison against a format's name in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            pairs = zip([node.left, *node.comparators], node.comparators, strict=False)
            compared = [
                side
                for op, pair in zip(node.ops, pairs, strict=True)
                if isinstance(op, EQUALITY)
                for side in pair
            ]
            if any(_names_a_format(operand, names) for operand in compared):
                found.append(node.lineno)
        elif isinstance(node, ast.match_case) and _pattern_names_a_format(node.pattern, names):
            found.append(node.pattern.lineno)
    return sorted(found)


def offences() -> list[str]:
    """Every comparison against a format's name outside the formats package."""
    names = _format_names()
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if not any(path == exempt or exempt in path.parents for exempt in EXEMPT):
            where = path.relative_to(PACKAGE.parent)
            found.extend(f"{where}:{line}" for line in _lines(path.read_text(), names))
    return found


def test_the_scan_sees_each_kind_of_comparison() -> None:
    source = (
        "if dtype == 'fp16': pass\n"
        "if dtype in ('bf16', 'x'): pass\n"
        "if kind is not dtypes.FP8: pass\n"
        "if name != 'fp8_e5m2': pass\n"
        "match dtype:\n"
        "    case 'int8': pass\n"
        "if mode == 'serving' and recipe == 'tensorwise': pass\n"
        "if 'fp16' < name: pass\n"
    )
    assert _lines(source, _format_names()) == [1, 2, 3, 4, 6]


def test_no_code_outside_formats_compares_against_a_format_name() -> None:
    found = offences()
    assert not found, f"{len(found)} comparisons against a format's name:\n" + "\n".join(found)
