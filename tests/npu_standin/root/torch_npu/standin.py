"""What the torch_npu STAND-IN adds that torch_npu has not: its state, and how it hooks into torch.

Not Ascend: the "NPU" here is the CPU. ``STANDIN`` is the stand-in machine (how many chips,
which SoC, the figure its allocator reports) and a record of what was asked of it (device
calls, options, HF32 switches), so that tests can check what the backend called.

``attach`` makes torch see the stand-in as torch_npu makes torch see itself: ``npu`` becomes
torch's PrivateUse1 device name and ``torch.npu`` the stand-in's module. Two things torch_npu
does in C++ cannot be done for CPU tensors, so ``attach`` patches torch in two places:

- ``torch.autocast("npu", ...)`` runs as ``torch.autocast("cpu", ...)``. The real NPU autocast
  is torch's AutocastPrivateUse1 key, which applies only to tensors on the NPU; CPU tensors
  would pass through it uncast. So the CPU's op lists apply, not torch_npu's (LayerNorm
  follows its input instead of running in fp32).
- ``Tensor.to("npu:N")`` (and so ``Module.to``) checks N and leaves the tensor on the CPU:
  a PrivateUse1 tensor needs a device allocator, which the stand-in does not have.

``detach`` undoes both and puts an inert ``torch.npu`` in the stand-in's place (no device);
torch cannot rename PrivateUse1 back, so ``torch.device("npu")`` keeps parsing in that
process, and torch keeps asking ``torch.npu`` for its accelerator's current device.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

PRECISION_MODES = ("allow_fp32_to_fp16", "must_keep_origin_dtype")  # torch_npu accepts no other
DEFAULT_SOC = "Ascend910B3"
BF16_SOC_PREFIXES = ("Ascend910B", "Ascend910_93")  # 910B and later (A2, A3); not 910A or 310P
DEVICES_ENV = "NPU_STANDIN_DEVICES"  # chips on the stand-in machine (default 1)
SOC_ENV = "NPU_STANDIN_SOC"  # e.g. Ascend910A: no bf16, allow_fp32_to_fp16 by default
VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"  # as on Ascend: the chips this process sees


@dataclass
class StandIn:
    """The stand-in machine and what was asked of it; tests read it and may change it."""

    devices: int = 1
    soc: str = DEFAULT_SOC
    peak_bytes: int = 2**20  # what max_memory_allocated reports: a fixed figure, not measured
    current: int = 0
    hf32: dict[str, bool] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def bf16_supported(self) -> bool:
        return self.soc.startswith(BF16_SOC_PREFIXES)

    def reset(self) -> None:
        """Back to a fresh process: the machine from the environment, torch_npu's defaults."""
        chips = int(os.environ.get(DEVICES_ENV, "1"))
        visible = os.environ.get(VISIBLE_ENV)
        if visible is not None:
            chips = sum(1 for i in visible.split(",") if i.strip() and int(i) < chips)
        self.devices = chips
        self.soc = os.environ.get(SOC_ENV, DEFAULT_SOC)
        self.peak_bytes = 2**20
        self.current = 0
        self.hf32 = {"matmul": False, "conv": True}
        mode = "must_keep_origin_dtype" if self.bf16_supported else "allow_fp32_to_fp16"
        self.options = {"ACL_PRECISION_MODE": mode}
        self.calls = []

    def record(self, name: str, value: Any) -> None:
        self.calls.append((name, value))

    def calls_to(self, name: str) -> list[Any]:
        """The arguments of every call to ``name``, in order."""
        return [value for called, value in self.calls if called == name]

    def index(self, device: Any, caller: str) -> int:
        """The chip ``device`` names (None: the current one), checked as torch_npu checks it."""
        if device is None:
            return self.current
        if isinstance(device, int) and not isinstance(device, bool):
            index = device
        elif isinstance(device, str | torch.device):
            parsed = torch.device(device)
            if parsed.type != "npu":
                raise ValueError(f"torch.npu.{caller}: expected an NPU device, got {device!r}")
            index = self.current if parsed.index is None else parsed.index
        else:
            raise TypeError(f"torch.npu.{caller}: expected an NPU device, got {device!r}")
        if not 0 <= index < self.devices:
            raise RuntimeError(
                f"torch.npu.{caller}: invalid device {index} ({self.devices} NPU(s) visible)"
            )
        return index


STANDIN = StandIn()
STANDIN.reset()


class CPUAutocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast`` with device type ``npu`` run as the CPU's (see the module docstring)."""

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        if device_type == "npu":
            STANDIN.record("autocast", dtype if enabled else None)
            device_type = "cpu"
        super().__init__(device_type, dtype, enabled, cache_enabled)


def _on_cpu(value: Any) -> Any:
    """``value`` with an NPU device replaced by the CPU (other values as they are)."""
    if isinstance(value, str | torch.device) and str(value).split(":")[0] == "npu":
        STANDIN.index(value, "Tensor.to")
        return torch.device("cpu")
    return value


_patched: dict[str, Any] = {}


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    args = tuple(_on_cpu(a) for a in args)
    kwargs = {k: _on_cpu(v) if k == "device" else v for k, v in kwargs.items()}
    return _patched["Tensor.to"](self, *args, **kwargs)


def attach(npu_module: ModuleType) -> None:
    """Register ``npu_module`` as ``torch.npu`` and patch torch as the module docstring says;
    a second call does nothing."""
    if _patched:
        return
    torch.utils.rename_privateuse1_backend("npu")  # as torch_npu does
    _unregister()  # the inert module an earlier detach left
    torch._register_device_module("npu", npu_module)  # torch.npu, as torch_npu does
    _patched.update(
        {
            "Tensor.to": torch.Tensor.to,
            "Tensor.to own": "to" in vars(torch.Tensor),  # else inherited from TensorBase
            "autocast": torch.autocast,
            "amp.autocast": torch.amp.autocast,
        }
    )
    torch.Tensor.to = _to  # type: ignore[method-assign]
    torch.autocast = CPUAutocast  # type: ignore[misc]
    torch.amp.autocast = CPUAutocast  # type: ignore[misc]


def detach() -> None:
    """Undo ``attach`` (all but the PrivateUse1 name, which torch cannot take back)."""
    if not _patched:
        return
    if _patched["Tensor.to own"]:
        torch.Tensor.to = _patched["Tensor.to"]  # type: ignore[method-assign]
    else:
        del torch.Tensor.to
    torch.autocast = _patched["autocast"]  # type: ignore[misc]
    torch.amp.autocast = _patched["amp.autocast"]  # type: ignore[misc]
    _patched.clear()
    _unregister()
    # torch keeps "npu" as its accelerator's name (PrivateUse1 cannot be renamed back), and
    # asks its module for the current device wherever it looks for an accelerator (Dynamo
    # does, on every compiled frame): an inert module answers that there is none.
    torch._register_device_module("npu", _inert_module())


def _unregister() -> None:
    if hasattr(torch, "npu"):
        delattr(torch, "npu")
    sys.modules.pop("torch.npu", None)
    cached = getattr(torch.get_device_module, "cache_clear", None)  # functools.cache'd
    if cached is not None:
        cached()


def _inert_module() -> ModuleType:
    """``torch.npu`` once the stand-in is detached: no device, device 0 current."""
    inert = ModuleType("torch.npu")
    inert.is_available = lambda: False  # type: ignore[attr-defined]
    inert.is_initialized = lambda: False  # type: ignore[attr-defined]
    inert.device_count = lambda: 0  # type: ignore[attr-defined]
    inert.current_device = lambda: 0  # type: ignore[attr-defined]
    return inert
