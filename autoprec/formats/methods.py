"""How a quantizing format's layers are made for serving: the `Quantizer` (one method,
as a policy and ``--int8`` name it), declared by its format's module
(`autoprec.formats.int8`, `autoprec.formats.fp8`, ...), and torchao, imported quietly.
torch and torchao are imported only where a method runs.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


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
        import torch

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


def import_torchao() -> Any:
    """torchao, imported only where a method of its runs. On a machine without its
    optional CUDA kernels it logs "Failed to load ...so" lines, and torch's pytree a
    deprecation warning about torchao's enums, at import: not the user's to see."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torchao

    return torchao


def torchao_quantize(
    config: Callable[[], Any], bf16: bool = False
) -> Callable[[nn.Module, list[str]], None]:
    """Quantize the named layers of a model with torchao's ``quantize_`` and the config
    ``config()`` makes; with ``bf16``, the layers cast to bf16 first (torchao's MX and
    NVFP4 linears are bf16 in and out)."""

    def quantize(model: nn.Module, names: list[str]) -> None:
        import_torchao()
        import torch
        import torchao.quantization as quantization

        chosen = set(names)
        for name in chosen if bf16 else ():
            model.get_submodule(name).to(torch.bfloat16)
        quantization.quantize_(model, config(), filter_fn=lambda module, fqn: fqn in chosen)

    return quantize


def kernel_preference(capability: tuple[int, int]) -> Any:
    """torchao's ``KernelPreference``: its own kernels on a CUDA device of at least
    ``capability``, else emulated ones (real numerics, no speed)."""
    import_torchao()
    import torch
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    native = torch.cuda.is_available() and torch.cuda.get_device_capability() >= capability
    return KernelPreference.AUTO if native else KernelPreference.EMULATED


def torchao_config(name: str, **kwargs: str) -> Callable[[], Any]:
    """A maker of ``torchao.quantization``'s config ``name``, each keyword's value the name
    of a class of ``torchao.quantization`` made without arguments."""

    def make() -> Any:
        import_torchao()
        import torchao.quantization as quantization

        made = {key: getattr(quantization, value)() for key, value in kwargs.items()}
        return getattr(quantization, name)(**made)

    return make
