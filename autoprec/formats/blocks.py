"""Training in a block-scaled format where no device kernel runs it: each Linear's matmuls
take their operands rounded to the format and back (quantize, dequantize), along the
contracted dimension as a device's kernels would scale them, in the forward and in both
backward matmuls. What a layer computes is the format's numerics; its speed is not.

A format module gives its rounding (``round_trip(tensor) -> tensor``, a torchao quantizer's
``to_...(...).dequantize()``); `BlockLayers` turns the named ``nn.Linear`` layers of a model
into `BlockLinear`s in place (the same objects, Parameters and hooks: only the class changes)
and `BlockLayers.remove` turns them back. torch is imported only when a model is converted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autoprec.errors import PolicyError
from autoprec.formats.base import is_plain_linear

if TYPE_CHECKING:
    import torch
    from torch import nn

RoundTrip = Callable[["torch.Tensor"], "torch.Tensor"]


def along(round_trip: RoundTrip, tensor: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """``tensor`` rounded in blocks of ``block`` along ``dim`` (padded with zeros to a whole
    block, which changes no block's scale but the last one's, as kernels pad)."""
    import torch.nn.functional as functional

    moved = tensor.movedim(dim, -1)
    size = moved.shape[-1]
    flat = moved.reshape(-1, size)
    padded = functional.pad(flat, (0, -size % block))
    rounded = round_trip(padded.contiguous())[:, :size].to(tensor.dtype)
    return rounded.reshape(moved.shape).movedim(-1, dim)


def _function(round_trip: RoundTrip, block: int) -> Any:
    import torch

    class _Matmuls(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            # one dtype for both operands: the region's where autocast is on, as a kernel's
            kind = x.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
            x, weight = x.to(dtype), weight.to(dtype)
            ctx.save_for_backward(x, weight)
            return along(round_trip, x, -1, block) @ along(round_trip, weight, -1, block).t()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, weight = ctx.saved_tensors
            grad = grad.to(x.dtype)  # backward runs outside the region
            # grad_input contracts over the outputs, grad_weight over the tokens.
            grad_x = along(round_trip, grad, -1, block) @ along(round_trip, weight, 0, block)
            tokens_grad = along(round_trip, grad.reshape(-1, grad.shape[-1]), 0, block)
            tokens_x = along(round_trip, x.reshape(-1, x.shape[-1]), 0, block)
            return grad_x, tokens_grad.t() @ tokens_x

    return _Matmuls


class BlockLinear:
    """Marks a Linear converted by `BlockLayers` (its class is made per format)."""

    round_trip: RoundTrip
    block: int


def _linear_class(name: str, round_trip: RoundTrip, block: int) -> type:
    from torch import nn

    matmuls = _function(round_trip, block)

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype)
        out = matmuls.apply(x, weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    return type(f"{name.upper()}Linear", (nn.Linear, BlockLinear), {"forward": forward})


class BlockLayers:
    """The named ``nn.Linear`` layers of ``model`` computing in a block-scaled format, in
    place; `remove` turns them back into ``nn.Linear``."""

    def __init__(
        self, model: nn.Module, names: list[str], name: str, round_trip: RoundTrip, block: int
    ) -> None:
        kind = _linear_class(name, round_trip, block)
        self._converted: list[tuple[nn.Module, type]] = []
        for layer in names:
            module = model.get_submodule(layer)
            if not is_plain_linear(module):
                raise PolicyError(f"{layer}: {name} converts nn.Linear layers only")
            self._converted.append((module, type(module)))
            module.__class__ = kind

    def remove(self) -> None:
        """The layers back as they were (the same objects and Parameters)."""
        for module, kind in reversed(self._converted):
            module.__class__ = kind
        self._converted.clear()


def dims_refusal(module: nn.Module, name: str, block: int, out_block: int = 1) -> str | None:
    """Why a Linear cannot be converted to a format scaled in blocks of ``block`` (None: it
    can): only a plain ``nn.Linear`` whose in features fill whole blocks (or one converted),
    and whose out features are a multiple of ``out_block``."""
    if isinstance(module, BlockLinear):
        return None
    if not is_plain_linear(module):
        return f"a {type(module).__name__} is not an nn.Linear, which {name} needs"
    size = int(getattr(module, "in_features", 0))
    if size % block:
        return f"in features {size} are not a multiple of {name}'s block of {block}"
    out = int(getattr(module, "out_features", 0))
    if out % out_block:
        return f"out features {out} are not a multiple of {out_block}, which {name} needs"
    return None
