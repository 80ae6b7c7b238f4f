"""DDP under a policy: the gradients communicated in the policy's ``reduce_dtype``.

DDP all-reduces gradients in their own dtype (fp32 for fp32 masters). torch's compression
hooks (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``) cast each bucket to
fp16 or bf16, divide it by the number of ranks, all-reduce it and cast it back: half the
traffic, at the precision the trial measures. ``reduce_dtype`` fp32 (or none) registers
no hook, and DDP reduces as it always does.

torch refuses ``bf16_compress_hook`` unless it was built with CUDA and NCCL 2.10+ (or
XPU with XCCL): on the CPU wheel, over gloo, only fp16 is possible, and a policy that
asks for bf16 is refused in one line before anything trains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoprec.errors import PolicyError
from autoprec.policy import REDUCE_DTYPES

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from autoprec.policy import Policy

# The dtype gradients are communicated in -> torch's hook for it (fp32: none).
COMPRESS_HOOKS = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}


def bf16_hook_supported() -> bool:
    """Whether torch lets DDP register ``bf16_compress_hook`` here: the condition of
    ``DistributedDataParallel._check_comm_hook`` (CUDA or ROCm with NCCL 2.10+, or XPU
    with XCCL)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return False
    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    try:
        nccl = gpu_build and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    except (RuntimeError, AttributeError):
        nccl = False
    xccl = getattr(dist, "is_xccl_available", lambda: False)() and torch.xpu.is_available()
    return bool(nccl or xccl)


def ddp_reduce_dtypes() -> tuple[str, ...]:
    """The dtypes DDP may communicate gradients in with this torch: fp32, fp16, and bf16
    where torch allows its hook."""
    return ("fp32", "bf16", "fp16") if bf16_hook_supported() else ("fp32", "fp16")


def check_ddp_reduce_dtype(reduce_dtype: str) -> None:
    """Raise PolicyError, in one line, for a dtype DDP cannot communicate gradients in here."""
    if reduce_dtype not in REDUCE_DTYPES:
        raise PolicyError(
            f"reduce_dtype: expected one of {', '.join(REDUCE_DTYPES)}, got {reduce_dtype!r}"
        )
    if reduce_dtype not in ddp_reduce_dtypes():
        raise PolicyError(
            "reduce_dtype bf16 under DDP: torch registers bf16_compress_hook only with CUDA "
            "and NCCL 2.10+ (or XPU and XCCL), which this torch lacks; use fp16 or fp32"
        )


def compress_gradients(
    ddp_model: DistributedDataParallel, reduce_dtype: str, process_group: Any = None
) -> str | None:
    """Register torch's compression hook for ``reduce_dtype`` on ``ddp_model``; returns the
    hook's name (None for fp32: DDP's own all-reduce)."""
    check_ddp_reduce_dtype(reduce_dtype)
    name = COMPRESS_HOOKS.get(reduce_dtype)
    if name is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp_model.register_comm_hook(process_group, getattr(default_hooks, name))
    return name


def register_comm_hook(
    ddp_model: DistributedDataParallel, policy: Policy, process_group: Any = None
) -> str | None:
    """Communicate ``ddp_model``'s gradients in the dtype ``policy`` names (its
    ``reduce_dtype``), as a trial under ``--parallel ddp`` did: torch's own
    ``fp16_compress_hook`` or ``bf16_compress_hook`` registered on the DDP model, or
    nothing for fp32 (or a policy that names none). Call it on every rank, once, before
    the first backward. ``process_group``: the hook's group (None: DDP's own).

    Returns the hook's name, or None where DDP reduces as it does by default. Raises
    PolicyError where torch cannot register the hook (bf16 without CUDA and NCCL)."""
    return compress_gradients(ddp_model, policy.reduce_dtype or "fp32", process_group)
