"""One backend interface for the CPU, CUDA GPUs and Ascend NPUs.

A backend knows its autocast device type, how to synchronise, which dtypes it runs,
which precision switches it has (TF32 on CUDA, HF32 on NPU), and how to measure peak
memory: from the device allocator on CUDA and NPU, and on the CPU as a labelled
estimate (parameters, gradients and optimizer state, plus the bytes of tensors saved
for backward, counted once per storage).

The NPU path is written from torch_npu's documented API (see shared/NPU.md); no Ascend
chip was reachable, so CI runs it against a stand-in for torch_npu on CPU tensors
(tests/npu_standin): its code paths are tested, its numerics and memory figures never were.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

import autoprec.formats as formats
from autoprec.dtypes import TORCH_DTYPES
from autoprec.errors import DeviceError, first_line

# The names the device code has always used for `autoprec.dtypes`' sets (one definition).
DTYPES = TORCH_DTYPES
_MB = 2.0**20
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|npu)(?::(\d+))?$")
_RANGE = re.compile(r"^(cuda|npu):(\d+)-(\d+)$")

# What autocast does to a module with parameters, by device kind, from torch's per-device
# op lists (aten/src/ATen/autocast_mode.cpp; torch_npu's follow CUDA's, see NPU.md) and,
# for the CPU, checked by running it (tests/test_dtype_truth.py):
# - FIXED_FP32: computes in fp32 whatever the region's dtype (the op is on autocast's
#   fp32 list, or the module returns its fp32 weights' dtype, as an embedding lookup does);
# - FOLLOWS_INPUT: on no list, so it computes in the dtype of its input (BatchNorm on every
#   device; LayerNorm and GroupNorm too on the CPU, where they are on no list);
# - every other module with parameters runs matmuls or convolutions, which autocast casts
#   to the region's dtype; a class not named here (torch's LSTM and GRU, a user's own) is
#   probed before a plan trusts that (`autoprec.numerics.observe.probe`).
# Names are matched against every class in the module's MRO.
FIXED_FP32: dict[str, frozenset[str]] = {
    "cpu": frozenset({"Embedding", "EmbeddingBag"}),
    "cuda": frozenset({"Embedding", "EmbeddingBag", "LayerNorm", "GroupNorm"}),
    "npu": frozenset({"Embedding", "EmbeddingBag", "LayerNorm", "GroupNorm"}),
}
FOLLOWS_INPUT: dict[str, frozenset[str]] = {
    "cpu": frozenset({"_NormBase", "LayerNorm", "GroupNorm", "RMSNorm", "LocalResponseNorm"}),
    "cuda": frozenset({"_NormBase", "RMSNorm", "LocalResponseNorm"}),
    "npu": frozenset({"_NormBase", "RMSNorm", "LocalResponseNorm"}),
}
DEVICE_KINDS = ("cpu", "cuda", "npu")
# `autocast_behaviour` of a module autocast computes in fp32 whatever the region.
FIXED = "fp32"
# fp8 training (torch._scaled_mm) needs Ada or Hopper and later: H100, H200, L40, B200.
FP8_MIN_CAPABILITY = (8, 9)
FP8 = "fp8"  # the format the fp8 methods below are about (`autoprec.formats.fp8`)
NPU_NO_FP8 = "fp8: Ascend 910 NPUs have no fp8 matmuls (torchao's float8 needs CUDA 8.9+)"


def emulatable() -> tuple[str, ...]:
    """What a backend may be told to emulate (real numerics, no speed): the formats that
    say they may run emulated (`autoprec.formats.Format.emulated_elsewhere`)."""
    return tuple(f.name for f in formats.all_formats() if f.emulated_elsewhere)


def check_emulate(emulate: str | Iterable[str] | None) -> frozenset[str]:
    """The dtypes to emulate (``--emulate fp8``), checked: only `emulatable` ones can be."""
    names = [emulate] if isinstance(emulate, str) else list(emulate or ())
    for name in names:
        if name not in emulatable():
            raise DeviceError(f"--emulate {name!r}: only {', '.join(emulatable())} can be emulated")
    return frozenset(names)


def device_kind(
    device: str | torch.device | Backend | None, model: torch.nn.Module | None = None
) -> str:
    """``cpu``, ``cuda`` or ``npu`` for a device, a device string or a backend (None: where
    ``model``'s parameters are, else the CPU); no availability check, so that the tables
    of another device can be read anywhere."""
    if isinstance(device, Backend):
        return device.kind
    if device is None and model is not None:
        device = next((p.device for p in model.parameters()), None)
    # Parsed by hand: torch without torch_npu does not know the "npu" device type.
    kind = str("cpu" if device is None else getattr(device, "type", device)).split(":")[0]
    if kind not in DEVICE_KINDS:
        raise DeviceError(f"device {str(device)!r}: expected cpu, cuda or npu")
    return kind


# What watching real modules run found (autoprec.numerics.observe.learn), per device kind and module
# class: it overrides the tables above, which stay the first guess for classes not seen.
_LEARNED: dict[tuple[str, type], str] = {}
_FAILS: dict[tuple[str, type], dict[str, str]] = {}
# The low dtypes autocast was seen to fail in (why) where a cast of the module ran instead:
# its parameters and inputs in the dtype, autocast off (`autoprec.numerics.observe`).
_CASTS: dict[tuple[str, type], dict[str, str]] = {}
# What running one module alone on an input made from its parameters found
# (autoprec.numerics.observe.probe), per device kind, class and parameter dtypes (an fp32 weight
# promotes an upcasting norm's product, a bf16 one may not); None where no input could be
# made. Below what was watched on real inputs, above the tables.
_PROBED: dict[tuple[str, type, tuple[torch.dtype, ...]], str | None] = {}


def record_behaviour(kind: str, cls: type, behaviour: str) -> None:
    """Record how autocast was seen to treat modules of ``cls`` on this device kind."""
    _LEARNED[(kind, cls)] = behaviour


def record_failure(kind: str, cls: type, dtype: str, reason: str) -> None:
    """Record that modules of ``cls`` were seen to fail in ``dtype`` on this device kind."""
    _FAILS.setdefault((kind, cls), {})[dtype] = reason.splitlines()[0][:300] if reason else ""


def record_cast(kind: str, cls: type, dtype: str, reason: str) -> None:
    """Record that autocast fails modules of ``cls`` in ``dtype`` on this device kind
    (``reason``: its error) while a cast of the module runs there."""
    _CASTS.setdefault((kind, cls), {})[dtype] = reason.splitlines()[0][:300] if reason else ""


def cast_dtypes(kind: str, module: torch.nn.Module) -> dict[str, str]:
    """The low dtypes this module lands in by a cast on this device kind (autocast fails
    there, a cast ran), with autocast's error."""
    return dict(_CASTS.get((kind, type(module)), {}))


def _probe_key(kind: str, module: torch.nn.Module) -> tuple[str, type, tuple[torch.dtype, ...]]:
    return kind, type(module), tuple(p.dtype for p in module.parameters(recurse=False))


def record_probed(kind: str, module: torch.nn.Module, behaviour: str | None) -> None:
    """Record how autocast was seen to treat ``module`` run alone on an input made for it
    (None: no input could be made), for modules of its class and parameter dtypes."""
    _PROBED[_probe_key(kind, module)] = behaviour


def was_probed(kind: str, module: torch.nn.Module) -> bool:
    """Whether modules like ``module`` were probed on this device kind already."""
    return _probe_key(kind, module) in _PROBED


def forget_watched(kind: str) -> None:
    """Forget what was watched on this device kind (a stand-in device's tests start anew)."""
    stores: tuple[dict[Any, Any], ...] = (_LEARNED, _FAILS, _CASTS, _PROBED)
    for store in stores:
        for key in [k for k in store if k[0] == kind]:
            del store[key]


def learned_behaviour(kind: str, cls: type) -> str | None:
    """What was observed for ``cls`` on this device kind (None: not watched yet)."""
    return _LEARNED.get((kind, cls))


def failing_dtypes(kind: str, module: torch.nn.Module) -> dict[str, str]:
    """The low dtypes this module was seen to fail in on this device kind, with why."""
    return dict(_FAILS.get((kind, type(module)), {}))


def autocast_behaviour(kind: str, module: torch.nn.Module) -> str:
    """``"fp32"``, ``"input"``, ``"cast"`` or ``"region"``: whether autocast on this
    device kind runs the module in fp32 whatever the region, in its input's dtype, only on
    inputs already cast to the region's dtype (so a plan casts them), or in the region's;
    as observed where the module's class was watched (`autoprec.numerics.observe.learn`), else as
    probed on an input made for it (`autoprec.numerics.observe.probe`), else from the tables."""
    learned = _LEARNED.get((kind, type(module))) or _PROBED.get(_probe_key(kind, module))
    return learned if learned is not None else table_behaviour(kind, module)


def table_behaviour(kind: str, module: torch.nn.Module) -> str:
    """What the tables above say of the module on this device kind (the first guess, before
    anything was watched): ``"fp32"``, ``"input"`` or ``"region"``."""
    names = {cls.__name__ for cls in type(module).__mro__}
    if names & FIXED_FP32[kind]:
        return FIXED
    if names & FOLLOWS_INPUT[kind]:
        return "input"
    return "region"


def npu_available() -> bool:
    """True when torch_npu imports and sees an NPU; never raises (see NPU.md, Detection)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
    except Exception:  # missing CANN libraries, or a CUDA build of torch beside it
        return False
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # torch_npu's probe: never raises (NPU.md)
        return False


class Backend:
    """Base class: the operations a trial needs from a device."""

    kind = "cpu"
    visible_devices_env: str | None = None
    emulate: frozenset[str] = frozenset()  # the dtypes it may run emulated (`get_backend`)

    def __init__(self, index: int | None = None, emulate: Iterable[str] = ()) -> None:
        self.index = index
        self.device = torch.device(self.kind if index is None else f"{self.kind}:{index}")
        self.emulate = check_emulate(emulate)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    @property
    def name(self) -> str:
        return str(self.device)

    def supports(self, dtype: str) -> bool:
        """Whether layers train in ``dtype`` here: a region's dtype where the device has
        it (`has_dtype`), a converted layer's where its format does not refuse the device."""
        found = formats.get(dtype)
        return bool(found.trains) and found.refusal(self) is None

    def emulates(self, name: str) -> bool:
        """Whether it was told to run the format ``name`` emulated (``--emulate``)."""
        return name in self.emulate

    def has_dtype(self, dtype: torch.dtype) -> bool:
        """Whether the device computes in this torch dtype (every one, on the CPU)."""
        return True

    def block_format_refusal(self, name: str, capability: tuple[int, int]) -> str | None:
        """Why a block-scaled format (`autoprec.formats.blocks`; MX, NVFP4) whose kernels
        need CUDA ``capability`` does not run here (None: it runs, natively or emulated
        where opted into with ``--emulate NAME``)."""
        if name in self.emulate:
            return None
        return (
            f"{name} runs natively on CUDA compute capability {capability[0]}.{capability[1]} "
            f"or later only; {self.name} emulates it (torchao's mx_formats: real numerics, "
            f"no speed) where opted into with --emulate {name}"
        )

    def fp8_refusal(self) -> str | None:
        """Why fp8 does not run here at all, in one line (None: it runs, natively or
        emulated where opted into): what serving and training share."""
        return None

    def fp8_training_refusal(self) -> str | None:
        """Why fp8 layers do not train here (torchao's float8 training), in one line
        (None: they do)."""
        return self.fp8_refusal()

    def check_training_emulation(self) -> None:
        """Raises DeviceError, in one line, where a dtype asked for emulated (``--emulate``)
        cannot train here: what a training search or a profile would otherwise leave out
        of its space without a word."""
        for name in sorted(self.emulate):
            refusal = formats.get(name).refusal(self)
            if refusal is not None:
                raise DeviceError(f"--emulate {name}: {refusal}")

    def emulated(self) -> tuple[str, ...]:
        """The dtypes this backend runs emulated (their step times and memory are no
        device's): recorded with every figure measured on it."""
        return ()

    def compute_capability(self) -> str:
        """The device's compute capability as recorded with every trial: ``9.0`` on an
        H100 or H200, the chip's name on an NPU where torch_npu gives it (``unknown``
        where not), ``none`` on the CPU, which has no such thing."""
        return "none"

    def selected(self) -> contextlib.AbstractContextManager[Any]:
        """This device as the current one while the block runs (``cuda:1`` or ``npu:3``
        in a single process), so that synchronisation, memory statistics, capability
        checks and cache emptying all act on it; the previous one is put back."""
        return contextlib.nullcontext()

    def empty_cache(self) -> None:
        """Give cached device memory back between trials."""

    def synchronize(self) -> None:
        """Wait for queued device work, so that host timers measure it."""

    def now_s(self) -> float:
        """A timestamp in seconds taken after synchronising the device."""
        self.synchronize()
        return time.perf_counter()

    def autocast(self, dtype: str) -> contextlib.AbstractContextManager[Any]:
        found = formats.get(dtype)
        if found.reference:
            return torch.autocast(self.kind, enabled=False)
        return torch.autocast(self.kind, dtype=found.torch_dtype())

    def switches(self) -> dict[str, bool]:
        """The device's silent precision reductions (TF32, HF32) as they are set now."""
        return {}

    def set_switches(self, tf32: bool | None = None, hf32: bool | None = None) -> dict[str, bool]:
        """Set the switches given (None leaves one as it is); returns the previous values."""
        return {}

    def restore_switches(self, previous: dict[str, bool]) -> None:
        """Put back what ``set_switches`` returned."""

    def memory_meter(self) -> MemoryMeter:
        return AllocatorMemoryMeter(self)

    def reset_peak_memory(self) -> None:
        raise NotImplementedError

    def max_memory_allocated_bytes(self) -> int:
        raise NotImplementedError


class CPUBackend(Backend):
    kind = "cpu"

    def fp8_refusal(self) -> str | None:
        if self.emulates(FP8):
            return None
        return (
            "fp8 on the CPU is emulated (torch._scaled_mm: real numerics, no fp8 speed); "
            "opt in with --emulate fp8 (SearchConfig(emulate=['fp8']), "
            "policy.apply(model, emulate='fp8'))"
        )

    def fp8_training_refusal(self) -> str | None:
        if (refusal := self.fp8_refusal()) is not None:
            return refusal
        missing = cpu_scaled_mm_error()
        if missing is None:
            return None
        return (
            "fp8 training is emulated with torch._scaled_mm, which has no kernel on this CPU "
            "(oneDNN's fp8 matmul needs AVX-512 FP16, as on Xeon Sapphire Rapids and "
            f"later): {missing}"
        )

    def emulated(self) -> tuple[str, ...]:
        return tuple(sorted(self.emulate))

    def memory_meter(self) -> MemoryMeter:
        return EstimatedMemoryMeter()


@functools.cache
def cpu_scaled_mm_error() -> str | None:
    """Why torch._scaled_mm (what torchao's float8 training runs on the CPU) fails on this
    CPU, tried once on 32 x 32 x 64 operands as torchao calls it (None: it runs): the forward's
    e4m3 x e4m3 with fast accumulation, the backward's e5m2 x e4m3 without. oneDNN
    dispatches it by the CPU's instruction set (``ONEDNN_MAX_CPU_ISA`` caps it), and
    ATen's own CPU capability changes which calls reach oneDNN."""
    one = torch.tensor(1.0)
    calls = [
        (torch.float8_e4m3fn, torch.float8_e4m3fn, True),
        (torch.float8_e5m2, torch.float8_e4m3fn, False),
    ]
    try:
        # After a bf16 matmul, as in training (the first oneDNN call can take another path).
        torch.ones(32, 32, dtype=torch.bfloat16) @ torch.ones(32, 64, dtype=torch.bfloat16)
        for left, right, fast in calls:
            a = torch.ones(32, 32).to(left)
            b = torch.ones(64, 32).to(right).t()
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)
    except RuntimeError as error:
        return first_line(error, 120)
    return None


