"""Policy: which dtype each layer runs in, how the loss is scaled, and global switches.

A policy is plain data: ordered rules, a default dtype, loss-scale settings and the
TF32/HF32 switches. It reads and writes YAML with strict validation, ``resolve``
says which dtype every leaf module runs in, and ``apply`` installs that on a model
and returns the `Precision` object a training loop calls. What a policy does on a model
lives by concept beside the data, and its methods here are thin delegates to it:
`autoprec.precision.landing` (``plan``, ``apply``: where it lands and what installs it),
`autoprec.precision.resolution` (``resolve``, ``resolve_served``, and ``identity``,
``layer_table``, ``low_precision_share`` as a mode resolves it), and
`autoprec.optim.optimizer` (``optimizer``).

Rules match leaf modules by glob patterns on ``named_modules()`` names (a pattern
that matches a module matches every module below it, so ``encoder`` covers
``encoder.0.fc``) and/or by module type names (any class in the module's MRO, so
``_BatchNorm`` covers ``BatchNorm2d``). With both, a module must match both. The
first matching rule wins; leaves that match no rule get the default. Rules assign
leaves that hold parameters; parameter-free leaves (ReLU, Dropout, pooling) run in
the region around them, so they never split a region in two.

What a leaf really runs in depends on the device's autocast lists (see
`autoprec.devices.autocast_behaviour`): embeddings everywhere, and LayerNorm and
GroupNorm on CUDA and Ascend, compute in fp32 whatever a rule says, so they resolve to
fp32 and get no region; BatchNorm everywhere, and LayerNorm and GroupNorm on the CPU,
run in their input's dtype, so in low precision they get a region that casts their
inputs, and in fp32 a region wherever the surroundings are not fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

import autoprec.formats as formats
from autoprec._util.files import load_yaml, parse_yaml, write_atomic
from autoprec._util.safe_names import check_name
from autoprec.errors import GuardError, PolicyError
from autoprec.formats.fp8 import DEFAULT_FP8_RECIPE, FP8, check_recipe
from autoprec.formats.int8 import INT8
from autoprec.guard.settings import Guard
from autoprec.optim.state import OptimizerStates
from autoprec.precision.loss_scale import LossScale

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autoprec.devices import Backend
    from autoprec.formats.base import Format
    from autoprec.modes import Mode
    from autoprec.optim.state import TrainingState
    from autoprec.precision.hooks import Precision
    from autoprec.precision.plan import Plan

__all__ = [
    "REDUCE_DTYPES",
    "LossScale",
    "Policy",
    "Quantization",
    "Rule",
    "load_policy",
]

_POLICY_FIELDS = (
    "name",
    "default",
    "rules",
    "loss_scale",
    "switches",
    "quantization",
    "reduce_dtype",
    "optimizer",
    "guard",
)
REDUCE_DTYPES = ("fp32", "bf16", "fp16")  # what gradients may be communicated in
_QUANTIZATION_FIELDS = ("int8", "fp8")
_RULE_FIELDS = ("name", "patterns", "types", "dtype")


def _check_dtype(value: Any, where: str) -> str:
    if not formats.known(value):
        training = formats.names("training")
        serving = [n for n in formats.names("serving") if n not in training]
        raise PolicyError(
            f"{where}: unknown dtype {value!r} "
            f"(expected {', '.join(training)} for training, or {', '.join(serving)} for serving)"
        )
    return formats.get(value).name


def _method_names(served: type[Format]) -> tuple[str, ...]:
    """A quantizing format's serving methods by name (int8's, fp8's), read from its format
    (`autoprec.formats`) without torch."""
    return tuple(method.name for method in served.methods)


def _string_list(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PolicyError(f"{where}: expected a list of non-empty strings, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class Rule:
    """Leaf modules whose name matches one of ``patterns`` and/or whose type is one of
    ``types`` run in ``dtype``."""

    dtype: str
    patterns: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    name: str | None = None

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, "dtype")
        if not self.patterns and not self.types:
            raise PolicyError("rule: needs patterns, types or both")

    def matches(self, name: str, module: nn.Module) -> bool:
        from autoprec.precision.plan import selects  # on a model: a policy is torch-free data

        return selects(self.patterns, self.types, name, module)

    def describe(self) -> str:
        parts = []
        if self.patterns:
            parts.append("patterns " + ", ".join(self.patterns))
        if self.types:
            parts.append("types " + ", ".join(self.types))
        return " and ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.name:
            data["name"] = self.name
        if self.patterns:
            data["patterns"] = list(self.patterns)
        if self.types:
            data["types"] = list(self.types)
        data["dtype"] = self.dtype
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Rule:
        if not isinstance(data, dict):
            raise PolicyError(f"{where}: expected a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_RULE_FIELDS))
        if unknown:
            raise PolicyError(
                f"{where}.{unknown[0]}: unknown field (expected {list(_RULE_FIELDS)})"
            )
        if "dtype" not in data:
            raise PolicyError(f"{where}.dtype: missing")
        patterns = _string_list(data["patterns"], f"{where}.patterns") if "patterns" in data else ()
        types = _string_list(data["types"], f"{where}.types") if "types" in data else ()
        if not patterns and not types:
            raise PolicyError(f"{where}: needs patterns, types or both")
        name = check_name(data.get("name"), f"{where}.name")
        return cls(_check_dtype(data["dtype"], f"{where}.dtype"), patterns, types, name)


@dataclass(frozen=True)
class Quantization:
    """How a policy's quantized layers are made: ``int8``, the method a serving policy's
    int8 layers were measured with (one of `autoprec.serving.quantizers.INT8_METHODS`; None: the
    device's default, as for a policy written by hand); ``fp8``, the torchao float8
    training recipe of its fp8 layers (one of `autoprec.formats.fp8.FP8_RECIPES`; None:
    tensorwise, torchao's default), or for a serving policy the method its fp8 layers were
    measured with (one of `autoprec.serving.fp8.FP8_SERVING_METHODS`, as int8 records its
    own). Written in the YAML only where set, so a policy without them reads and writes as
    before."""

    int8: str | None = None
    fp8: str | None = None

    def __post_init__(self) -> None:
        int8_methods = _method_names(INT8)
        if self.int8 is not None and self.int8 not in int8_methods:
            raise PolicyError(
                f"quantization.int8: unknown method {self.int8!r} "
                f"(expected {', '.join(int8_methods)})"
            )
        fp8_methods = _method_names(FP8)
        if self.fp8 is not None and self.fp8 not in fp8_methods:
            try:
                check_recipe(self.fp8, "quantization.fp8")
            except PolicyError as error:
                raise PolicyError(
                    f"{error}; or, for serving, a method: {', '.join(fp8_methods)}"
                ) from None

    def method(self, name: str) -> str | None:
        """The serving method recorded for the format ``name`` (None: none recorded, or a
        training recipe)."""
        value = getattr(self, name, None) if name in _QUANTIZATION_FIELDS else None
        methods = formats.get(name).methods
        return value if any(method.name == value for method in methods) else None

    def to_dict(self) -> dict[str, Any]:
        pairs = (("int8", self.int8), ("fp8", self.fp8))
        return {key: value for key, value in pairs if value is not None}

    @classmethod
    def from_dict(cls, data: Any) -> Quantization:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise PolicyError(f"quantization: expected a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_QUANTIZATION_FIELDS))
        if unknown:
            raise PolicyError(
                f"quantization.{unknown[0]}: unknown field (expected {list(_QUANTIZATION_FIELDS)})"
            )
        int8 = data.get("int8")
        if int8 is not None and not isinstance(int8, str):
            raise PolicyError(f"quantization.int8: expected a method name, got {int8!r}")
        fp8 = data.get("fp8")
        if fp8 is not None and not isinstance(fp8, str):
            raise PolicyError(f"quantization.fp8: expected a recipe name, got {fp8!r}")
        return cls(int8=int8, fp8=fp8)


@dataclass(frozen=True)
class Policy:
    """Ordered (patterns/types -> dtype) rules, a default dtype, loss scaling and switches.

    ``tf32`` (CUDA) and ``hf32`` (Ascend) are None to leave the device's setting as is.
    ``writes_loss_scale``: whether its YAML has a ``loss_scale`` section where no loss is
    scaled (False for a policy whose trials train nothing: a serving policy); a YAML
    without one reads back so (which changes only how it is written again).
    ``quantization``: for serving, the method its int8 layers are quantized with
    (`Quantization`), so that converting by the policy alone serves what the search
    measured. ``reduce_dtype``: on several devices,
    the dtype gradients are communicated in (None: fp32): FSDP2's ``reduce_dtype``
    (`autoprec.apply_fsdp2`), or DDP's fp16 or bf16 compression hook
    (`autoprec.register_comm_hook`); searched where a search's trials run on several.
    ``optimizer_states``: the optimizer state's and the master weight's dtype per
    parameter group (`autoprec.optim.state`; the YAML's ``optimizer`` section, written
    only where it is not all fp32), built by ``optimizer``. ``guard``: the settings of
    the guard ``apply`` runs by default (`autoprec.guard.Guard`; the YAML's ``guard``
    section, from ``autoprec search --guard``), not part of the policy's identity.
    """

    rules: tuple[Rule, ...] = ()
    default: str = "fp32"
    loss_scale: LossScale = field(default_factory=LossScale)
    tf32: bool | None = None
    hf32: bool | None = None
    name: str | None = None
    writes_loss_scale: bool = field(default=True, compare=False)
    quantization: Quantization = field(default_factory=Quantization)
    reduce_dtype: str | None = None
    optimizer_states: OptimizerStates = field(default_factory=OptimizerStates)
    guard: Guard | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_dtype(self.default, "default")
        if self.reduce_dtype not in (None, *REDUCE_DTYPES):
            raise PolicyError(
                f"reduce_dtype: expected one of {', '.join(REDUCE_DTYPES)}, "
                f"got {self.reduce_dtype!r}"
            )
        object.__setattr__(self, "rules", tuple(self.rules))
        if not isinstance(self.quantization, Quantization):
            raise PolicyError("quantization: expected a Quantization")

    @property
    def int8_method(self) -> str | None:
        """The int8 method the policy was measured with (None: the device's default)."""
        return self.quantization.int8

    @property
    def fp8_recipe(self) -> str:
        """The torchao float8 recipe of the policy's fp8 layers (default: tensorwise)."""
        return self.quantization.fp8 or DEFAULT_FP8_RECIPE

    @property
    def fp8_method(self) -> str | None:
        """The fp8 serving method the policy was measured with (None: not a serving
        policy's fp8, or the device's default)."""
        fp8 = self.quantization.fp8
        return fp8 if fp8 in _method_names(FP8) else None

    @property
    def names_fp8(self) -> bool:
        """Whether the policy names fp8 (by its default or a rule)."""
        return any(isinstance(formats.get(d), FP8) for d in self.named_dtypes)

    @property
    def named_dtypes(self) -> tuple[str, ...]:
        """The dtypes its default and its rules name, in that order (repeats kept)."""
        return (self.default, *(rule.dtype for rule in self.rules))

    @property
    def serving_only(self) -> bool:
        """Whether the policy names a format only serving has (int8; by its default or a
        rule): a serving policy, which training cannot apply."""
        if self.fp8_method is not None and self.names_fp8:
            return True  # its fp8 layers are served by a float8 serving method
        return not all(formats.get(dtype).trains for dtype in self.named_dtypes)

    # -- construction and serialisation -------------------------------------------------

    @classmethod
    def uniform(cls, dtype: str, loss_scale: LossScale | None = None) -> Policy:
        """The whole model in one dtype; fp16 gets torch's dynamic loss scaling by default."""
        _check_dtype(dtype, "dtype")
        if loss_scale is None:
            loss_scale = LossScale("dynamic") if formats.get(dtype).scales_loss else LossScale()
        return cls(default=dtype, loss_scale=loss_scale, name=f"uniform-{dtype}")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.name:
            data["name"] = self.name
        data["default"] = self.default
        data["rules"] = [rule.to_dict() for rule in self.rules]
        if self.writes_loss_scale or self.loss_scale.enabled:  # a scale set is never dropped
            data["loss_scale"] = self.loss_scale.to_dict()
        switches = {k: v for k, v in (("tf32", self.tf32), ("hf32", self.hf32)) if v is not None}
        if switches:
            data["switches"] = switches
        quantization = self.quantization.to_dict()
        if quantization:
            data["quantization"] = quantization
        if self.reduce_dtype is not None:
            data["reduce_dtype"] = self.reduce_dtype
        if not self.optimizer_states.is_default:
            data["optimizer"] = self.optimizer_states.to_dict()
        if self.guard is not None:
            data["guard"] = self.guard.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Any, source: str = "policy") -> Policy:
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: expected a mapping at the top, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_POLICY_FIELDS))
        if unknown:
            raise PolicyError(
                f"{source}: {unknown[0]}: unknown field (expected {list(_POLICY_FIELDS)})"
            )
        try:
            rules_data = data.get("rules") or []
            if not isinstance(rules_data, list):
                raise PolicyError("rules: expected a list")
            rules = tuple(Rule.from_dict(r, f"rules[{i}]") for i, r in enumerate(rules_data))
            default = _check_dtype(data.get("default", "fp32"), "default")
            loss_scale = LossScale.from_dict(data.get("loss_scale"))
            switches = data.get("switches") or {}
            if not isinstance(switches, dict) or set(switches) - {"tf32", "hf32"}:
                raise PolicyError("switches: expected a mapping with tf32 and/or hf32")
            for key, value in switches.items():
                if value is not None and not isinstance(value, bool):
                    raise PolicyError(f"switches.{key}: expected true, false or null")
            name = check_name(data.get("name"), "name")
            quantization = Quantization.from_dict(data.get("quantization"))
            reduce_dtype = data.get("reduce_dtype")
            if reduce_dtype not in (None, *REDUCE_DTYPES):
                raise PolicyError(
                    f"reduce_dtype: expected one of {', '.join(REDUCE_DTYPES)}, "
                    f"got {reduce_dtype!r}"
                )
            optimizer_states = OptimizerStates.from_dict(data.get("optimizer"))
            guard = None if data.get("guard") in (None, False) else Guard.from_dict(data["guard"])
        except (PolicyError, GuardError) as error:
            raise type(error)(f"{source}: {error}") from None
        tf32, hf32 = switches.get("tf32"), switches.get("hf32")
        writes_loss_scale = "loss_scale" in data
        return cls(
            rules,
            default,
            loss_scale,
            tf32,
            hf32,
            name,
            writes_loss_scale,
            quantization,
            reduce_dtype,
            optimizer_states,
            guard,
        )

    def with_leading_rules(self, rules: list[dict[str, Any]]) -> Policy:
        """This policy with ``rules`` (each as its YAML writes a rule) ahead of its own, so
        that they win where they match: the guard's promotions (`autoprec.guard`)."""
        made = tuple(Rule.from_dict(rule, f"rules[{i}]") for i, rule in enumerate(rules))
        return replace(self, rules=(*made, *self.rules))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, source: str = "policy") -> Policy:
        return cls.from_dict(parse_yaml(text, source, PolicyError), source)

    def save(self, path: str | Path) -> Path:
        """The policy as YAML at ``path``, replaced whole (never half written)."""
        return write_atomic(path, self.to_yaml())

    # -- on a model: thin delegates to `autoprec.precision.landing` and `.resolution` ----
    # Imported where called: they import torch, and they act on a policy, so they sit above
    # this module and read a policy as `autoprec.precision.view.PolicyView`.

    def plan(
        self,
        model: nn.Module,
        device: str | torch.device | Backend | None = None,
        module: str | None = None,
    ) -> Plan:
        """Where the regions go on this model, for the device kind of ``device`` (default:
        where the model's parameters are); raises PolicyError for a rule that matches no
        module with parameters. On a model that holds the searched one (a LightningModule's
        ``self.net``), the policy lands on the submodule where every rule matches, or on the
        one ``module`` names (`autoprec.precision._placement`); the layers around it stay fp32."""
        from autoprec.precision import landing

        return landing.plan(self, model, device, module)

    def apply(
        self,
        model: nn.Module,
        device: str | torch.device | Backend | None = None,
        module: str | None = None,
        emulate: str | tuple[str, ...] = (),
        guard: Guard | bool | None = None,
    ) -> Precision:
        """Install the per-layer dtypes on ``model`` and return its Precision object.

        ``device`` defaults to the device the model's parameters are on. On a model that
        holds the searched one, the policy lands on the submodule where every rule matches
        (``module="net"`` names it where several do), and one line on the ``autoprec``
        logger says which. fp8 layers are swapped for torchao's ``Float8Linear`` (the same
        Parameters; ``prec.remove()`` swaps them back); on the CPU only with
        ``emulate="fp8"``, which runs fp8's numerics without its speed.

        ``guard``: a `autoprec.guard.Guard` (or True for its defaults) watches the run and
        widens a layer before it fails (`autoprec.guard.precision.GuardedPrecision`);
        None takes the policy's own ``guard:`` section, False runs unguarded.
        """
        from autoprec.precision import landing

        return landing.apply(self, model, device, module, emulate, guard)

    def resolve(
        self,
        model: nn.Module,
        device: str | torch.device | Backend | None = None,
        module: str | None = None,
        example: Any = None,
    ) -> dict[str, str]:
        """Every leaf module with parameters mapped to the dtype it computes and outputs
        on the device kind of ``device`` (default: where the model's parameters are), as
        forward hooks registered before ``apply`` see it; ``module``: as in `plan`.

        On the device kind the model is on, the classes of leaves that neither the tables
        nor a watched forward know (transformers' RMSNorms, layers of a user's own) are
        probed first, each alone on an input made from its parameters
        (`autoprec.numerics.observe.probe`); a module no input can be made for keeps the tables'
        word (the region's dtype). With ``example`` (a batch as the task gives it, or an
        `autoprec.tasks.Batch`), this is what one forward of it under the policy shows:
        each leaf's output dtype, as forward hooks see it; the classes of leaves it meets
        are watched first (`autoprec.numerics.observe.learn`), so later calls know them too.
        Without one, it is the plan's word, which is exact but for a leaf that runs in the
        dtype its input arrives in, uncast (a LayerNorm on the CPU under a uniform policy:
        fp32 where it reads an fp32 residual stream): then one forward of an input made up
        for the model (transformers' ``dummy_inputs``, or its first leaf's input; see
        `autoprec.numerics.observe.synthesized_run`) is watched instead, and where none can be made
        (or the device refuses the policy) such a leaf is reported in the policy's dtype.
        On another device kind it is the plan's word, from the tables and what was watched
        there so far. Leaves without parameters (ReLU, dropout, pooling) are not listed."""
        from autoprec.precision import resolution

        return resolution.resolve(self, model, device, module, example)

    def resolve_served(self, model: nn.Module) -> dict[str, str]:
        """Every leaf with parameters mapped to the dtype its weights are converted to for
        serving: its first matching rule's, or the default (no autocast table: serving
        converts the weights themselves). int8 from the default applies to the layers that
        can be int8 (Linear, Conv1D), the others stay fp32; fp8 from the default likewise
        to the Linear layers its method takes. An explicit int8 or fp8 rule on any other
        layer is refused when the model is converted."""
        from autoprec.precision import resolution

        return resolution.resolve_served(self, model)

    def identity(
        self,
        model: nn.Module | None = None,
        device: str | torch.device | Backend | None = None,
        mode: str | Mode | None = None,
    ) -> str:
        """What a trial of this policy measures in ``mode`` (a `Mode` or its name; None:
        the default, training), as a short hash: the dtype each layer runs in (given a
        model, each leaf with parameters on the device kind, as the mode resolves it,
        `Mode.resolve_policy`; without one, each rule's dtype and the default), where the
        mode's trials train the loss scaling where any of them is fp16 and the optimizer
        states, and the switches. Policies alike in this are measured once, whichever
        rules say it."""
        from autoprec.precision import resolution

        return resolution.identity(self, model, device, mode)

    def layer_table(
        self,
        model: nn.Module,
        device: str | torch.device | Backend | None = None,
        mode: str | Mode | None = None,
        example: Any = None,
    ) -> list[dict[str, Any]]:
        """Each leaf module with parameters: name, type, parameter count and the dtype it
        runs in as ``mode`` (a `Mode` or its name; None: the default, training) resolves it
        (`Mode.resolve_policy`; the serving mode: the dtype its weights are served in;
        ``example``: as ``resolve`` observes it on that batch); where the mode's trials
        train and the policy's optimizer states are not all fp32, each one's state."""
        from autoprec.precision import resolution

        return resolution.layer_table(self, model, device, mode, example)

    def low_precision_share(
        self,
        model: nn.Module,
        device: str | torch.device | Backend | None = None,
        mode: str | Mode | None = None,
        example: Any = None,
    ) -> float:
        """Share of the model's parameters that run in fp16 or bf16 (or, served, int8) as
        ``mode`` (None: training) resolves them; ``example``: as ``resolve`` observes it on
        that batch."""
        from autoprec.precision import resolution

        return resolution.share(self, model, device, mode, example)

    def resolve_states(self, model: nn.Module) -> dict[str, TrainingState]:
        """Every trainable parameter's name mapped to its training state (optimizer state
        kind and master dtype) as the ``optimizer`` section assigns it; raises
        PolicyError for a group that matches no parameter."""
        return self.optimizer_states.assign(model)

    def optimizer(
        self,
        model: nn.Module,
        optimizer: Any = None,
        **hyperparameters: Any,
    ) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s parameters that the policy's training states
        describe (`autoprec.optim.optimizer.build_optimizer`): ``optimizer`` (a class, called with
        ``hyperparameters``, or a factory ``(params) -> Optimizer``; None: ``torch.optim.AdamW``)
        for fp32 states, and torchao's optimizers with the same hyperparameters for the others,
        as one optimizer with ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict``."""
        import torch

        from autoprec.optim.optimizer import build_optimizer

        factory = torch.optim.AdamW if optimizer is None else optimizer
        return build_optimizer(self.optimizer_states, model, factory, **hyperparameters)


def load_policy(path: str | Path) -> Policy:
    """Read a policy YAML file (as written by ``autoprec search`` or by hand)."""
    return Policy.from_dict(load_yaml(path, PolicyError), str(path))
