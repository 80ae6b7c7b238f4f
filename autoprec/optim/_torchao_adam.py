"""torchao's Adam step (``_AdamBase``, the code its 8-bit, 4-bit and fp8 optimizers
share) with the state buffers autoprec's other kinds need: fp32 moments beside a bf16
master, bf16 moments, and MS-AMP O2-like moments (fp8 first, bf16 second).

Importing this module imports torchao (quietly): `autoprec.optim.optimizer` imports it
only for a policy that names one of these kinds, so a policy without an optimizer
section needs no torchao.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _adam_base() -> type:
    from autoprec.formats.methods import import_torchao

    import_torchao()  # quietly: its import-time noise is not the user's to see
    from torchao.optim.adam import _AdamBase

    return _AdamBase


class _BufferAdam(_adam_base()):  # type: ignore[misc]
    """torchao's Adam step (``_AdamBase``) with the state buffers a subclass makes."""

    def __init__(
        self,
        params: list[nn.Parameter],
        adamw: bool,
        bf16_stochastic_round: bool,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            block_size=256,
            bf16_stochastic_round=bf16_stochastic_round,
            is_adamw=adamw,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, which casts plain state tensors to their parameter's dtype; these keep
        theirs (fp32 moments of a bf16 master, bf16 moments of an fp32 one), as saved."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in state_dict["state"].items():
            param = params[index]
            for key, value in values.items():
                if key != "step" and type(value) is torch.Tensor:
                    self.state[param][key] = value.to(param.device, copy=True)


class _Fp32StateAdam(_BufferAdam):
    """fp32 moments whatever the parameter's dtype (a bf16 master keeps fp32 states)."""

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        return torch.zeros_like(p, dtype=torch.float32)


class _Bf16StateAdam(_BufferAdam):
    """Both moments in bf16 (torchao's step computes in fp32 and rounds them to nearest)."""

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        return torch.zeros_like(p, dtype=torch.bfloat16)


class _Fp8Bf16StateAdam(_BufferAdam):
    """MS-AMP O2-like: the first moment in torchao's blockwise fp8 (``OptimStateFp8``),
    the second in bf16; tensors torchao would not quantise keep fp32 first moments."""

    @staticmethod
    def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
        from torchao.optim.subclass_fp8 import OptimStateFp8

        return OptimStateFp8.zeros(p.shape, block_size, p.device, dtype=p.dtype)

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        if signed:
            return super()._new_buffer(p, signed)  # type: ignore[no-any-return]
        return torch.zeros_like(p, dtype=torch.bfloat16)


BUFFERED: dict[str, type[_BufferAdam]] = {
    "fp32": _Fp32StateAdam,
    "bf16": _Bf16StateAdam,
    "fp8-bf16": _Fp8Bf16StateAdam,
}