class CUDABackend(Backend):
    kind = "cuda"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def has_dtype(self, dtype: torch.dtype) -> bool:
        if dtype is torch.bfloat16:
            with self.selected():
                return bool(torch.cuda.is_bf16_supported())
        return True

    def block_format_refusal(self, name: str, capability: tuple[int, int]) -> str | None:
        return (
            None
            if self.capability() >= capability
            else super().block_format_refusal(name, capability)
        )

    def capability(self) -> tuple[int, int]:
        """The GPU's compute capability (``(9, 0)`` on an H100 or H200)."""
        major, minor = torch.cuda.get_device_capability(self.device)
        return int(major), int(minor)

    def compute_capability(self) -> str:
        return ".".join(map(str, self.capability()))

    def fp8_refusal(self) -> str | None:
        capability = self.capability()
        if capability >= FP8_MIN_CAPABILITY:
            return None
        return (
            f"fp8 needs CUDA compute capability {'.'.join(map(str, FP8_MIN_CAPABILITY))} or "
            f"later (H100, H200, L40, B200); {self.name} has {capability[0]}.{capability[1]}"
        )

    def selected(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self.device)

    def empty_cache(self) -> None:
        with self.selected():
            torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def switches(self) -> dict[str, bool]:
        """TF32 for matmuls and for cuDNN convolutions, recorded separately. Empty when the
        process set torch's newer ``fp32_precision`` API, which refuses the legacy flags."""
        try:
            return {
                "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
            }
        except RuntimeError:
            return {}

    def set_switches(self, tf32: bool | None = None, hf32: bool | None = None) -> dict[str, bool]:
        previous = self.switches()
        if tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        return previous

    def restore_switches(self, previous: dict[str, bool]) -> None:
        if "tf32_matmul" in previous:
            torch.backends.cuda.matmul.allow_tf32 = previous["tf32_matmul"]
            torch.backends.cudnn.allow_tf32 = previous["tf32_cudnn"]

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def max_memory_allocated_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


