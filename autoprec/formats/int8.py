"""int8, for serving: a Linear layer's weights quantized to 8-bit integers with a scale, by
one of its methods; its inputs stay fp32, quantized by the layer itself.

The methods and their defaults were chosen by measuring (benchmarks/bench_int8.py and
benchmarks/README.md): torch's own dynamic quantization on the CPU; on CUDA torchao is the
only int8 with kernels there, weight-only its choice for memory-bound serving (not measured
here: no GPU was lent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from autoprec.formats.base import QUANTIZE, Format, Limits, is_plain_linear
from autoprec.formats.methods import Quantizer, torchao_config, torchao_quantize

if TYPE_CHECKING:
    from torch import nn


def _torch_dynamic(model: nn.Module, names: list[str]) -> None:
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    quantize_dynamic(model, dict.fromkeys(names, default_dynamic_qconfig), inplace=True)


_WEIGHT_ONLY = "Int8WeightOnlyConfig"
_DYNAMIC = "Int8DynamicActivationInt8WeightConfig"
_NO_KERNELS = "torchao has no int8 kernels for {kind}"


class INT8(Format):
    name = "int8"
    help = "8-bit integers with a scale per row: serving's quantized Linear layers"
    limits = Limits(127.0, 1.0, 1.0, 0)
    modes = ("serving",)
    trains = ""
    serves = QUANTIZE
    policy_records = True
    bytes_per_element = 1.0
    colour = "#8172b3"
    methods = (
        Quantizer(
            "dynamic",
            "int8",
            ("cpu",),
            "torch",
            _DYNAMIC,
            False,  # torchao's quantizes activations per token, torch's per tensor
            False,  # packed weights in TorchScript objects
            "torch's dynamic quantization runs on the CPU only",
            _torch_dynamic,
        ),
        Quantizer(
            "torchao-dynamic",
            "int8",
            ("cpu", "cuda"),
            "torchao",
            _DYNAMIC,
            True,
            True,
            _NO_KERNELS,
            torchao_quantize(torchao_config(_DYNAMIC)),
        ),
        Quantizer(
            "torchao-weight-only",
            "int8",
            ("cpu", "cuda"),
            "torchao",
            _WEIGHT_ONLY,
            True,
            True,
            _NO_KERNELS,
            torchao_quantize(torchao_config(_WEIGHT_ONLY)),
        ),
    )
    # The method a device kind serves with when none is named.
    default_methods: ClassVar[dict[str, str]] = {"cpu": "dynamic", "cuda": "torchao-weight-only"}

    def serving_layer_refusal(self, module: nn.Module, method: Quantizer | None) -> str | None:
        """An ``nn.Linear``, or transformers' Conv1D (converted to one first)."""
        if is_plain_linear(module) or type(module).__name__ == "Conv1D":
            return None
        kind = type(module).__name__
        return f"a {kind} is not an nn.Linear (or transformers' Conv1D), which int8 needs"

    def holds(self, weight: Any) -> bool:
        """torch's packed weights (``weight()``), or torchao's ``Int8Tensor``."""
        return callable(weight) or type(weight).__name__ == "Int8Tensor"
