"""What a plain ``pip install .`` (not editable) installs: every package under autoprec/
must be listed in pyproject.toml, or the installed autoprec misses it while an editable
install, which maps the whole folder, hides the gap."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "autoprec").rglob("__init__.py")
    }
    assert found <= listed, f"not installed by pip install .: {sorted(found - listed)}"
