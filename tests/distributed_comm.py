"""DDP's gradients communicated in a policy's ``reduce_dtype``, run by torchrun on 2 CPU
ranks (gloo): each rank trains the same model three times side by side on its own half of
the same batches, with ``autoprec.register_comm_hook`` under the policy, with torch's own
hook registered by hand, and with DDP's plain fp32 all-reduce, and writes to
``OUT_DIR/rank<N>.json`` whether the first two gave bit-equal gradients at every step, how
far the plain all-reduce was from them, the hook's name per reduce dtype, and what a bf16
policy was told. Imports nothing from the tests but its tasks."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))
from distributed_tasks import Net, _data

import autoprec

STEPS = 3


def policy(reduce_dtype: str | None) -> autoprec.Policy:
    return autoprec.Policy(reduce_dtype=reduce_dtype)


def ddp_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DistributedDataParallel(Net(width=64))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def gradients_per_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> list:
    inputs, labels = _data()
    found = []
    for step in range(STEPS):
        start = step * 8 + rank * 4  # each rank its half of a global batch of 8
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs[start : start + 4]), labels[start : start + 4])
        loss.backward()
        found.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return found


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, Any] = {"rank": rank, "hooks": {}}

    ours, ours_optimizer = ddp_model()
    report["hooks"]["fp16"] = autoprec.register_comm_hook(ours, policy("fp16"))
    by_hand, by_hand_optimizer = ddp_model()
    by_hand.register_comm_hook(None, default_hooks.fp16_compress_hook)
    plain, plain_optimizer = ddp_model()
    report["hooks"]["fp32"] = autoprec.register_comm_hook(plain, policy("fp32"))
    report["hooks"]["none"] = autoprec.register_comm_hook(ddp_model()[0], policy(None))

    ours_grads = gradients_per_step(ours, ours_optimizer, rank)
    by_hand_grads = gradients_per_step(by_hand, by_hand_optimizer, rank)
    plain_grads = gradients_per_step(plain, plain_optimizer, rank)
    report["equal_to_torch_hook"] = [
        all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        for mine, theirs in zip(ours_grads, by_hand_grads, strict=True)
    ]
    report["max_abs_diff_to_fp32"] = [
        max(float((a - b).abs().max()) for a, b in zip(mine, fp32, strict=True))
        for mine, fp32 in zip(ours_grads, plain_grads, strict=True)
    ]
    report["elements"] = sum(p.numel() for p in ours.parameters())
    report["grads_dtype"] = str(ours_grads[0][0].dtype)

    try:
        autoprec.register_comm_hook(ddp_model()[0], policy("bf16"))
        report["bf16"] = "registered"
    except autoprec.PolicyError as error:
        report["bf16"] = str(error)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
