"""fp8 Linear layers in training: torchao's float8 conversion, and its undo.

A policy's fp8 layers are swapped for torchao's ``Float8Linear`` by
``torchao.float8.convert_to_float8_training`` with a ``module_filter_fn`` that takes
exactly those layers, so that what a trial measures is what torchao's own users run.
``Float8Linear.from_float`` keeps the Linear's ``weight`` and ``bias`` Parameter objects
(fp32 master weights; an optimizer built before the swap still holds them), and the
layers around it run in their autocast region. `Fp8Layers.remove` puts the original
``nn.Linear`` modules back, holding whatever Parameters the fp8 ones hold then.

torchao is imported only when a model is converted: it is slow to import, and a policy
without fp8 layers never needs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from autoprec.errors import PolicyError
from autoprec.serving.quantizers import import_torchao

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
    if type(module) is not nn.Linear:
        return f"a {type(module).__name__} is not an nn.Linear, which fp8 needs"
    assert isinstance(module, nn.Linear)
    if module.in_features % FP8_DIM_MULTIPLE or module.out_features % FP8_DIM_MULTIPLE:
        return (
            f"in/out features {module.in_features}x{module.out_features} are not both "
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
            assert isinstance(original, nn.Linear) and isinstance(converted, nn.Linear)
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
