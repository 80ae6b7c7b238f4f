"""NVFP4, for serving: e2m1 values in blocks of 16 that share an e4m3 scale, under one fp32
scale for the whole tensor, for Linear layers (NVIDIA Blackwell).

torchao's ``NVFP4WeightOnlyConfig`` stores the weights in NVFP4 and dequantizes them for a
bf16 matmul, which runs anywhere; the activations stay bf16. Activations in NVFP4 too
(``NVFP4DynamicActivationNVFP4WeightConfig``) need CUDA compute capability 10.0, and are
not offered. Training in NVFP4 is not offered: torchao 0.18 has no NVFP4 training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from autoprec.formats.base import QUANTIZE, Format, Limits
from autoprec.formats.blocks import dims_refusal
from autoprec.formats.methods import Quantizer, torchao_quantize

if TYPE_CHECKING:
    from torch import nn

BLOCK = 16
_CONFIG = "NVFP4WeightOnlyConfig"


def _config() -> Any:
    from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig

    return NVFP4WeightOnlyConfig()


class NVFP4(Format):
    name = "nvfp4"
    help = "NVFP4: e2m1 in blocks of 16 with an e4m3 scale, and an fp32 tensor scale (serving)"
    # The tensor's fp32 scale moves the whole range; within it, a block spans 6 * 448.
    limits = Limits(6.0 * 448.0 * 2.0**127, 2.0**-9 * 2.0**-126, 2.0**-10 * 2.0**-126, 1)
    modes = ("serving",)
    trains = ""
    serves = QUANTIZE
    bytes_per_element = 0.5 + 1.0 / BLOCK
    colour = "#ccb974"
    activation_format = "bf16"
    emulated_elsewhere = True
    methods = (
        Quantizer(
            "torchao-nvfp4-weight-only",
            "nvfp4",
            ("cpu", "cuda"),
            "torchao",
            _CONFIG,
            True,
            False,
            "torchao has no NVFP4 kernels for {kind}",
            torchao_quantize(_config, bf16=True),
        ),
    )
    default_methods: ClassVar[dict[str, str]] = {
        "cpu": "torchao-nvfp4-weight-only",
        "cuda": "torchao-nvfp4-weight-only",
    }
    exports: ClassVar[dict[str, str]] = {"torchao": f"{_CONFIG}()"}

    def serving_layer_refusal(self, module: nn.Module, method: Quantizer | None) -> str | None:
        return dims_refusal(module, self.name, BLOCK, out_block=BLOCK)

    def holds(self, weight: Any) -> bool:
        return type(weight).__name__ == "NVFP4Tensor"
