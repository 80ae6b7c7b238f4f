"""A user's own distributed loop applying a found policy, run by torchrun on 2 CPU ranks
(gloo): ``policy.apply`` then DDP, and ``autoprec.apply_fsdp2``. Each rank writes what it
saw to ``OUT_DIR/rank<N>.json``: the dtype each layer's output had (forward hooks), what
``policy.resolve`` says, and the losses. Imports nothing from the tests but its tasks."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))
from distributed_tasks import Net, _data

import autoprec
from autoprec.numerics.observe import first_floating_dtype
from autoprec.precision.plan import parameterised_leaves

POLICY = autoprec.Policy.from_dict(
    {
        "default": "bf16",
        "rules": [{"patterns": ["blocks.1"], "dtype": "fp32"}],
        "loss_scale": {"mode": "dynamic", "init_scale": 256.0},
    }
)
STEPS = 3


def watch(model: nn.Module, seen: dict[str, str]) -> None:
    for name, leaf in parameterised_leaves(model):

        def hook(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
            seen.setdefault(name, first_floating_dtype(output) or "none")

        leaf.register_forward_hook(hook)


def train(trained: nn.Module, prec: Any, rank: int) -> list[float]:
    optimizer = torch.optim.Adam(trained.parameters(), lr=1e-3)
    inputs, labels = _data()
    losses = []
    for step in range(STEPS):
        start = step * 8 + rank * 4  # each rank its half of a global batch of 8
        x, y = inputs[start : start + 4], labels[start : start + 4]
        optimizer.zero_grad()
        with prec.autocast():
            out = trained(x)
        loss = F.cross_entropy(out.float(), y)
        prec.backward(loss)
        prec.step(optimizer)
        losses.append(float(loss.detach()))
    return losses


def bare_units(rank: int) -> dict[str, Any]:
    """FSDP2's own casts alone (no autocast, no regions): autoprec's units train, where
    units that set only a bf16 ``param_dtype`` fail at the bf16-to-fp32 boundary."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from autoprec.distributed.fsdp import shard_model

    inputs, labels = _data()
    x, y = inputs[rank * 4 : rank * 4 + 4], labels[rank * 4 : rank * 4 + 4]
    torch.manual_seed(0)
    model = Net()
    shard_model(model, POLICY.plan(model, "cpu").leaf_dtypes)
    loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    naive = Net()
    fully_shard(naive.blocks[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(naive.blocks[1])
    fully_shard(naive)
    try:
        naive(x.bfloat16())
        failure = None
    except RuntimeError as error:
        failure = str(error)
    return {"loss": float(loss.detach()), "naive_failure": failure}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, Any] = {"rank": rank}

    torch.manual_seed(0)
    model = Net()
    resolved = POLICY.resolve(model, "cpu")
    prec = POLICY.apply(model, "cpu")
    seen: dict[str, str] = {}
    watch(model, seen)
    losses = train(DistributedDataParallel(model), prec, rank)
    report["ddp"] = {"resolved": resolved, "seen": seen, "losses": losses}

    torch.manual_seed(0)
    model = Net()
    resolved = POLICY.resolve(model, "cpu")
    seen = {}
    watch(model, seen)
    prec = autoprec.apply_fsdp2(model, POLICY, mesh=init_device_mesh("cpu", (2,)))
    losses = train(model, prec, rank)
    report["fsdp2"] = {
        "resolved": resolved,
        "seen": seen,
        "losses": losses,
        "sharded": all(hasattr(p, "_local_tensor") for p in model.parameters()),
        "loss_scale": prec.loss_scale,
    }
    report["bare"] = bare_units(rank)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # every rank is done with its collectives
    dist.destroy_process_group()
    (out_dir / f"done{rank}").write_text("")  # what an abort at exit comes after


if __name__ == "__main__":
    main(Path(sys.argv[1]))