class NPUBackend(Backend):
    """Ascend NPU through torch_npu (written from the documented API; run in CI against a
    CPU stand-in for torch_npu, never on a chip)."""

    kind = "npu"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"

    @staticmethod
    def _npu() -> Any:
        return torch.npu  # type: ignore[attr-defined]

    def has_dtype(self, dtype: torch.dtype) -> bool:
        if dtype is torch.bfloat16:  # 910B and later; not 910A or 310P
            with self.selected():
                return bool(self._npu().is_bf16_supported())
        return True

    def block_format_refusal(self, name: str, capability: tuple[int, int]) -> str | None:
        return f"{name}: Ascend 910 NPUs have no block-scaled (MX, NVFP4) matmuls"

    def fp8_refusal(self) -> str | None:
        return NPU_NO_FP8

    def compute_capability(self) -> str:
        """The chip's name (``Ascend910B3``): Ascend parts have no CUDA-style capability."""
        name_of = getattr(self._npu(), "get_device_name", None)
        try:
            return str(name_of(self.index or 0)) if name_of is not None else "unknown"
        except Exception:  # torch_npu's query failed: the trial still runs
            return "unknown"

    @contextlib.contextmanager
    def selected(self) -> Iterator[None]:
        npu = self._npu()
        previous = npu.current_device()
        npu.set_device(self.device)
        try:
            yield
        finally:
            npu.set_device(previous)

    def empty_cache(self) -> None:
        with self.selected():
            self._npu().empty_cache()

    def synchronize(self) -> None:
        self._npu().synchronize(self.device)

    def switches(self) -> dict[str, bool]:
        npu = self._npu()
        return {
            "hf32_matmul": bool(npu.matmul.allow_hf32),
            "hf32_conv": bool(npu.conv.allow_hf32),
        }

    def set_switches(self, tf32: bool | None = None, hf32: bool | None = None) -> dict[str, bool]:
        previous = self.switches()
        if hf32 is not None:
            self._npu().matmul.allow_hf32 = hf32
            self._npu().conv.allow_hf32 = hf32
        return previous

    def restore_switches(self, previous: dict[str, bool]) -> None:
        npu = self._npu()
        if "hf32_matmul" in previous:
            npu.matmul.allow_hf32 = previous["hf32_matmul"]
            npu.conv.allow_hf32 = previous["hf32_conv"]

    def reset_peak_memory(self) -> None:
        self._npu().reset_peak_memory_stats(self.device)

    def max_memory_allocated_bytes(self) -> int:
        return int(self._npu().max_memory_allocated(self.device))


