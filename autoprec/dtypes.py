"""The dtype vocabulary: the names a policy, a space, a summary and a report use for dtypes,
written once, with the sets each mode may use and the torch dtype of each floating one.

Training runs fp32, fp16 or bf16 under autocast (fp32 master weights). Serving converts the
weights themselves, so it also has int8 (quantized Linear layers, by a method of
`autoprec.serving.quantizers`). Training also has fp8 for Linear layers: torchao's
float8 training swaps them for ``Float8Linear`` (scaled fp8 matmuls, fp32 master weights;
`autoprec.precision.fp8`), while the layers around them run in their autocast region. fp8 is not a
torch dtype a region can autocast to, so it is not in ``TORCH_DTYPES``. Serving has fp8 too:
Linear layers whose weights are stored in float8 by a torchao method (`autoprec.serving.fp8`),
quantized as int8 layers are, their activations handed to them in fp32.
"""

from __future__ import annotations

import torch

FP32 = "fp32"
FP16 = "fp16"
BF16 = "bf16"
INT8 = "int8"
FP8 = "fp8"

# The floating dtypes autocast and ``Tensor.to`` know, by name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    FP32: torch.float32,
    FP16: torch.float16,
    BF16: torch.bfloat16,
}
# Floating dtypes below fp32: what "low precision" means in training (the share of
# parameters, the profile's tests, the guided search's low dtypes).
LOW_PRECISION: tuple[str, ...] = (FP16, BF16)
# Dtypes stored as integers with a scale, whose layers are quantized rather than cast.
QUANTIZED: tuple[str, ...] = (INT8,)
# Dtypes serving quantizes a layer's weights to (fp8 by torchao's float8 configs).
SERVING_QUANTIZED: tuple[str, ...] = (FP8, INT8)
# What each mode may assign to a layer: regions' dtypes, and (training) fp8 Linear layers.
AUTOCAST_DTYPES: tuple[str, ...] = tuple(TORCH_DTYPES)
TRAINING_DTYPES: tuple[str, ...] = (*AUTOCAST_DTYPES, FP8)
SERVING_DTYPES: tuple[str, ...] = (*AUTOCAST_DTYPES, *QUANTIZED, FP8)
# Every dtype a policy may name, in either mode.
POLICY_DTYPES: tuple[str, ...] = (*AUTOCAST_DTYPES, FP8, *QUANTIZED)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a floating dtype name (``fp16`` -> ``torch.float16``)."""
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch floating dtype (``torch.bfloat16`` -> ``bf16``), else torch's
    own spelling of it."""
    names = {value: key for key, value in TORCH_DTYPES.items()}
    return names.get(dtype, str(dtype))


def activation_dtype(dtype: str) -> str:
    """The dtype a layer served in ``dtype`` takes its inputs in: a quantized layer
    quantizes fp32 activations itself (a served fp8 layer too)."""
    return FP32 if dtype in SERVING_QUANTIZED else dtype


def below_fp32(dtype: str) -> bool:
    """Whether a layer in ``dtype`` runs below fp32 (counts in the low-precision share)."""
    return dtype != FP32
