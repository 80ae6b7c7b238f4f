"""Converting an fp32 model for serving, layer by layer, as a deployment would.

Training keeps fp32 master weights and lets autocast cast on the fly; serving does not
train, so the weights themselves change dtype and their memory really shrinks. `convert`
takes ``{leaf module name: dtype}`` (what ``Policy.resolve`` returns, with ``int8`` beside
fp32, fp16 and bf16) and returns a converted copy; the fp32 model is never touched, since
it is the user's safety net.

- fp16/bf16 leaves: their parameters and floating buffers are cast, norms' statistics
  too, as ``model.half()`` does: keeping a norm's statistics in fp32 under low-precision
  inputs was as fast on the CPU and more accurate for LayerNorm, but is a CPU kernel's
  feature (benchmarks/README.md, bench_int8.py); a policy wanting accurate norms keeps
  them fp32. Parameters held directly by a non-leaf module (MultiheadAttention's
  ``in_proj_weight``) follow the leaves below it where those agree.
- int8 leaves: Linear layers (and transformers' Conv1D, turned into the equivalent
  Linear) are quantized with one of `INT8_METHODS`; their activations stay fp32.
- Boundaries: a uniform model casts its inputs once and runs in its dtype. Where layers of
  different dtypes meet, each largest same-dtype subtree casts its floating inputs to its
  dtype (integer ones, such as token ids, pass untouched) and hands its outputs back in
  fp32, so the code between subtrees runs in fp32. The model's floating outputs come back
  in fp32 for scoring. Parameter-free leaves run in what they receive.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from autoprec.devices import DTYPES, INFERENCE_DTYPES, Backend, get_backend
from autoprec.errors import DeviceError, PolicyError, TaskError, first_line
from autoprec.policy import int8_capable, is_called, parameterised_leaves, tied_leaves
from autoprec.structures import cast_floats

INT8_METHODS = ("dynamic", "torchao-dynamic", "torchao-weight-only")
# Chosen by measuring (benchmarks/bench_int8.py and benchmarks/README.md). CUDA: torchao is
# the only int8 with kernels there; weight-only is its choice for memory-bound serving,
# not measured here (no GPU was lent).
DEFAULT_INT8_METHOD = {"cpu": "dynamic", "cuda": "torchao-weight-only"}
_PLAIN = (torch.Tensor, nn.Parameter)


def default_int8_method(device_kind: str) -> str | None:
    """The int8 implementation used on a device kind when none is named; None where int8
    has no kernels."""
    return DEFAULT_INT8_METHOD.get(device_kind)


def int8_unavailable_reason(device_kind: str, method: str | None = None) -> str | None:
    """Why int8 cannot run on this device kind with this method (default: the device's),
    in one line; None when it can. Lets a search refuse int8 before any trial runs."""
    method = method or default_int8_method(device_kind)
    if method is None:
        return f"int8: no int8 kernels for {device_kind} in torch or torchao"
    if method not in INT8_METHODS:
        return f"int8: unknown method {method!r} (expected {', '.join(INT8_METHODS)})"
    if method == "dynamic":
        if device_kind != "cpu":
            return f"int8 {method}: torch's dynamic quantization runs on the CPU only"
        engines = torch.backends.quantized.supported_engines
        if not {"x86", "fbgemm"} & set(engines):
            return f"int8 {method}: this torch has no x86/fbgemm quantized engine"
        if not hasattr(torch.ops.quantized, "linear_dynamic"):
            return f"int8 {method}: this torch has no quantized.linear_dynamic kernel"
        return None
    if importlib.util.find_spec("torchao") is None:
        return f"int8 {method}: torchao is not installed (pip install torchao)"
    if device_kind not in ("cpu", "cuda"):
        return f"int8 {method}: torchao has no int8 kernels for {device_kind}"
    return None


def import_torchao() -> Any:
    """torchao, imported only where an int8 method of its runs. On a machine without its
    optional CUDA kernels it logs "Failed to load ...so" lines, and torch's pytree a
    deprecation warning about torchao's enums, at import: not the user's to see."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torchao

    return torchao


def int8_available(device_kind: str, method: str | None = None) -> bool:
    """Whether int8 layers can run on this device kind (see `int8_unavailable_reason`)."""
    return int8_unavailable_reason(device_kind, method) is None


def activation_dtype(dtype: str) -> str:
    """The dtype a layer of this inference dtype takes its inputs in (int8 layers quantize
    fp32 activations themselves)."""
    return "fp32" if dtype == "int8" else dtype


def convert(
    model: nn.Module,
    layer_dtypes: Mapping[str, str],
    device: str | torch.device | Backend = "cpu",
    int8: str | None = None,
) -> nn.Module:
    """A copy of ``model`` on ``device`` in eval mode, each leaf with parameters converted
    to its dtype in ``layer_dtypes`` (leaves not named stay fp32), with casts at the
    boundaries and fp32 outputs. ``int8`` names the method (default: the device's, see
    `DEFAULT_INT8_METHOD`). Raises PolicyError for a mapping that does not fit the model
    and DeviceError for a dtype the device cannot run."""
    backend = get_backend(device)
    leaves = dict(parameterised_leaves(model))
    dtypes = _checked(model, leaves, layer_dtypes)
    method = _checked_int8(dtypes, backend, int8)
    _check_tied(model, dtypes)
    try:
        converted = copy.deepcopy(model)
    except Exception as error:  # deepcopy of a user's model: any type
        raise TaskError(f"the model cannot be copied for conversion: {first_line(error)}") from None
    converted.to(backend.device).eval()
    quantized = [name for name, dtype in dtypes.items() if dtype == "int8"]
    if quantized:
        _quantize(converted, quantized, method)
    modules = dict(converted.named_modules())
    for name, dtype in dtypes.items():
        if dtype in ("fp16", "bf16"):
            modules[name].to(DTYPES[dtype])
    _install_casts(converted, {name: activation_dtype(d) for name, d in dtypes.items()})
    return converted


def _checked(
    model: nn.Module, leaves: dict[str, nn.Module], layer_dtypes: Mapping[str, str]
) -> dict[str, str]:
    """Every leaf with parameters and its dtype, after checking the mapping."""
    if not isinstance(layer_dtypes, Mapping):
        raise PolicyError(f"layer_dtypes: expected a mapping, got {type(layer_dtypes).__name__}")
    for name, dtype in layer_dtypes.items():
        if name not in leaves:
            raise PolicyError(
                f"layer {name!r}: not a leaf module with parameters in {type(model).__name__}"
            )
        if dtype not in INFERENCE_DTYPES:
            raise PolicyError(
                f"layer {name!r}: unknown dtype {dtype!r} (expected fp32, fp16, bf16 or int8)"
            )
        if dtype == "int8" and not int8_capable(leaves[name]):
            raise PolicyError(
                f"layer {name!r} ({type(leaves[name]).__name__}): int8 applies to Linear "
                "layers (and transformers' Conv1D) only"
            )
    return {name: layer_dtypes.get(name, "fp32") for name in leaves}


def _checked_int8(dtypes: dict[str, str], backend: Backend, int8: str | None) -> str | None:
    """The int8 method to use, after checking that the device runs every dtype asked for."""
    for dtype in sorted(set(dtypes.values()) - {"fp32", "int8"}):
        if not backend.supports(dtype):
            raise DeviceError(f"dtype {dtype}: not supported by device {backend.name}")
    if int8 is not None and int8 not in INT8_METHODS:
        raise PolicyError(f"int8: unknown method {int8!r} (expected {', '.join(INT8_METHODS)})")
    if "int8" not in dtypes.values():
        return int8
    reason = int8_unavailable_reason(backend.kind, int8)
    if reason is not None:
        raise DeviceError(f"{reason} (device {backend.name})")
    return int8 or default_int8_method(backend.kind)


def _check_tied(model: nn.Module, dtypes: dict[str, str]) -> None:
    """Leaves that share a parameter must share a dtype: one tensor cannot be in two. An
    int8 leaf gets a quantized copy of its own, so it may differ."""
    for group in tied_leaves(model):
        kept = [name for name in group if dtypes[name] != "int8"]
        for name in kept[1:]:
            if dtypes[name] != dtypes[kept[0]]:
                raise PolicyError(
                    f"layers {kept[0]!r} ({dtypes[kept[0]]}) and {name!r} ({dtypes[name]}) "
                    f"share a parameter in {type(model).__name__}: give them one dtype"
                )


def _quantize(model: nn.Module, names: list[str], method: str | None) -> None:
    """The named Linear (or Conv1D) layers quantized to int8 in place."""
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            _replace(model, name, _conv1d_as_linear(module))
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in torch 2.13 but still the fastest here.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        if method == "dynamic":
            from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

            quantize_dynamic(model, dict.fromkeys(names, default_dynamic_qconfig), inplace=True)
        else:
            import_torchao()
            from torchao.quantization import (
                Int8DynamicActivationInt8WeightConfig,
                Int8WeightOnlyConfig,
                quantize_,
            )

            config = (
                Int8DynamicActivationInt8WeightConfig()
                if method == "torchao-dynamic"
                else Int8WeightOnlyConfig()
            )
            chosen = set(names)
            quantize_(model, config, filter_fn=lambda module, fqn: fqn in chosen)
    missed = [name for name in names if weight_dtypes(model.get_submodule(name)).get("") != "int8"]
    if missed:
        raise PolicyError(f"layer {missed[0]!r}: int8 method {method!r} left it unquantized")


def has_torch_dynamic_int8(model: nn.Module) -> bool:
    """Whether ``model`` holds torch's own dynamic int8 layers, whose packed weights
    ``torch.export`` cannot trace (torchao's int8 tensors export)."""
    return any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in model.modules())


