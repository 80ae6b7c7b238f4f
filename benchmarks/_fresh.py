"""Shared by the benchmarks: run something in a fresh temporary folder."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def fresh_folder() -> Iterator[str]:
    """A new empty working directory for the block (fresh sqlite stores under runs/)."""
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            yield folder
        finally:
            os.chdir(cwd)
