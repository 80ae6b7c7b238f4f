"""What a number format is, as the rest of autoprec sees it: the `Format` base class, whose
defaults are a floating format a region autocasts to, and `Limits`, its range and precision.

A format is one object (one module of `autoprec.formats`) that declares everything the code
needs of it: its name and aliases, its limits (the forecast, telemetry, profile and report
read them), the modes it serves, the devices it runs on, how it lands on a module, its bytes
per element with scales, its colour and its export mappings. The rest of the code asks the
object and never names a format. A format module imports no torch: the methods that need
it import it when called, so that ``--help`` stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from autoprec.errors import PolicyError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autoprec.formats.methods import Quantizer

# How a format lands on a layer in a training run:
AUTOCAST = "autocast"  # a region autocasts the layer's ops to its torch dtype
CONVERT = "convert"  # the layer is swapped for a converted one, run in the region around it
# How it lands in serving:
CAST = "cast"  # the weights are cast to its torch dtype
QUANTIZE = "quantize"  # a method quantizes the layer's weights; its inputs stay fp32


@dataclass(frozen=True)
class Limits:
    """A format's range and precision: the largest finite value, the smallest normal and
    subnormal magnitudes, and the mantissa bits (explicit, as torch.finfo counts them)."""

    largest: float
    smallest_normal: float
    smallest_subnormal: float
    mantissa_bits: int

    @property
    def range_bits(self) -> float:
        """log2 of largest over smallest normal: the octaves a value can move through."""
        return math.log2(self.largest / self.smallest_normal)


def is_plain_linear(module: object) -> bool:
    """Whether ``module`` is an ``nn.Linear`` itself: subclasses may be read by their parent
    rather than called (MultiheadAttention's ``out_proj``), or change what the forward does."""
    kind = type(module)
    return kind.__name__ == "Linear" and kind.__module__ == "torch.nn.modules.linear"


class Format:
    """One number format. Subclass it and set what differs from a floating format that
    training autocasts to and serving casts to (fp16, bf16)."""

    name: ClassVar[str]  # as a policy, a space and a summary spell it
    aliases: ClassVar[tuple[str, ...]] = ()
    help: ClassVar[str] = ""  # one line, for the docs and ``autoprec formats``
    limits: ClassVar[Limits]
    # The element types whose limits the watcher sees (a torch dtype's name: its limits),
    # for a format that stores values in another type than its name says (fp8's e4m3 and
    # e5m2); default: its own name.
    elements: ClassVar[dict[str, Limits]] = {}
    modes: ClassVar[tuple[str, ...]] = ("training", "serving")
    trains: ClassVar[str] = AUTOCAST  # how it lands in training (`AUTOCAST`, `CONVERT`)
    serves: ClassVar[str] = CAST  # how it lands in serving (`CAST`, `QUANTIZE`)
    torch_name: ClassVar[str | None] = None  # torch's name of its dtype (``float16``)
    bytes_per_element: ClassVar[float]  # scales included
    colour: ClassVar[str] = "#937860"  # the report's
    # fp32: what every trial is compared to; a policy's default, the layers left alone.
    reference: ClassVar[bool] = False
    # Whether its gradients underflow unless the loss is scaled (fp16): the search tries
    # loss scaling where a policy names it, and a policy's identity includes the scaling.
    scales_loss: ClassVar[bool] = False
    # Where a conversion format is a policy's default, the layers it cannot take run in
    # this format (fp8: bf16, as torchao's users run the rest of the model).
    rest: ClassVar[str] = "fp32"
    # The format a layer served in it takes its inputs in, where it quantizes them itself.
    activation_format: ClassVar[str] = "fp32"
    # Whether a device without its kernels may run its numerics, opted into with
    # ``--emulate NAME`` (real numerics, no speed).
    emulated_elsewhere: ClassVar[bool] = False
    # Whether a policy's ``quantization:`` section records how its layers are made (int8's
    # method, fp8's recipe or serving method): a space fits its layers one by one for it.
    policy_records: ClassVar[bool] = False
    # Its export mappings: an export format's name to what it writes for this format.
    exports: ClassVar[dict[str, str]] = {}
    # A conversion format's training recipes (the first its default), as a policy's
    # ``quantization:`` section names one.
    recipes: ClassVar[tuple[str, ...]] = ()
    # A quantizing format's serving methods, and the one each device kind uses unnamed.
    methods: ClassVar[tuple[Quantizer, ...]] = ()
    default_methods: ClassVar[dict[str, str]] = {}

    # -- what it is -----------------------------------------------------------------

    @property
    def low_precision(self) -> bool:
        """Whether it runs below the reference: counts in a policy's low-precision share."""
        return not self.reference

    @property
    def autocasts(self) -> bool:
        """Whether a training region autocasts to it."""
        return self.trains == AUTOCAST and "training" in self.modes

    @property
    def quantizes(self) -> bool:
        """Whether serving quantizes a layer's weights to it (inputs stay fp32)."""
        return self.serves == QUANTIZE

    @property
    def records_conversion(self) -> bool:
        """Whether it converts layers and a policy records its recipe or method (fp8)."""
        return self.policy_records and self.converts

    @property
    def records_quantization(self) -> bool:
        """Whether it quantizes layers and a policy records its method (int8)."""
        return self.policy_records and not self.converts

    @property
    def converts(self) -> bool:
        """Whether training swaps a layer for a converted one (`convert`)."""
        return self.trains == CONVERT and "training" in self.modes

    def element_limits(self) -> dict[str, Limits]:
        """The limits of each element type it stores values in."""
        return dict(self.elements) or {self.name: self.limits}

    def torch_dtype(self) -> torch.dtype:
        """Its torch dtype (a region's, or a cast's); TypeError for one torch has none of."""
        import torch

        if self.torch_name is None:
            raise TypeError(f"{self.name}: no torch dtype")
        return getattr(torch, self.torch_name)  # type: ignore[no-any-return]

    def activation(self) -> str:
        """The format a layer served in it takes its inputs in: a quantized layer quantizes
        its activations itself, from `activation_format`."""
        return self.activation_format if self.quantizes else self.name

    # -- where it runs --------------------------------------------------------------

    def refusal(self, backend: Any) -> str | None:
        """Why it cannot train on ``backend`` (a `autoprec.devices.Backend`), in one line;
        None where it can. Default: a region's dtype runs where the device has it."""
        if self.autocasts and not backend.has_dtype(self.torch_dtype()):
            return f"not supported by device {backend.name}"
        return None

    # -- training by conversion (`CONVERT`) -----------------------------------------

    def layer_refusal(self, module: nn.Module) -> str | None:
        """Why this layer cannot be converted to it (None: it can)."""
        return None

    def region_refusal(self, kind: str, recipe: str | None, region: str) -> str | None:
        """Why its converted layers cannot run by ``recipe`` inside a ``region`` region on
        this device kind (None: nothing says they cannot)."""
        return None

    def convert(self, model: nn.Module, names: list[str], recipe: str | None) -> Any:
        """The named layers of ``model`` converted for training; returns an object whose
        ``remove()`` puts the originals back, with the same Parameters."""
        raise TypeError(f"{self.name}: not a conversion format")

    # -- serving by quantization (`QUANTIZE`) -----------------------------------------

    def method(self, name: str | None, kind: str) -> Quantizer | None:
        """Its serving method ``name`` (None: the device kind's default; None where there
        is none); PolicyError for a name it has no method of."""
        name = name or self.default_methods.get(kind)
        if name is None:
            return None
        for method in self.methods:
            if method.name == name:
                return method
        known = ", ".join(m.name for m in self.methods)
        raise PolicyError(f"{self.name}: unknown method {name!r} (expected {known})")

    def serving_refusal(self, backend: Any, method: Quantizer | None) -> str | None:
        """Why it cannot be served on ``backend`` by ``method``, in one line (None: it can)."""
        if not self.quantizes:
            return self.refusal(backend)
        if method is None:
            return f"{self.name}: no {self.name} serving method for {backend.kind}"
        return method.unavailable_reason(backend.kind)

    def serving_layer_refusal(self, module: nn.Module, method: Quantizer | None) -> str | None:
        """Why this layer cannot be served in it by ``method`` (None: it can). Default: a
        quantizing format takes plain ``nn.Linear`` layers only."""
        if self.quantizes and not is_plain_linear(module):
            return f"a {type(module).__name__} is not an nn.Linear, which {self.name} needs"
        return None

    def holds(self, weight: Any) -> bool:
        """Whether a quantized weight (a torchao tensor, or torch's packed one) is stored
        in this format: what a conversion really did, for checks and reports."""
        return False

    def __repr__(self) -> str:
        return f"<format {self.name}>"
