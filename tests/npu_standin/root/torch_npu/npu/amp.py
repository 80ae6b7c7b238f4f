"""``torch_npu.npu.amp`` as the STAND-IN provides it: the GradScaler, on CPU tensors."""

from __future__ import annotations

import torch


class GradScaler(torch.amp.GradScaler):
    """torch_npu's GradScaler signature (its ``dynamic`` flag included) over torch's CPU
    GradScaler. With ``dynamic=False`` the scale stays at ``init_scale``, as torch_npu's
    static scaling does. Not torch_npu's code: it reads no float-status register and prints
    nothing on overflow."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        dynamic: bool = True,
    ) -> None:
        super().__init__("cpu", init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.dynamic = dynamic

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self.dynamic and new_scale is None and self.is_enabled():
            new_scale = self.get_scale()
        super().update(new_scale)
