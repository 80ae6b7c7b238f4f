"""Trials across several devices: each trial a torchrun launch of N ranks under DDP or
FSDP2, the policy applied on every rank, one loss-scale decision for all of them.

- `autoprec.distributed.rank`: the program each rank runs, and the interface (spec and
  result files) between it and the launcher; see its docstring.
- `autoprec.distributed.fsdp`: FSDP2 units and their mixed precision from a policy
  (`apply_fsdp2`, for a user's own distributed loop).
- `autoprec.distributed.ddp`: DDP's gradients communicated in the policy's dtype
  (`register_comm_hook`: torch's fp16 or bf16 compression hook).
- `autoprec.distributed.data`: how a task's data is split across the ranks (`shard`).

Nothing here is imported by ``import autoprec``; ``autoprec.apply_fsdp2``,
``autoprec.register_comm_hook`` and ``autoprec.shard`` load on first use.
"""

from __future__ import annotations

from autoprec.distributed.data import shard
from autoprec.distributed.ddp import register_comm_hook
from autoprec.distributed.fsdp import apply_fsdp2

__all__ = ["apply_fsdp2", "register_comm_hook", "shard"]
