"""MXFP4 (OCP microscaling), for serving: e2m1 values (4 bits: 1.5 significant bits) in
blocks of 32 that share one power-of-two (e8m0) scale, for Linear layers.

Blackwell GPUs run it natively. Elsewhere torchao's ``prototype.mx_formats`` emulates it
(``MXDynamicActivationMXWeightConfig`` with float4 weights and activations, emulated
kernels, bf16 activations around it): the numerics are MXFP4's, the speed is not. Training
in MXFP4 is not offered: torchao 0.18 has no MXFP4 training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from autoprec.formats.base import QUANTIZE, Format, Limits
from autoprec.formats.blocks import dims_refusal
from autoprec.formats.methods import Quantizer, kernel_preference, torchao_quantize

if TYPE_CHECKING:
    from torch import nn

BLOCK = 32
_CONFIG = "MXDynamicActivationMXWeightConfig"


def _config() -> Any:
    import torch
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig

    return MXDynamicActivationMXWeightConfig(
        activation_dtype=torch.float4_e2m1fn_x2,
        weight_dtype=torch.float4_e2m1fn_x2,
        kernel_preference=kernel_preference((10, 0)),
    )


class MXFP4(Format):
    name = "mxfp4"
    help = "OCP MXFP4: e2m1 in blocks of 32 sharing a power-of-two scale (serving)"
    limits = Limits(6.0 * 2.0**127, 2.0**-127, 2.0**-128, 1)
    modes = ("serving",)
    trains = ""
    serves = QUANTIZE
    bytes_per_element = 0.5 + 1.0 / BLOCK
    colour = "#8c8c8c"
    activation_format = "bf16"
    emulated_elsewhere = True
    methods = (
        Quantizer(
            "torchao-mxfp4",
            "mxfp4",
            ("cpu", "cuda"),
            "torchao",
            _CONFIG,
            True,
            False,
            "torchao has no MX kernels for {kind}",
            torchao_quantize(_config, bf16=True),
        ),
    )
    default_methods: ClassVar[dict[str, str]] = {"cpu": "torchao-mxfp4", "cuda": "torchao-mxfp4"}
    exports: ClassVar[dict[str, str]] = {
        "torchao": f"{_CONFIG}(activation_dtype=torch.float4_e2m1fn_x2, "
        "weight_dtype=torch.float4_e2m1fn_x2)",
    }

    def serving_layer_refusal(self, module: nn.Module, method: Quantizer | None) -> str | None:
        return dims_refusal(module, self.name, BLOCK)

    def holds(self, weight: Any) -> bool:
        element = str(getattr(weight, "elem_dtype", ""))
        return type(weight).__name__ == "MXTensor" and element == "torch.float4_e2m1fn_x2"
