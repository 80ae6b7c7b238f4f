"""The quantizers: every way autoprec serves a layer in a quantized dtype, in one registry.

A serving policy names its method (``quantization: {int8: torchao-dynamic}``), the search
measures with it, and the conversion (`autoprec.serving.conversion`), the ``torchao``
export and the MLflow model all look it up here, so what is served is what was measured.
Each entry says where it runs, how it quantizes the named layers, which torchao config a
torchao workflow writes for it, whether ``torch.export`` can trace its weights, and what a
saved model needs installed. The fp8 serving methods are entries too (``dtype="fp8"``:
torchao's float8 weight-only and dynamic configs; where they run: `autoprec.serving.fp8`).

The int8 methods and their defaults were chosen by measuring (benchmarks/bench_int8.py and
benchmarks/README.md): torch's own dynamic quantization on the CPU; on CUDA torchao is the
only int8 with kernels there, weight-only its choice for memory-bound serving (not measured
here: no GPU was lent).
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.dtypes import FP8, INT8
from autoprec.errors import PolicyError


@dataclass(frozen=True)
class Quantizer:
    """One quantization method: ``name`` as a policy and ``--int8`` spell it, the dtype its
    layers are served in, the device kinds it has kernels for, and ``torchao_config``: the
    torchao config class a torchao workflow uses for it (``torchao_twin``: whether that
    config computes what this method computes, else it is only the nearest)."""

    name: str
    dtype: str
    device_kinds: tuple[str, ...]
    library: str  # "torch" or "torchao": what a saved model needs installed
    torchao_config: str
    torchao_twin: bool
    exports: bool  # whether torch.export traces the quantized weights
    elsewhere: str  # why it cannot run on another device kind ({kind})
    _quantize: Callable[[nn.Module, list[str]], None]
    # the torchao config's arguments: (keyword, torchao.quantization class made without
    # arguments), e.g. (("granularity", "PerRow"),)
    torchao_kwargs: tuple[tuple[str, str], ...] = ()

    @property
    def torchao_args(self) -> str:
        """The config's arguments as a torchao workflow writes them (``granularity=PerRow()``)."""
        return ", ".join(f"{key}={value}()" for key, value in self.torchao_kwargs)

    @property
    def torchao_imports(self) -> tuple[str, ...]:
        """What those arguments import from ``torchao.quantization``."""
        return tuple(value for _, value in self.torchao_kwargs)

    def torchao_config_object(self) -> Any:
        """The torchao config itself (for torch's own ``dynamic``, its nearest)."""
        import_torchao()
        import torchao.quantization as quantization

        kwargs = {key: getattr(quantization, value)() for key, value in self.torchao_kwargs}
        return getattr(quantization, self.torchao_config)(**kwargs)

    def unavailable_reason(self, device_kind: str) -> str | None:
        """Why this method cannot run on the device kind, in one line; None when it can."""
        where = f"{self.dtype} {self.name}"
        if self.library == "torchao" and importlib.util.find_spec("torchao") is None:
            return f"{where}: torchao is not installed (pip install torchao)"
        if device_kind not in self.device_kinds:
            return f"{where}: {self.elsewhere.format(kind=device_kind)}"
        if self.library == "torchao":
            return None
        engines = torch.backends.quantized.supported_engines
        if not {"x86", "fbgemm"} & set(engines):
            return f"{self.dtype} {self.name}: this torch has no x86/fbgemm quantized engine"
        if not hasattr(torch.ops.quantized, "linear_dynamic"):
            return f"{self.dtype} {self.name}: this torch has no quantized.linear_dynamic kernel"
        return None

    def quantize(self, model: nn.Module, names: list[str]) -> None:
        """The named ``nn.Linear`` layers of ``model`` quantized in place."""
        with warnings.catch_warnings():
            # torch.ao.quantization is deprecated in torch 2.13 but still the fastest here.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            self._quantize(model, names)

    def requirements(self) -> list[str]:
        """The pip requirements, beyond torch, a model saved with this method needs."""
        if self.library != "torchao":
            return []
        return [f"torchao=={import_torchao().__version__.split('+')[0]}"]


def _torch_dynamic(model: nn.Module, names: list[str]) -> None:
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    quantize_dynamic(model, dict.fromkeys(names, default_dynamic_qconfig), inplace=True)


def _torchao(config_name: str) -> Callable[[nn.Module, list[str]], None]:
    def quantize(model: nn.Module, names: list[str]) -> None:
        import_torchao()
        import torchao.quantization as quantization

        chosen = set(names)
        config = getattr(quantization, config_name)()
        quantization.quantize_(model, config, filter_fn=lambda module, fqn: fqn in chosen)

    return quantize