def _conv1d_as_linear(conv1d: nn.Module) -> nn.Linear:
    """transformers' Conv1D (``x @ weight + bias``, weight ``[in, out]``) as a Linear."""
    weight = conv1d.weight
    bias = getattr(conv1d, "bias", None)
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None)
    linear.to(weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)


class CastInputs:
    """A forward pre-hook casting a module's floating inputs (positional and keyword) to
    one dtype, so that it runs in its own dtype whatever its neighbours hand it. A class,
    not a closure, so that a converted model pickles."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return cast_floats((args, kwargs), DTYPES[self.dtype])


def outputs_fp32(module: nn.Module, args: Any, outputs: Any) -> Any:
    """A forward hook handing the model's floating outputs on in fp32, for scoring."""
    return cast_floats(outputs, torch.float32)


def _install_casts(model: nn.Module, activation_dtypes: dict[str, str]) -> None:
    """Casts at the boundaries. A uniform model casts its inputs at the top and runs in its
    dtype throughout. Otherwise the code of a module whose leaves differ (the glue between
    its children: residual adds, attention over q, k and v) runs in fp32, and each largest
    child subtree whose leaves take one dtype casts its inputs to that dtype and hands its
    outputs back in fp32. The model's outputs come back in fp32. Parameters held by a
    non-leaf module follow its subtree's dtype where it has one, else stay fp32."""
    below: dict[str, set[str]] = {name: set() for name, _ in model.named_modules()}
    for name, dtype in activation_dtypes.items():
        parts = name.split(".")
        for ancestor in ["", *(".".join(parts[: i + 1]) for i in range(len(parts)))]:
            below[ancestor].add(dtype)
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and name not in activation_dtypes and len(below[name]) == 1:
            dtype = DTYPES[next(iter(below[name]))]
            for parameter in own:
                if parameter.is_floating_point():
                    parameter.data = parameter.data.to(dtype)

    def descend(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}.{child_name}" if prefix else child_name
            if len(below[full]) > 1 or not is_called(child):
                descend(full, child)
            elif below[full]:
                dtype = next(iter(below[full]))
                child.register_forward_pre_hook(CastInputs(dtype), with_kwargs=True)
                if dtype != "fp32":
                    child.register_forward_hook(outputs_fp32)

    if len(below[""]) > 1:
        descend("", model)
    elif below[""] - {"fp32"}:
        model.register_forward_pre_hook(CastInputs(*below[""]), with_kwargs=True)
    if below[""] - {"fp32"}:
        model.register_forward_hook(outputs_fp32)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take: parameters and buffers, each storage once (tied
    weights count once), quantized weights as what they hold. torchao's int8 weights are
    counted through their inner tensors (int8 data, scales, zero points); torch's dynamic
    quantized Linear, whose weights hide in a packed C++ object, as its int8 weight,
    per-channel scales and zero points where it has them, and its bias."""
    storages: dict[tuple[str, int], int] = {}
    unpacked: list[torch.Tensor] = []  # kept alive, so that no two share an id
    for module in model.modules():
        held: list[torch.Tensor] = [
            *module.parameters(recurse=False),
            *module.buffers(recurse=False),
        ]
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if callable(weight) and callable(bias):  # torch's packed quantized layers
            fresh = [t for t in (weight(), bias()) if isinstance(t, torch.Tensor)]
            unpacked += fresh
            held += fresh
        for tensor in held:
            for inner in _inner_tensors(tensor):
                storages[(str(inner.device), _address(inner))] = _nbytes(inner)
    return sum(storages.values())


def _inner_tensors(tensor: torch.Tensor) -> Iterable[torch.Tensor]:
    """The plain tensors a tensor subclass (torchao's quantized weights) is made of."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) in _PLAIN:
        yield tensor
        return
    names, _ = flatten()
    for name in names:
        yield from _inner_tensors(getattr(tensor, name))


def _address(tensor: torch.Tensor) -> int:
    if tensor.is_quantized:
        return id(tensor)  # unpacked afresh on every call: its own storage
    return tensor.untyped_storage().data_ptr()


def _nbytes(tensor: torch.Tensor) -> int:
    if not tensor.is_quantized:
        return tensor.untyped_storage().nbytes()
    extra = 0
    if tensor.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        scales, zero_points = tensor.q_per_channel_scales(), tensor.q_per_channel_zero_points()
        extra = scales.numel() * scales.element_size()
        extra += zero_points.numel() * zero_points.element_size()
    return tensor.numel() * tensor.element_size() + extra


def weight_dtypes(model: nn.Module) -> dict[str, str]:
    """The dtype each leaf holds its weights in now, ``int8`` for quantized ones: what a
    conversion really did, for checks and reports."""
    found: dict[str, str] = {}
    names = {dtype: name for name, dtype in DTYPES.items()}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if callable(weight) or (isinstance(weight, torch.Tensor) and type(weight) not in _PLAIN):
            found[name] = "int8"
            continue
        first = next(module.parameters(recurse=False), None)
        if first is not None and next(module.children(), None) is None:
            found[name] = names.get(first.dtype, str(first.dtype))
    return found
