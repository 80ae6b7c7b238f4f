"""The dtype vocabulary as sets of names, each derived from the format registry
(`autoprec.formats`): what each mode may assign, which formats autocast, quantize or run
below fp32. The names themselves and everything about each format live in its object."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoprec.formats import all_formats, get, names

if TYPE_CHECKING:
    import torch

_ALL = all_formats()
# ``TORCH_DTYPES`` (each name below to its torch dtype) is made when first asked for
# (`__getattr__`), so that the names are read without torch (a policy is torch-free data).
# The floating dtypes autocast and ``Tensor.to`` know, by name.
AUTOCAST_DTYPES: tuple[str, ...] = tuple(f.name for f in _ALL if f.autocasts)
# Floating dtypes below fp32 that a region runs in (the share of parameters, the
# profile's tests, the guided search's low dtypes).
LOW_PRECISION: tuple[str, ...] = tuple(f.name for f in _ALL if f.autocasts and f.low_precision)
SERVING_DTYPES: tuple[str, ...] = names("serving")


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch floating dtype (``torch.bfloat16`` -> ``bf16``), else torch's
    own spelling of it."""
    spelled = str(dtype).removeprefix("torch.")
    return next((f.name for f in all_formats() if f.torch_name == spelled), str(dtype))


def activation_dtype(dtype: str) -> str:
    """The dtype a layer served in ``dtype`` takes its inputs in: a quantized layer
    quantizes fp32 activations itself (a served fp8 layer too)."""
    return get(dtype).activation()


def below_fp32(dtype: str) -> bool:
    """Whether a layer in ``dtype`` runs below fp32 (counts in the low-precision share)."""
    return get(dtype).low_precision


def __getattr__(name: str) -> dict[str, torch.dtype]:
    """``TORCH_DTYPES``: the torch dtype of each floating dtype autocast knows, by name."""
    if name == "TORCH_DTYPES":
        return {f.name: f.torch_dtype() for f in _ALL if f.autocasts}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
