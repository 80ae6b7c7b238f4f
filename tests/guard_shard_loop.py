"""A guarded FSDP2 run without loss scaling whose gradient overflows on one rank's shard
only, run by torchrun on 2 CPU ranks (gloo).

A planted model: one bias-free Linear under fp16 with nothing scaling the loss, whose
first output feature the loss weighs by ``WEIGHT``; at step ``BAD_STEP`` the inputs are
large, so that the gradient of the weight's first row (rank 0's shard) passes fp16's
maximum while the loss and rank 1's shard stay finite. Every rank must skip that step,
roll back and promote the layer together. FSDP2 keeps computing the weight's gradient in
its unit's ``param_dtype`` (fp16), which a promotion of the layer's region does not
change: the step fails again after each promotion until the guard stops, on every rank
alike, with a `GuardError`. Each rank writes ``OUT_DIR/rank<N>.json``: its changes, its
steps, the error it stopped with, and whether its shard is finite."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autoprec import GuardError, Policy, apply_fsdp2

STEPS = 8
BAD_STEP = 5
WEIGHT = 1e3  # the first output's weight in the loss


class Planted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    out = out.float()
    return out[:, 0].sum() * WEIGHT + out[:, 1:].pow(2).sum()


def batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step * 2 + rank)
    x = torch.rand(8, 4, generator=generator)
    return x * 100.0 if step == BAD_STEP else x  # 8 * 100 * 1e3 > 65504


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Planted()
    policy = Policy.from_dict({"default": "fp16", "loss_scale": {"mode": "none"}})
    prec = apply_fsdp2(model, Policy.from_dict({**policy.to_dict(), "guard": {}}))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps, error = 0, None
    try:
        for step in prec.guarded(range(STEPS)):
            optimizer.zero_grad()
            with prec.autocast():
                out = model(batch(step, rank))
            prec.backward(loss_of(out))
            prec.step(optimizer)
            steps += 1
    except GuardError as stopped:
        error = str(stopped)
    shard = model.fc.weight.to_local()
    report = {
        "changes": [change.to_dict() for change in prec.changes],
        "trained_steps": steps,
        "error": error,
        "finite": bool(torch.isfinite(shard).all()),
        "policy": prec.current_policy(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    (out_dir / f"done{rank}").write_text("")  # what an abort at exit comes after


if __name__ == "__main__":
    main(Path(sys.argv[1]))
