"""Nested batches and outputs, handled in one place.

Real training code passes tensors inside tuples, lists, dicts, named tuples and
dataclass outputs (transformers' ``ModelOutput`` is both a dataclass and an ordered
dict). Every cast, device move, region boundary and telemetry hook goes through
`map_tensors`, which maps a function over the tensors of such a structure and rebuilds
the same container types, so that a ``ModelOutput`` stays a ``ModelOutput``. Anything
it does not know (a cache object, a string, None) passes through untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

Structure = Any


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Structure) -> Structure:
    """``value`` with ``fn`` applied to every tensor in it, containers rebuilt as the same
    types (named tuples, dataclasses and mappings included)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Before the mapping case: ModelOutput is a dataclass and a dict, and only its
        # constructor keeps unset fields out of the dict view.
        changes = {f.name: map_tensors(fn, getattr(value, f.name)) for f in _init_fields(value)}
        return type(value)(**changes)
    if isinstance(value, Mapping):
        mapped = {key: map_tensors(fn, item) for key, item in value.items()}
        rebuild: Any = type(value)  # a Mapping subclass; most take a dict
        try:
            return rebuild(mapped)
        except Exception:  # a mapping type that cannot be built from a dict
            return mapped
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(map_tensors(fn, item) for item in value))
    if isinstance(value, tuple | list):
        return type(value)(map_tensors(fn, item) for item in value)
    return value


def _init_fields(value: Any) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(value) if f.init]


def tensors(value: Structure) -> Iterator[torch.Tensor]:
    """Every tensor in a structure, depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors(getattr(value, f.name))
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, tuple | list):
        for item in value:
            yield from tensors(item)


def cast_floats(value: Structure, dtype: torch.dtype) -> Structure:
    """Floating-point tensors cast to ``dtype``; integer tensors (token ids, masks) kept."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.dtype != dtype:
            return tensor.to(dtype)
        return tensor

    return map_tensors(cast, value)


def upcast_floats_except(value: Structure, keep: tuple[torch.dtype, ...]) -> Structure:
    """Floating-point tensors of 16 bits or fewer whose dtype is not in ``keep`` cast up
    to fp32 (lossless); fp32, fp64 and integer tensors kept."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.dtype not in keep and tensor.element_size() <= 2:
            return tensor.float()
        return tensor

    return map_tensors(cast, value)


def to_device(value: Structure, device: torch.device | str) -> Structure:
    """Every tensor moved to ``device`` (a no-op for those already there)."""
    return map_tensors(lambda tensor: tensor.to(device), value)


def detach(value: Structure) -> Structure:
    return map_tensors(lambda tensor: tensor.detach(), value)


def first_tensor(value: Structure) -> torch.Tensor | None:
    return next(tensors(value), None)


def describe(value: Structure, depth: int = 0) -> str:
    """A short description of a structure, for error messages:
    ``a dict with keys [input_ids, attention_mask]``, ``a tensor [64, 16] float32``."""
    if isinstance(value, torch.Tensor):
        shape = ", ".join(str(d) for d in value.shape)
        return f"a tensor [{shape}] {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, Mapping):
        keys = ", ".join(str(k) for k in value)
        return f"a {type(value).__name__} with keys [{keys}]"
    if isinstance(value, tuple | list):
        kind = type(value).__name__
        if depth > 0 or not value:
            return f"a {kind} of {len(value)}"
        items = "; ".join(describe(item, depth + 1) for item in value[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"a {kind} of {len(value)} ({items}{more})"
    if value is None:
        return "None"
    return f"a {type(value).__name__}"