_BACKENDS: dict[str, type[Backend]] = {"cpu": CPUBackend, "cuda": CUDABackend, "npu": NPUBackend}


def fp8_unavailable_reason(
    device: str | torch.device | Backend | None, model: torch.nn.Module | None = None
) -> str | None:
    """Why fp8 training does not run on ``device`` (None: where ``model``'s parameters
    are), in one line; None where it runs. Only a Backend can say it emulates fp8."""
    if isinstance(device, Backend):
        return device.fp8_training_refusal()
    kind = device_kind(device, model)
    if kind == "npu":
        return NPU_NO_FP8
    if kind == "cpu":
        return CPUBackend().fp8_training_refusal()
    return get_backend(kind if device is None else device).fp8_training_refusal()


def visible_devices_env(kind: str) -> str | None:
    """The environment variable that restricts a process to some devices of a kind
    (``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``); None for the CPU."""
    return _BACKENDS[kind].visible_devices_env


def get_backend(
    device: str | torch.device | Backend | None = "auto", emulate: str | Iterable[str] = ()
) -> Backend:
    """The backend for ``auto``, ``cpu``, ``cuda[:N]`` or ``npu[:N]``; ``emulate``: the
    dtypes it may run emulated (``fp8`` on the CPU, for tests: opted into, never silent).

    ``auto`` picks an NPU, then a CUDA GPU, then the CPU. A device that is not there
    raises DeviceError.
    """
    wanted = check_emulate(emulate)
    if isinstance(device, Backend):
        if wanted <= device.emulate:
            return device
        widened = copy.copy(device)
        widened.emulate = device.emulate | wanted
        return widened
    text = "auto" if device is None else str(device).strip().lower()
    match = _DEVICE_PATTERN.fullmatch(text)
    if not match:
        raise DeviceError(
            f"device {text!r}: unknown device (expected auto, cpu, cuda, cuda:N, npu or npu:N)"
        )
    kind, index_text = match.group(1), match.group(2)
    index = None if index_text is None else int(index_text)
    if kind == "auto":
        if index is not None:
            raise DeviceError(f"device {text!r}: 'auto' takes no index")
        if npu_available():
            kind = "npu"
        elif torch.cuda.is_available():
            kind = "cuda"
        else:
            kind = "cpu"
    if kind == "cpu":
        if index not in (None, 0):
            raise DeviceError(f"device {text!r}: the CPU has no index {index}")
        return CPUBackend(emulate=wanted)
    count = _device_count(kind)
    if count == 0:
        raise DeviceError(f"device {text!r}: no {kind.upper()} device is available on this machine")
    if index is not None and index >= count:
        raise DeviceError(f"device {text!r}: only {count} {kind.upper()} device(s) are visible")
    return _BACKENDS[kind](0 if index is None else index, emulate=wanted)