def _torchao_fp8(method: str) -> Callable[[nn.Module, list[str]], None]:
    """The registry's torchao float8 config of ``method`` on the named layers."""

    def quantize(model: nn.Module, names: list[str]) -> None:
        import_torchao()
        import torchao.quantization as quantization

        chosen = set(names)
        config = QUANTIZERS[method].torchao_config_object()
        quantization.quantize_(model, config, filter_fn=lambda module, fqn: fqn in chosen)

    return quantize


_FP8_WEIGHT_ONLY = "Float8WeightOnlyConfig"
_FP8_DYNAMIC = "Float8DynamicActivationFloat8WeightConfig"
_FP8_ELSEWHERE = (
    "torchao's float8 dynamic activations need CUDA compute capability 8.9 or later "
    "(H100, H200, L40, B200); {kind} has none"
)
_WEIGHT_ONLY = "Int8WeightOnlyConfig"
_DYNAMIC = "Int8DynamicActivationInt8WeightConfig"
QUANTIZERS: dict[str, Quantizer] = {
    q.name: q
    for q in (
        Quantizer(
            "dynamic",
            INT8,
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
            INT8,
            ("cpu", "cuda"),
            "torchao",
            _DYNAMIC,
            True,
            True,
            "torchao has no int8 kernels for {kind}",
            _torchao(_DYNAMIC),
        ),
        Quantizer(
            "torchao-weight-only",
            INT8,
            ("cpu", "cuda"),
            "torchao",
            _WEIGHT_ONLY,
            True,
            True,
            "torchao has no int8 kernels for {kind}",
            _torchao(_WEIGHT_ONLY),
        ),
        Quantizer(
            "torchao-fp8-weight-only",
            FP8,
            ("cpu", "cuda"),
            "torchao",
            _FP8_WEIGHT_ONLY,
            True,
            True,
            "torchao has no float8 kernels for {kind}",
            _torchao_fp8("torchao-fp8-weight-only"),
        ),
        Quantizer(
            "torchao-fp8-dynamic",
            FP8,
            ("cuda",),
            "torchao",
            _FP8_DYNAMIC,
            True,
            True,
            _FP8_ELSEWHERE,
            _torchao_fp8("torchao-fp8-dynamic"),
        ),
        Quantizer(
            "torchao-fp8-dynamic-rowwise",
            FP8,
            ("cuda",),
            "torchao",
            _FP8_DYNAMIC,
            True,
            True,
            _FP8_ELSEWHERE,
            _torchao_fp8("torchao-fp8-dynamic-rowwise"),
            (("granularity", "PerRow"),),
        ),
    )
}
INT8_METHODS: tuple[str, ...] = tuple(n for n, q in QUANTIZERS.items() if q.dtype == INT8)
# The method a device kind serves int8 with when none is named.
DEFAULT_INT8_METHOD = {"cpu": "dynamic", "cuda": "torchao-weight-only"}


def quantizer(method: str) -> Quantizer:
    """The registry's entry for ``method``; PolicyError naming the known ones otherwise."""
    if method not in QUANTIZERS:
        raise PolicyError(f"int8: unknown method {method!r} (expected {', '.join(INT8_METHODS)})")
    return QUANTIZERS[method]


def default_int8_method(device_kind: str) -> str | None:
    """The int8 method used on a device kind when none is named; None where int8 has no
    kernels."""
    return DEFAULT_INT8_METHOD.get(device_kind)


def int8_unavailable_reason(device_kind: str, method: str | None = None) -> str | None:
    """Why int8 cannot run on this device kind with this method (default: the device's),
    in one line; None when it can. Lets a search refuse int8 before any trial runs."""
    method = method or default_int8_method(device_kind)
    if method is None:
        return f"int8: no int8 kernels for {device_kind} in torch or torchao"
    if method not in QUANTIZERS:
        return f"int8: unknown method {method!r} (expected {', '.join(INT8_METHODS)})"
    return QUANTIZERS[method].unavailable_reason(device_kind)


def int8_available(device_kind: str, method: str | None = None) -> bool:
    """Whether int8 layers can run on this device kind (see `int8_unavailable_reason`)."""
    return int8_unavailable_reason(device_kind, method) is None


def import_torchao() -> Any:
    """torchao, imported only where a method of its runs. On a machine without its
    optional CUDA kernels it logs "Failed to load ...so" lines, and torch's pytree a
    deprecation warning about torchao's enums, at import: not the user's to see."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torchao

    return torchao
