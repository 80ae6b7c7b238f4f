"""fp8: e4m3 values (e5m2 gradients) with a scale, for Linear layers. Training swaps them
for torchao's ``Float8Linear``; serving stores their weights in float8 by a torchao method.

In training, a policy's fp8 layers are swapped by
``torchao.float8.convert_to_float8_training`` with a ``module_filter_fn`` that takes
exactly those layers, so that what a trial measures is what torchao's own users run.
``Float8Linear.from_float`` keeps the Linear's ``weight`` and ``bias`` Parameter objects
(fp32 master weights; an optimizer built before the swap still holds them), and the
layers around it run in their autocast region. `Fp8Layers.remove` puts the original
``nn.Linear`` modules back, holding whatever Parameters the fp8 ones hold then.

In serving (`autoprec.serving.fp8` says where each method runs), ``torchao-fp8-weight-only``
(``Float8WeightOnlyConfig``) dequantizes the weights for a matmul in the activations' dtype
and runs on the CPU; the dynamic methods quantize the activations too, for
``torch._scaled_mm``, which torchao refuses below CUDA compute capability 8.9.

torchao is imported only when a model is converted: it is slow to import, and a policy
without fp8 layers never needs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from autoprec.errors import PolicyError
from autoprec.formats.base import CONVERT, QUANTIZE, Format, Limits, is_plain_linear
from autoprec.formats.methods import Quantizer, import_torchao, torchao_config, torchao_quantize

if TYPE_CHECKING:
    from torch import nn

# torchao's ``Float8LinearRecipeName`` values (checked against torchao by the tests).
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
DEFAULT_FP8_RECIPE = "tensorwise"  # torchao's default Float8LinearConfig
# torch._scaled_mm's requirement on both dimensions of an fp8 weight.
FP8_DIM_MULTIPLE = 16
# Recipes seen to fail under a low-precision autocast region, by device kind: the reason
# (torch 2.13 CPU, torchao 0.18; the grad-weight matmul meets fp32 and bf16/fp16 operands).
# Never run on a GPU: CUDA has no entry, as nothing was measured there.
FAILS_UNDER_AUTOCAST: dict[str, dict[str, str]] = {
    "cpu": {
        "rowwise_with_gw_hp": "its high-precision grad-weight matmul fails under autocast "
        "(expected m1 and m2 to have the same dtype); use rowwise or an fp32 region",
    },
}
# The hook dictionaries a converted layer shares with the Linear it replaces, so hooks
# registered on the user's Linear (watchers, telemetry) still run while it is fp8.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


def check_recipe(recipe: object, where: str) -> str:
    """``recipe`` if it names one of torchao's float8 training recipes, else PolicyError."""
    if recipe not in FP8_RECIPES:
        raise PolicyError(
            f"{where}: unknown fp8 recipe {recipe!r} (expected {', '.join(FP8_RECIPES)})"
        )
    return str(recipe)


def is_converted(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (judged without importing torchao)."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith(
        "torchao."
    )


def fp8_refusal(module: nn.Module) -> str | None:
    """Why torchao's float8 training cannot take this layer (None: it can): only a plain
    ``nn.Linear`` (subclasses may be read by their parent rather than called, as
    MultiheadAttention's ``out_proj`` is) whose in and out features are multiples of 16."""
    if is_converted(module):
        return None
    if not is_plain_linear(module):
        return f"a {type(module).__name__} is not an nn.Linear, which fp8 needs"
    return _dims_refusal(module)


def _dims_refusal(module: nn.Module) -> str | None:
    """Why a Linear's dimensions do not suit ``torch._scaled_mm`` (None: they do)."""
    sizes: tuple[int, int] = (getattr(module, "in_features", 0), getattr(module, "out_features", 0))
    if any(size % FP8_DIM_MULTIPLE for size in sizes):
        return (
            f"in/out features {sizes[0]}x{sizes[1]} are not both "
            f"multiples of {FP8_DIM_MULTIPLE}, which torch._scaled_mm needs"
        )
    return None


def fp8_capable(module: nn.Module) -> bool:
    """Whether torchao's float8 training can convert this layer (`fp8_refusal`)."""
    return fp8_refusal(module) is None


def autocast_refusal(kind: str, recipe: str, region_dtype: str) -> str | None:
    """Why ``recipe`` cannot run on this device kind inside a ``region_dtype`` region
    (None: nothing says it cannot)."""
    if region_dtype == "fp32":
        return None
    return FAILS_UNDER_AUTOCAST.get(kind, {}).get(recipe)


@dataclass
class _Swapped:
    parent: nn.Module
    attribute: str
    original: nn.Linear
    converted: nn.Linear


