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
  Linear) are quantized by a method of `autoprec.serving.quantizers` (the one the policy records,
  so a policy serves what its trial measured); their activations stay fp32.
- fp8 leaves: Linear layers get float8 weights by torchao's float8 configs (a method of
  the same registry, the one the policy records; `autoprec.serving.fp8`), their
  activations handed to them in fp32.
- Boundaries: a uniform model casts its inputs once and runs in its dtype. Where layers of
  different dtypes meet, each largest same-dtype subtree (`autoprec.precision.plan.boundaries`, the
  algorithm that places training's regions too) casts its floating inputs to its dtype
  (integer ones, such as token ids, pass untouched) and hands its outputs back in fp32, so
  the code between subtrees runs in fp32. The model's floating outputs come back in fp32
  for scoring. Parameter-free leaves run in what they receive.

`ServingPrecision` holds these steps as hooks shaped as training's `Precision`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

import autoprec.formats as formats
from autoprec._util.structures import cast_floats
from autoprec.devices import Backend, get_backend
from autoprec.dtypes import activation_dtype, dtype_name
from autoprec.errors import DeviceError, PolicyError, TaskError, first_line
from autoprec.policy import Policy
from autoprec.precision.plan import boundaries, parameterised_leaves, tied_leaves
from autoprec.serving.quantizers import (
    DEFAULT_INT8_METHOD,
    INT8_METHODS,
    Quantizer,
    default_int8_method,
    import_torchao,
    int8_available,
    int8_unavailable_reason,
    quantizer,
)

__all__ = [
    "DEFAULT_INT8_METHOD",
    "INT8_METHODS",
    "CastInputs",
    "ServingPrecision",
    "activation_dtype",
    "convert",
    "convert_policy",
    "default_int8_method",
    "has_torch_dynamic_int8",
    "import_torchao",
    "int8_available",
    "int8_unavailable_reason",
    "outputs_fp32",
    "weight_bytes",
    "weight_dtypes",
]
_PLAIN = (torch.Tensor, nn.Parameter)
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def convert(
    model: nn.Module,
    layer_dtypes: Mapping[str, str],
    device: str | torch.device | Backend = "cpu",
    int8: str | None = None,
    fp8: str | None = None,
) -> nn.Module:
    """A copy of ``model`` on ``device`` in eval mode, each leaf with parameters converted
    to its dtype in ``layer_dtypes`` (leaves not named stay fp32), with casts at the
    boundaries and fp32 outputs. ``int8`` names the method (default: the device's, see
    `autoprec.serving.quantizers.DEFAULT_INT8_METHOD`), ``fp8`` the fp8 one (default: the device's,
    `autoprec.serving.fp8.DEFAULT_FP8_METHOD`). Raises PolicyError for a mapping that does
    not fit the model and DeviceError for a dtype the device cannot run."""
    backend = get_backend(device)
    leaves = dict(parameterised_leaves(model))
    dtypes = _checked(model, leaves, layer_dtypes)
    for method in (int8, fp8):
        if method is not None:
            quantizer(method)  # an unknown method is refused whether or not it is used
    named = {"int8": int8, "fp8": fp8}
    methods = {
        dtype: _checked_method(dtypes, leaves, backend, dtype, named.get(dtype))
        for dtype in sorted(set(dtypes.values()))
        if formats.get(dtype).quantizes
    }
    _check_cast(dtypes, backend)
    _check_tied(model, dtypes)
    return ServingPrecision(dtypes, backend, methods).convert_module(model)


def convert_policy(
    model: nn.Module,
    policy: Policy,
    device: str | torch.device | Backend = "cpu",
    int8: str | None = None,
) -> nn.Module:
    """``model`` converted for serving as ``policy`` says (a copy; see `convert`), its int8
    layers by ``int8``, else by the method the policy records, else the device's; its fp8
    layers by the fp8 method the policy records, else the device's."""
    return convert(
        model,
        policy.resolve_served(model),
        device,
        int8 or policy.int8_method,
        policy.fp8_method,
    )


class ServingPrecision:
    """Serving's hooks, shaped as training's (`autoprec.precision.hooks.Precision`):
    ``convert_module`` (a converted copy: weights quantized or cast, casts at the borders
    of the same-dtype subtrees that `autoprec.precision.plan.boundaries` finds),
    ``forward_context``, ``convert_input`` and ``convert_output``. The converted model calls
    the input and output conversions itself, as hooks, so that it serves alone (MLflow,
    export)."""

    def __init__(
        self,
        layer_dtypes: Mapping[str, str],
        backend: Backend,
        methods: Mapping[str, Quantizer] | None = None,
    ) -> None:
        self.layer_dtypes = dict(layer_dtypes)
        self.backend = backend
        self.methods = dict(methods or {})  # each quantizing format's method
        self.activation_dtypes = {n: activation_dtype(d) for n, d in self.layer_dtypes.items()}

    def convert_module(self, model: nn.Module) -> nn.Module:
        """A copy of ``model`` on the backend's device in eval mode, converted."""
        try:
            converted = copy.deepcopy(model)
        except Exception as error:  # the user's model: any copy failure is theirs to see
            raise TaskError(
                f"the model cannot be copied for conversion: {first_line(error)}"
            ) from None
        converted.to(self.backend.device).eval()
        for dtype, method in self.methods.items():
            names = [name for name, own in self.layer_dtypes.items() if own == dtype]
            _quantize(converted, names, dtype, method)
        modules = dict(converted.named_modules())
        for name, dtype in self.layer_dtypes.items():
            if (cast := formats.get(dtype)).low_precision and not cast.quantizes:
                modules[name].to(cast.torch_dtype())
        self._install_casts(converted)
        return converted

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """What a served forward runs in: no autograd (the weights themselves are in their
        dtypes, so no autocast either)."""
        return torch.inference_mode()

    @property
    def input_dtype(self) -> str | None:
        """The dtype the model's inputs are cast to: a uniform model's, else none (each
        subtree casts its own)."""
        dtypes = set(self.activation_dtypes.values())
        only = next(iter(dtypes)) if len(dtypes) == 1 else None
        return None if only is None or formats.get(only).reference else only

    def convert_input(self, data: Any) -> Any:
        """The model's floating inputs in the dtype it runs in where it runs in one."""
        dtype = self.input_dtype
        return data if dtype is None else cast_floats(data, formats.get(dtype).torch_dtype())

    def convert_output(self, data: Any) -> Any:
        """Floating outputs back in fp32, for scoring and for whoever is served them."""
        return cast_floats(data, torch.float32)

    def _install_casts(self, model: nn.Module) -> None:
        """Casts at the boundaries. A uniform model casts its inputs at the top and runs in
        its dtype throughout. Otherwise the code of a module whose leaves differ (the glue
        between its children: residual adds, attention over q, k and v) runs in fp32, and
        each largest subtree whose leaves take one dtype casts its inputs to that dtype and
        hands its outputs back in fp32. The model's outputs come back in fp32. Parameters
        held by a non-leaf module follow its subtree's dtype where it has one, else stay
        fp32."""
        found = boundaries(model, self.activation_dtypes)
        for name, module in model.named_modules():
            own = list(module.parameters(recurse=False))
            single = found.single_dtype(name)
            if own and name not in self.activation_dtypes and single is not None:
                for parameter in own:
                    if parameter.is_floating_point():
                        parameter.data = parameter.data.to(formats.get(single).torch_dtype())
        for subtree in found.subtrees:
            if subtree.dtype is None:
                continue  # no leaf below it with parameters: it runs in what it receives
            child = model.get_submodule(subtree.name)
            child.register_forward_pre_hook(CastInputs(subtree.dtype), with_kwargs=True)
            if formats.get(subtree.dtype).low_precision:
                child.register_forward_hook(outputs_fp32)
        if found.uniform is not None and formats.get(found.uniform).low_precision:
            model.register_forward_pre_hook(CastInputs(found.uniform), with_kwargs=True)
        if any(formats.get(dtype).low_precision for dtype in found.dtypes):
            model.register_forward_hook(outputs_fp32)


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
        if not formats.known(dtype):
            raise PolicyError(
                f"layer {name!r}: unknown dtype {dtype!r} (expected {', '.join(formats.names())})"
            )
    return {name: layer_dtypes.get(name, formats.reference().name) for name in leaves}


def _check_cast(dtypes: dict[str, str], backend: Backend) -> None:
    """Every format the weights are cast to runs on the device."""
    for dtype in sorted(set(dtypes.values())):
        cast = formats.get(dtype)
        if not cast.quantizes and not backend.has_dtype(cast.torch_dtype()):
            raise DeviceError(f"dtype {dtype}: not supported by device {backend.name}")


def _checked_method(
    dtypes: dict[str, str],
    leaves: dict[str, nn.Module],
    backend: Backend,
    dtype: str,
    name: str | None,
) -> Quantizer:
    """The method that quantizes the layers in ``dtype`` (``name``, else the device's),
    after checking that the device runs it and that each such layer can take it."""
    served = formats.get(dtype)
    try:
        method = served.method(name, backend.kind)
    except PolicyError as error:
        raise DeviceError(f"{error} (device {backend.name})") from None
    reason = served.serving_refusal(backend, method)
    if reason is not None:
        raise DeviceError(f"{reason} (device {backend.name})")
    assert method is not None
    for layer, own in dtypes.items():
        refusal = served.serving_layer_refusal(leaves[layer], method) if own == dtype else None
        if refusal is not None:
            raise PolicyError(f"layer {layer!r}: cannot be served in {dtype}: {refusal}")
    return method


def _check_tied(model: nn.Module, dtypes: dict[str, str]) -> None:
    """Leaves that share a parameter must share a dtype: one tensor cannot be in two. An
    int8 or fp8 leaf gets a quantized copy of its own, so it may differ."""
    for group in tied_leaves(model):
        kept = [name for name in group if not formats.get(dtypes[name]).quantizes]
        for name in kept[1:]:
            if dtypes[name] != dtypes[kept[0]]:
                raise PolicyError(
                    f"layers {kept[0]!r} ({dtypes[kept[0]]}) and {name!r} ({dtypes[name]}) "
                    f"share a parameter in {type(model).__name__}: give them one dtype"
                )


def _quantize(model: nn.Module, names: list[str], dtype: str, method: Quantizer) -> None:
    """The named layers quantized to ``dtype`` in place, by ``method`` (a transformers
    Conv1D made a Linear first; torchao puts a new Parameter on each, so a tied neighbour
    keeps the floating one)."""
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            _replace(model, name, _conv1d_as_linear(module))
    method.quantize(model, names)
    missed = [name for name in names if weight_dtypes(model.get_submodule(name)).get("") != dtype]
    if missed:
        raise PolicyError(
            f"layer {missed[0]!r}: {dtype} method {method.name!r} left it unquantized"
        )


def has_torch_dynamic_int8(model: nn.Module) -> bool:
    """Whether ``model`` holds torch's own dynamic int8 layers, whose packed weights
    ``torch.export`` cannot trace (torchao's int8 tensors export)."""
    return any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in model.modules())


def _conv1d_as_linear(conv1d: nn.Module) -> nn.Linear:
    """transformers' Conv1D (``x @ weight + bias``, weight ``[in, out]``) as a Linear."""
    weight = conv1d.weight
    bias = getattr(conv1d, "bias", None)
    assert isinstance(weight, torch.Tensor)  # Conv1D's weight is a Parameter
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
        return cast_floats((args, kwargs), formats.get(self.dtype).torch_dtype())


def outputs_fp32(module: nn.Module, args: Any, outputs: Any) -> Any:
    """A forward hook handing the model's floating outputs on in fp32, for scoring."""
    return cast_floats(outputs, torch.float32)


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
    """The dtype each leaf holds its weights in now, ``int8`` for quantized ones and
    ``fp8`` for float8 ones: what a conversion really did, for checks and reports."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if callable(weight) or (isinstance(weight, torch.Tensor) and type(weight) not in _PLAIN):
            held = (f.name for f in formats.all_formats() if f.holds(weight))
            found[name] = next(held, type(weight).__name__)
            continue
        first = next(module.parameters(recurse=False), None)
        if first is not None and next(module.children(), None) is None:
            found[name] = dtype_name(first.dtype)
    return found
