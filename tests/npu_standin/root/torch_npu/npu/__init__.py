"""``torch.npu`` as the STAND-IN provides it (torch_npu registers its ``npu`` module there).

Only the calls autoprec's NPUBackend and its torch-npu export make, on CPU tensors; any other
name is missing on purpose, so that a call the stand-in does not know fails loudly. Device
arguments are checked as torch_npu checks them, and every call is recorded in ``STANDIN``.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_npu.npu import amp
from torch_npu.standin import PRECISION_MODES, STANDIN

__all__ = [
    "amp",
    "conv",
    "current_device",
    "device_count",
    "empty_cache",
    "get_amp_supported_dtype",
    "is_available",
    "is_bf16_supported",
    "manual_seed_all",
    "matmul",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "set_device",
    "set_option",
    "synchronize",
]


def is_available() -> bool:
    return STANDIN.devices > 0


def device_count() -> int:
    return STANDIN.devices


def current_device() -> int:
    return STANDIN.current


def set_device(device: Any) -> None:
    STANDIN.current = STANDIN.index(device, "set_device")
    STANDIN.record("set_device", STANDIN.current)


def synchronize(device: Any = None) -> None:
    STANDIN.record("synchronize", STANDIN.index(device, "synchronize"))


def empty_cache() -> None:
    STANDIN.record("empty_cache", STANDIN.current)


def reset_peak_memory_stats(device: Any = None) -> None:
    STANDIN.record("reset_peak_memory_stats", STANDIN.index(device, "reset_peak_memory_stats"))


def max_memory_allocated(device: Any = None) -> int:
    """``STANDIN.peak_bytes``: a figure set by hand, since the stand-in allocates nothing."""
    STANDIN.record("max_memory_allocated", STANDIN.index(device, "max_memory_allocated"))
    return STANDIN.peak_bytes


def is_bf16_supported() -> bool:
    """True on 910B and later (the stand-in's SoC decides), as torch_npu answers it."""
    STANDIN.record("is_bf16_supported", STANDIN.current)
    return STANDIN.bf16_supported


def manual_seed_all(seed: int) -> None:
    """Called by ``torch.manual_seed``: the stand-in's tensors use the CPU's generator."""


def _is_in_bad_fork() -> bool:  # asked by torch.manual_seed of every device module
    return False


def get_amp_supported_dtype() -> list[torch.dtype]:
    """What torch.autocast asks a PrivateUse1 backend for."""
    return [torch.float16, torch.bfloat16]


def set_option(option: dict[str, str]) -> None:
    """torch_npu's ``set_option``, for the one option the export sets: ACL_PRECISION_MODE,
    whose only accepted values are allow_fp32_to_fp16 and must_keep_origin_dtype."""
    if not isinstance(option, dict):
        raise TypeError(f"torch.npu.set_option: expected a dict, got {type(option).__name__}")
    for key, value in option.items():
        if key != "ACL_PRECISION_MODE":
            raise ValueError(
                f"torch.npu.set_option: the stand-in knows only ACL_PRECISION_MODE, got {key!r}"
            )
        if value not in PRECISION_MODES:
            raise ValueError(
                f"torch.npu.set_option: ACL_PRECISION_MODE must be one of {PRECISION_MODES}, "
                f"got {value!r}"
            )
    STANDIN.options.update(option)
    STANDIN.record("set_option", dict(option))


class HF32Switch:
    """``torch.npu.matmul`` or ``torch.npu.conv``: the ``allow_hf32`` flag, a bool."""

    def __init__(self, kind: str) -> None:
        self._kind = kind

    @property
    def allow_hf32(self) -> bool:
        return STANDIN.hf32[self._kind]

    @allow_hf32.setter
    def allow_hf32(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"torch.npu.{self._kind}.allow_hf32: expected a bool, got {value!r}")
        STANDIN.hf32[self._kind] = value
        STANDIN.record(f"{self._kind}.allow_hf32", value)


matmul = HF32Switch("matmul")  # default off
conv = HF32Switch("conv")  # default on: fp32 convolutions run in HF32
