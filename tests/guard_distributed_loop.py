"""A guarded loop on 2 CPU ranks (gloo), run by torchrun: a fragile zoo task under uniform
fp16 with the guard, each rank on its half of every global batch, under DDP or under FSDP2
(``autoprec.apply_fsdp2`` with the guard in the policy). Each rank writes
``OUT_DIR/<mode>-rank<N>.json`` (its changes, its step count, whether its weights are
finite) and ``OUT_DIR/<mode>-rank<N>.pt`` (its parameters and buffers: the whole model under DDP,
its shards under FSDP2).

Usage: ``torchrun --nproc-per-node 2 tests/guard_distributed_loop.py OUT_DIR TASK STEPS
MODE...`` with MODE ``ddp`` or ``fsdp2``."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from autoprec import Guard, Policy, apply_fsdp2
from autoprec.devices import get_backend
from autoprec.distributed.data import rank_train_data
from autoprec.numerics.observe import first_floating_dtype
from autoprec.precision.plan import parameterised_leaves
from autoprec.tasks.zoo import zoo_task
from autoprec.trials.training import draw_batch, train_step

GUARD = Guard(check_every=50, snapshot_every=200)


def output_dtypes(trained: torch.nn.Module, prec: Any, drawn: list[Any]) -> dict[str, str]:
    """The dtype each parameterised leaf's output has in one more forward (every rank runs
    it: under FSDP2 a forward is a collective)."""
    model = prec.model
    seen: dict[str, str] = {}

    def hook(module: torch.nn.Module, args: Any, output: Any, name: str) -> None:
        seen.setdefault(name, first_floating_dtype(output) or "none")

    handles = [
        leaf.register_forward_hook(functools.partial(hook, name=name))
        for name, leaf in parameterised_leaves(model)
    ]
    with torch.no_grad(), prec.autocast():
        drawn[0].run(trained)
    for handle in handles:
        handle.remove()
    return seen


def run(out_dir: Path, task_name: str, steps: int, mode: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    task = zoo_task(task_name)
    torch.manual_seed(0)
    model = task.model()
    model.train()
    policy = dataclasses.replace(Policy.uniform("fp16"), guard=GUARD)
    if mode == "ddp":
        prec = policy.apply(model)
        trained: torch.nn.Module = DistributedDataParallel(model)
    else:
        prec = apply_fsdp2(model, policy)
        trained = model
    optimizer = task.make_optimizer(trained.parameters())
    scheduler = task.make_scheduler(optimizer)
    if scheduler is not None:
        prec.track(scheduler)
    backend = get_backend("cpu")
    source = rank_train_data(task.train_data, 0, rank, world)

    def batches() -> Any:
        for step in range(steps):
            yield draw_batch(task, source, step, steps, backend)

    trained_steps = 0
    for drawn in prec.guarded(batches()):
        train_step(task, trained, optimizer, prec, drawn, scheduler)
        trained_steps += 1
    seen = output_dtypes(trained, prec, drawn)
    weights = {
        name: getattr(t, "_local_tensor", t).detach() for name, t in model.state_dict().items()
    }
    report = {
        "changes": [change.to_dict() for change in prec.changes],
        "trained_steps": trained_steps,
        "step_count": prec.step_count,
        "finite": all(
            bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point()
        ),
        "parameters": [name for name, _ in model.named_parameters()],
        "sharded": all(hasattr(p, "_local_tensor") for p in model.parameters()),
        "policy": prec.current_policy(),
        "seen": seen,
    }
    torch.save(weights, out_dir / f"{mode}-rank{rank}.pt")
    (out_dir / f"{mode}-rank{rank}.json").write_text(json.dumps(report))


def main(out_dir: Path, task_name: str, steps: int, modes: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for mode in modes:
        run(out_dir, task_name, steps, mode)
        dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    (out_dir / f"done{rank}").write_text("")  # what an abort at exit comes after


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:])