def parse_devices(text: str | Sequence[str] | None) -> list[str]:
    """``npu:0-7``, ``cuda:0,cuda:1`` or ``cpu`` as a list of device strings."""
    if text is None:
        return []
    items = text.split(",") if isinstance(text, str) else list(text)
    devices: list[str] = []
    for item in (i.strip().lower() for i in items):
        match = _RANGE.fullmatch(item)
        if match:
            kind, first, last = match.group(1), int(match.group(2)), int(match.group(3))
            if last < first:
                raise DeviceError(f"--devices {text!r}: empty range {item!r}")
            devices += [f"{kind}:{i}" for i in range(first, last + 1)]
        elif re.match(r"^(cpu|(cuda|npu):\d+)$", item):
            devices.append(item)
        else:
            raise DeviceError(
                f"--devices {text!r}: expected e.g. npu:0-7, cuda:0,cuda:1 or cpu, got {item!r}"
            )
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) > 1:
        raise DeviceError(f"--devices {text!r}: one kind of device per search")
    if len(set(devices)) != len(devices):
        raise DeviceError(f"--devices {text!r}: a device is listed twice")
    return devices


def _device_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "npu":
        return int(torch.npu.device_count()) if npu_available() else 0  # type: ignore[attr-defined]
    return 1


class MemoryMeter:
    """Measures the peak memory of a run of training steps."""

    is_estimate = False

    def start(self, model: torch.nn.Module) -> None:
        """Begin measuring (before the first step)."""

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step (forward, backward, optimizer step)."""
        yield

    def peak_mb(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        raise NotImplementedError

    def split_mb(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, float] | None:
        """The peak split into weights, gradients, optimizer state and activations, where
        the meter counts them apart (the CPU's estimate); None elsewhere."""
        return None


class AllocatorMemoryMeter(MemoryMeter):
    """Peak bytes the device's caching allocator handed out (CUDA and NPU), over the
    measured steps only."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.peak_bytes = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.backend.synchronize()
        self.backend.reset_peak_memory()
        yield
        self.backend.synchronize()
        self.peak_bytes = max(self.peak_bytes, self.backend.max_memory_allocated_bytes())

    def peak_mb(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        return self.peak_bytes / _MB


class EstimatedMemoryMeter(MemoryMeter):
    """An honest estimate for the CPU, which has no allocator statistics.

    Peak = bytes of parameters, gradients and optimizer state, plus the largest total
    of tensors saved for backward in any one step (each storage counted once, storages
    shared with parameters left out since they are counted already). Autocast's
    low-precision copies of weights are saved tensors of their own and are counted.
    Temporaries freed inside a step and allocator fragmentation are not counted.
    """

    is_estimate = True

    def __init__(self) -> None:
        self.max_saved_bytes = 0
        self._parameter_ptrs: set[int] = set()

    def start(self, model: torch.nn.Module) -> None:
        self._parameter_ptrs = set(_storages(list(model.parameters())))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        saved = sum(n for ptr, n in storages.items() if ptr not in self._parameter_ptrs)
        self.max_saved_bytes = max(self.max_saved_bytes, saved)

    def peak_mb(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        tensors: list[torch.Tensor] = []
        for param in model.parameters():
            tensors.append(param)
            if param.grad is not None:
                tensors.append(param.grad)
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        static_bytes = sum(_storages(tensors).values())
        return (static_bytes + self.max_saved_bytes) / _MB

    def split_mb(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, float] | None:
        parameters: list[torch.Tensor] = list(model.parameters())
        states = [
            value
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        grads = [p.grad for p in parameters if p.grad is not None]
        return {
            "weights": sum(_storages(parameters).values()) / _MB,
            "gradients": sum(_storages(grads).values()) / _MB,
            "optimizer_state": sum(_storages(states).values()) / _MB,
            "activations": self.max_saved_bytes / _MB,
        }


def state_nbytes(tensor: torch.Tensor) -> dict[int, int]:
    """Bytes of each storage a state tensor holds, by address: a plain tensor's storage,
    or for a tensor subclass (torchao's ``OptimState8bit``, ``OptimState4bit``,
    ``OptimStateFp8``) the storages of its inner tensors (codes, scales, code map), found
    through ``__tensor_flatten__``."""
    tensor = getattr(tensor, "_local_tensor", tensor)  # a sharded DTensor: its shard
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and type(tensor) is not torch.Tensor:
        found: dict[int, int] = {}
        for attr in flatten()[0]:
            found.update(state_nbytes(getattr(tensor, attr)))
        return found
    storage = tensor.untyped_storage()
    return {storage.data_ptr(): storage.nbytes()}


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage behind the tensors, keyed by its address (a tensor
    subclass's, such as torchao's 8-bit optimizer states, are its inner tensors')."""
    storages = {}
    for tensor in tensors:
        storages.update(state_nbytes(tensor))
    return storages
