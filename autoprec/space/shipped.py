"""The spaces autoprec ships (``search_spaces/*.yaml``), and loading a space by name or
path."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from autoprec._util.files import load_yaml
from autoprec.errors import SpaceError
from autoprec.space.base import SearchSpace

DEFAULT_SPACE = "default"


def builtin_spaces() -> dict[str, Path]:
    """Shipped space files by name."""
    folder = resources.files("autoprec.search_spaces")
    return {
        Path(entry.name).stem: Path(str(entry))
        for entry in folder.iterdir()
        if entry.name.endswith(".yaml")
    }


def load_space(spec: str | Path) -> SearchSpace:
    """A space by shipped name (``default``, ``digits-cnn``, ...) or YAML file path."""
    shipped = builtin_spaces()
    path = shipped[str(spec)] if str(spec) in shipped else Path(spec)
    if not path.exists():
        names = ", ".join(sorted(shipped))
        raise SpaceError(f"space {str(spec)!r}: no such file, and not a shipped space ({names})")
    data = load_yaml(path, SpaceError)
    return SearchSpace.from_dict(data, str(path))
