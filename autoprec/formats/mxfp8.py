"""MXFP8 (OCP microscaling): e4m3 values in blocks of 32 that share one power-of-two (e8m0)
scale, for Linear layers, in training and serving.

Blackwell GPUs (CUDA compute capability 10.0 and later) run it natively. Elsewhere it is
emulated through torchao's ``prototype.mx_formats``, opted into as fp8 is (``--emulate
mxfp8``): training rounds each matmul's operands with ``MXTensor.to_mx`` (forward and both
backward matmuls; `autoprec.formats.blocks`), serving quantizes the weights and activations
with ``MXDynamicActivationMXWeightConfig`` (emulated kernels, bf16 activations). A block's
scale follows its largest value, so the range is e4m3's times 2**127 and a value is lost
only where it falls 2**17 below its block's largest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from autoprec.formats.base import CONVERT, QUANTIZE, Format, Limits
from autoprec.formats.blocks import BlockLayers, dims_refusal
from autoprec.formats.methods import (
    Quantizer,
    import_torchao,
    kernel_preference,
    torchao_quantize,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

BLOCK = 32
_CONFIG = "MXDynamicActivationMXWeightConfig"


def _round_trip(tensor: torch.Tensor) -> torch.Tensor:
    import_torchao()
    import torch
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(tensor, torch.float8_e4m3fn, BLOCK).dequantize(tensor.dtype)


def _config() -> Any:
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig

    return MXDynamicActivationMXWeightConfig(kernel_preference=kernel_preference((10, 0)))


class MXFP8(Format):
    name = "mxfp8"
    help = "OCP MXFP8: e4m3 in blocks of 32 sharing a power-of-two scale (Blackwell)"
    limits = Limits(448.0 * 2.0**127, 2.0**-133, 2.0**-136, 3)
    trains = CONVERT
    serves = QUANTIZE
    bytes_per_element = 1.0 + 1.0 / BLOCK
    colour = "#da8bc3"
    rest = "bf16"
    emulated_elsewhere = True
    activation_format = "bf16"
    methods = (
        Quantizer(
            "torchao-mxfp8",
            "mxfp8",
            ("cpu", "cuda"),
            "torchao",
            _CONFIG,
            True,
            False,
            "torchao has no MX kernels for {kind}",
            torchao_quantize(_config, bf16=True),
        ),
    )
    default_methods: ClassVar[dict[str, str]] = {"cpu": "torchao-mxfp8", "cuda": "torchao-mxfp8"}
    exports: ClassVar[dict[str, str]] = {
        "torchao": f"{_CONFIG}(block_size={BLOCK})",
        "torchtitan": "mxfp8",
    }

    def refusal(self, backend: Any) -> str | None:
        return backend.block_format_refusal(self.name, (10, 0))  # type: ignore[no-any-return]

    def layer_refusal(self, module: nn.Module) -> str | None:
        return dims_refusal(module, self.name, BLOCK)

    def convert(self, model: nn.Module, names: list[str], recipe: str | None) -> BlockLayers:
        return BlockLayers(model, names, self.name, _round_trip, BLOCK)

    def serving_layer_refusal(self, module: nn.Module, method: Quantizer | None) -> str | None:
        return dims_refusal(module, self.name, BLOCK)

    def holds(self, weight: Any) -> bool:
        element = str(getattr(weight, "elem_dtype", ""))
        return type(weight).__name__ == "MXTensor" and element == "torch.float8_e4m3fn"
