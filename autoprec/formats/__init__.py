"""The number formats: one object per format, found by name in one registry.

Every format autoprec knows is one module here (`autoprec.formats.base.Format` says what
it declares), registered below by ``"module:attr"``, so that naming the formats imports
nothing heavy. The rest of the code asks this registry (`get`, `names`) and the objects,
and never compares against a format's name. A new format is its own module and one line in
`REGISTRY`; a format from outside the package is registered with `register`, or named in
the ``AUTOPREC_FORMATS`` environment variable (``path/to/file.py:attr``, comma-separated),
read when the registry is first asked.

>>> from autoprec import formats
>>> formats.get("fp16").limits.largest
65504.0
>>> formats.names("serving")
('fp32', 'fp16', 'bf16', 'fp8', 'int8')
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from autoprec.errors import PolicyError
from autoprec.formats.base import AUTOCAST, CAST, CONVERT, QUANTIZE, Format, Limits

__all__ = [
    "AUTOCAST",
    "CAST",
    "CONVERT",
    "QUANTIZE",
    "REGISTRY",
    "Format",
    "Limits",
    "all_formats",
    "get",
    "names",
    "reference",
    "register",
    "unregister",
]

REGISTRY: dict[str, str] = {
    "fp32": "autoprec.formats.fp32:FP32",
    "fp16": "autoprec.formats.fp16:FP16",
    "bf16": "autoprec.formats.bf16:BF16",
    "fp8": "autoprec.formats.fp8:FP8",
    "int8": "autoprec.formats.int8:INT8",
    "mxfp8": "autoprec.formats.mxfp8:MXFP8",
    "mxfp4": "autoprec.formats.mxfp4:MXFP4",
    "nvfp4": "autoprec.formats.nvfp4:NVFP4",
}
ENVIRONMENT = "AUTOPREC_FORMATS"
_LOADED: dict[str, Format] = {}
_ALIASES: dict[str, str] = {}
_FROM_ENVIRONMENT: list[str] = []
_READ: list[str] = []  # the environment variable's value when last read


def _load(reference: str) -> Format:
    """The format a ``"module:attr"`` or ``"path/to/file.py:attr"`` reference names (a
    class is instantiated)."""
    where, _, attr = reference.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        spec = importlib.util.spec_from_file_location(f"autoprec_format_{path.stem}", path)
        if spec is None or spec.loader is None or not path.is_file():
            raise PolicyError(f"format {reference!r}: no such file {where}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    found = getattr(module, attr, None)
    if isinstance(found, type) and issubclass(found, Format):
        found = found()
    if not isinstance(found, Format):
        raise PolicyError(f"format {reference!r}: not an autoprec.formats.Format")
    return found


def register(reference: str | Format) -> Format:
    """Add a format to the registry (a `Format`, or a ``"module:attr"`` or
    ``"path/to/file.py:attr"`` reference to one) and return it; its name and aliases then
    name it everywhere. Registering a name again replaces it."""
    made = reference if isinstance(reference, Format) else _load(reference)
    REGISTRY[made.name] = made.name
    _LOADED[made.name] = made
    for alias in made.aliases:
        _ALIASES[alias] = made.name
    return made


def unregister(name: str) -> None:
    """Take a format `register` added out of the registry again (its aliases too)."""
    REGISTRY.pop(name, None)
    _LOADED.pop(name, None)
    for alias in [a for a, owner in _ALIASES.items() if owner == name]:
        del _ALIASES[alias]


def _from_environment() -> None:
    value = os.environ.get(ENVIRONMENT, "")
    if [value] == _READ:
        return
    _READ[:] = [value]
    for reference in (r.strip() for r in value.split(",") if r.strip()):
        if reference not in _FROM_ENVIRONMENT:
            _FROM_ENVIRONMENT.append(reference)
            register(reference)


def get(name: str) -> Format:
    """The format named ``name`` (or one of its aliases); PolicyError naming the known ones
    otherwise."""
    _from_environment()
    name = _ALIASES.get(name, name)
    if name not in _LOADED:
        if not isinstance(name, str) or name not in REGISTRY:
            raise PolicyError(f"unknown dtype {name!r} (expected {', '.join(names())})")
        _LOADED[name] = _load(REGISTRY[name])
        for alias in _LOADED[name].aliases:
            _ALIASES[alias] = name
    return _LOADED[name]


def known(name: object) -> bool:
    """Whether ``name`` names a registered format."""
    _from_environment()
    return isinstance(name, str) and (name in REGISTRY or name in _ALIASES)


def all_formats() -> tuple[Format, ...]:
    """Every registered format, in the registry's order."""
    _from_environment()
    return tuple(get(name) for name in REGISTRY)


def names(mode: str | None = None) -> tuple[str, ...]:
    """The registered formats' names, in the registry's order; with ``mode``, those that
    mode may assign to a layer."""
    return tuple(f.name for f in all_formats() if mode is None or mode in f.modes)


def reference() -> Format:
    """The format every trial is compared to (fp32)."""
    return next(f for f in all_formats() if f.reference)
