"""A STAND-IN for torch_npu, on CPU tensors: not Ascend, and none of torch_npu's code.

It exists so that autoprec's NPU backend (autoprec.devices.NPUBackend) and its torch-npu
export run end to end in CI, where there is no Ascend chip. It provides the documented API
surface they call (shared/NPU.md): ``torch.npu`` (availability, device selection,
synchronisation, allocator statistics, bf16 support, ``set_option``, the HF32 switches) and
``torch_npu.npu.amp.GradScaler``, on a stand-in machine described by ``STANDIN``.

What it proves: the backend's code paths run (detection, device selection and its
restoring, dispatch of every call with an NPU device, option validation, HF32 switches set
and restored, a trial, a profile and a search on device "npu").
What it cannot: Ascend kernels, HF32 or fp16 numerics on the chip, torch_npu's autocast
op lists (``torch.autocast("npu")`` runs the CPU's here), real memory figures
(``max_memory_allocated`` reports a fixed figure), 910A's saturation mode, speed.
See tests/npu_standin/README.md, and ``torch_npu.standin`` for how it hooks into torch.
"""

from __future__ import annotations

import torch

from torch_npu import npu
from torch_npu.standin import STANDIN, attach, detach

__all__ = ["STANDIN", "detach", "npu"]
__version__ = f"{torch.__version__.split('+')[0]}+standin"

attach(npu)
