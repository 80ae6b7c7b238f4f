"""Loading a task named on the command line: a built-in name, ``package.module:attr`` or
``path/to/file.py:attr``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from autoprec.errors import TaskError
from autoprec.tasks.base import Task
from autoprec.tasks.builtin import BUILTIN_TASKS


def load_task(spec: str) -> Task:
    """A task by built-in name, zoo name (``zoo-lstm``: `autoprec.tasks.zoo`),
    ``package.module:attr`` or ``path/to/file.py:attr``.

    ``attr`` is a Task or a zero-argument callable returning one.
    """
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]()
    if spec.startswith("zoo-"):
        from autoprec.tasks.zoo import ZOO

        if spec in ZOO:
            return ZOO[spec].task()
    if ":" not in spec:
        names = ", ".join(sorted(BUILTIN_TASKS))
        raise TaskError(
            f"task {spec!r}: expected a built-in name ({names}), a zoo task (zoo-..., "
            "autoprec.tasks.zoo), package.module:attr or path/to/file.py:attr"
        )
    target, attr = spec.rsplit(":", 1)
    module = _import_file(target, spec) if target.endswith(".py") else _import_module(target, spec)
    if not hasattr(module, attr):
        raise TaskError(f"task {spec!r}: {target} has no attribute {attr!r}")
    value = getattr(module, attr)
    if not isinstance(value, Task) and callable(value):
        try:
            value = value()
        except TaskError:
            raise
        except Exception as error:  # the task's own code: any error is its
            raise TaskError(
                f"task {spec!r}: {attr}() raised {type(error).__name__}: {error}"
            ) from None
    if not isinstance(value, Task):
        raise TaskError(
            f"task {spec!r}: {attr} is a {type(value).__name__}, "
            "expected an autoprec.Task or a callable returning one"
        )
    return value


def _import_module(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as error:  # importing user code can raise anything
        raise TaskError(
            f"task {spec!r}: cannot import {name} ({type(error).__name__}: {error})"
        ) from None


def _import_file(path_text: str, spec: str) -> Any:
    path = Path(path_text)
    if not path.is_file():
        raise TaskError(f"task {spec!r}: no such file {path}")
    module_name = f"_autoprec_task_{path.stem}_{abs(hash(str(path.resolve())))}"
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    if file_spec is None or file_spec.loader is None:
        raise TaskError(f"task {spec!r}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as error:  # importing user code can raise anything
        del sys.modules[module_name]
        raise TaskError(
            f"task {spec!r}: {path} failed to import ({type(error).__name__}: {error})"
        ) from None
    return module
