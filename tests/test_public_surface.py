"""The public surface does not move: ``autoprec.search`` is the function, ``dir(autoprec)``
is ``__all__``, and every exception type is defined in autoprec.errors."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import autoprec
import autoprec.errors

PACKAGE = Path(autoprec.__file__).parent

# The function and the package that holds it have different names (`autoprec.study`), so
# no import order can make ``autoprec.search`` the package.
PROBE = """
import inspect
import autoprec.study._workers
import autoprec
from autoprec.study.config import SearchConfig
from autoprec.study import search
assert inspect.isfunction(autoprec.search) and autoprec.search is search
assert SearchConfig is autoprec.SearchConfig
"""


def test_autoprec_search_is_the_function():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_dir_lists_the_public_names_only():
    assert dir(autoprec) == autoprec.__all__
    for name in autoprec.__all__:
        assert getattr(autoprec, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'importlib'"):
        autoprec.importlib  # noqa: B018


def test_the_error_types_are_public():
    errors = [
        name
        for name, value in vars(autoprec.errors).items()
        if isinstance(value, type) and issubclass(value, autoprec.AutoprecError)
    ]
    assert "ExportError" in errors and "StoreError" in errors
    assert set(errors) <= set(autoprec.__all__)
    assert autoprec.SearchInterrupted is autoprec.errors.SearchInterrupted
    assert issubclass(autoprec.SearchInterrupted, KeyboardInterrupt)
    from autoprec.exports import ExportError, ExportWarning

    assert (ExportError, ExportWarning) == (autoprec.ExportError, autoprec.ExportWarning)


def _exception_names() -> set[str]:
    """Built-in exception and warning names, and autoprec's own."""
    import builtins

    names = {
        name
        for name, value in vars(builtins).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    return names | set(autoprec.errors.__all__) | {"YAMLError"}


def test_every_exception_type_is_defined_in_errors():
    exceptions = _exception_names()
    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(base).rpartition(".")[2] for base in node.bases}
            if bases & exceptions:
                elsewhere.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert elsewhere == []


def test_the_old_import_paths_of_moved_errors_still_work():
    from autoprec.exports._common import ExportError
    from autoprec.trials.base import TrialTimeout  # the per-trial time limit lives there

    assert ExportError is autoprec.errors.ExportError
    assert TrialTimeout is autoprec.errors.TrialTimeout


def test_search_keeps_its_documented_signature():
    parameters = inspect.signature(autoprec.search).parameters
    assert list(parameters)[:4] == ["task", "space", "config", "callbacks"]
    assert parameters["settings"].kind is inspect.Parameter.VAR_KEYWORD