class Fp8Layers:
    """The named Linear layers of ``model`` converted to torchao's float8 training with
    ``recipe``; `remove` puts the original modules back."""

    def __init__(self, model: nn.Module, names: Iterable[str], recipe: str) -> None:
        import_torchao()  # quietly: its import-time noise is not the user's to see
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        wanted = set(names)
        self._swapped: list[_Swapped] = []
        if not wanted:
            return
        if "" in wanted:
            raise PolicyError(
                "fp8: the model itself is a Linear; torchao swaps Linear layers inside a model"
            )
        modules = dict(model.named_modules())
        before = {name: modules[name] for name in wanted}
        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(check_recipe(recipe, "fp8 recipe")),
            module_filter_fn=lambda module, fqn: fqn in wanted,
        )
        after = dict(model.named_modules())
        for name, original in before.items():
            converted = after[name]
            for hooks in _HOOK_DICTS:
                setattr(converted, hooks, getattr(original, hooks))
            converted.train(original.training)
            parent_name, _, attribute = name.rpartition(".")
            self._swapped.append(_Swapped(after[parent_name], attribute, original, converted))

    def remove(self) -> None:
        """The original ``nn.Linear`` modules back in place, holding the Parameters the
        fp8 ones hold now (the same objects, unless something assigned new ones)."""
        for swapped in reversed(self._swapped):
            swapped.original.weight = swapped.converted.weight
            swapped.original.bias = swapped.converted.bias
            swapped.original.train(swapped.converted.training)
            setattr(swapped.parent, swapped.attribute, swapped.original)
        self._swapped.clear()


_WEIGHT_ONLY = "Float8WeightOnlyConfig"
_DYNAMIC = "Float8DynamicActivationFloat8WeightConfig"
_ELSEWHERE = (
    "torchao's float8 dynamic activations need CUDA compute capability 8.9 or later "
    "(H100, H200, L40, B200); {kind} has none"
)
_E4M3 = Limits(448.0, 2.0**-6, 2.0**-9, 3)
_E5M2 = Limits(57344.0, 2.0**-14, 2.0**-16, 2)


def _method(name: str, kinds: tuple[str, ...], elsewhere: str, **kwargs: str) -> Quantizer:
    config = _WEIGHT_ONLY if name.endswith("weight-only") else _DYNAMIC
    made = torchao_config(config, **kwargs)
    arguments = tuple(kwargs.items())
    return Quantizer(
        name,
        "fp8",
        kinds,
        "torchao",
        config,
        True,
        True,
        elsewhere,
        torchao_quantize(made),
        arguments,
    )


class FP8(Format):
    name = "fp8"
    help = "float8 Linear layers: e4m3 forward, e5m2 gradients, scaled (torchao)"
    limits = _E4M3
    elements: ClassVar[dict[str, Limits]] = {"fp8_e4m3": _E4M3, "fp8_e5m2": _E5M2}
    trains = CONVERT
    serves = QUANTIZE
    bytes_per_element = 1.0
    colour = "#c44e52"
    rest = "bf16"
    policy_records = True
    emulated_elsewhere = True
    recipes = FP8_RECIPES
    methods = (
        _method(
            "torchao-fp8-weight-only", ("cpu", "cuda"), "torchao has no float8 kernels for {kind}"
        ),
        _method("torchao-fp8-dynamic", ("cuda",), _ELSEWHERE),
        _method("torchao-fp8-dynamic-rowwise", ("cuda",), _ELSEWHERE, granularity="PerRow"),
    )
    # CUDA: torchao's default float8 inference config, per-tensor scales (not measured
    # here, no GPU was lent).
    default_methods: ClassVar[dict[str, str]] = {
        "cpu": "torchao-fp8-weight-only",
        "cuda": "torchao-fp8-dynamic",
    }

    def refusal(self, backend: Any) -> str | None:
        return backend.fp8_training_refusal()  # type: ignore[no-any-return]

    def layer_refusal(self, module: nn.Module) -> str | None:
        return fp8_refusal(module)

    def region_refusal(self, kind: str, recipe: str | None, region: str) -> str | None:
        return autocast_refusal(kind, recipe or DEFAULT_FP8_RECIPE, region)

    def convert(self, model: nn.Module, names: list[str], recipe: str | None) -> Fp8Layers:
        return Fp8Layers(model, names, recipe or DEFAULT_FP8_RECIPE)

    def serving_layer_refusal(self, module: nn.Module, method: Quantizer | None) -> str | None:
        """A plain ``nn.Linear`` (torchao's float8 configs take no other), whose dimensions
        are multiples of 16 where the method's matmul is ``torch._scaled_mm``'s."""
        if not is_plain_linear(module):
            return f"a {type(module).__name__} is not an nn.Linear, which fp8 serving needs"
        if method is None or method.torchao_config == _DYNAMIC:
            return _dims_refusal(module)
        return None

    def holds(self, weight: Any) -> bool:
        return type(weight).__name__ == "Float8Tensor"
