"""What torchao's low-bit optimizers cost to compile, per trial, and whether a later
trial in the same process reuses the compiled steps.

torchao steps every parameter through ``torch.compile(single_param_adam, fullgraph=True,
dynamic=False)``: one graph per distinct (shape, dtype, state class, flags). The script
builds the optimizer of each state kind through ``policy.optimizer`` three times on the
same model shape and times its first step:

- ``first``: a fresh process's first trial of that kind (the compile);
- ``again``: a second optimizer on a fresh model of the same shapes, as the next trial of
  a search builds it (Dynamo's cache sits on the compiled function, not the optimizer);
- ``after reset``: after ``torch._dynamo.reset()``, which every ``--compile`` trial does
  first (`autoprec.trials.compiled.fresh_compiler`), so those trials compile their optimizer
  again (inductor's on-disk cache makes it cheaper than ``first``).

    python benchmarks/bench_optimizer_compile.py [--kinds 8bit,4bit,fp8,bf16] [--width 256]
    python benchmarks/bench_optimizer_compile.py --task tiny-gpt2 --kinds 8bit,4bit,fp8-bf16

``--task`` takes a built-in task's model, optimizer and first training batch instead (the
states a ``--prefer memory`` search of it offers).

Figures depend on load; run it on an idle machine. CPU only needed.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn

from autoprec.optim.state import OptimizerStates
from autoprec.policy import Policy


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(512, width),
        nn.Linear(width, 4 * width),
        nn.GELU(),
        nn.Linear(4 * width, width),
    )


def first_step_s(kind: str, width: int, task: str | None = None) -> float:
    policy = Policy(optimizer_states=OptimizerStates(kind))
    if task is None:
        net = model(width)
        optimizer = policy.optimizer(net, lr=1e-3)
        net(torch.randint(0, 512, (8,))).square().mean().backward()
    else:
        from autoprec.tasks import load_task

        found = load_task(task)
        torch.manual_seed(0)
        net = found.model()
        optimizer = policy.optimizer(net, found.make_optimizer)
        batch = found.batch(next(iter(found.train_data(0))))
        found.compute_loss(batch.run(net), batch.targets).backward()
    started = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="8bit,4bit,fp8,bf16,fp8-bf16")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--task", default=None, help="a built-in task's model instead")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    what = f"task {args.task}" if args.task else f"model width {args.width}, 4 parameter shapes"
    print(f"torch {torch.__version__}, {what}")
    print("| state | first step s | again s | after dynamo reset s |")
    print("|---|---|---|---|")
    for kind in args.kinds.split(","):
        first = first_step_s(kind, args.width, args.task)
        again = first_step_s(kind, args.width, args.task)
        torch._dynamo.reset()
        reset = first_step_s(kind, args.width, args.task)
        print(f"| {kind} | {first:.1f} | {again:.2f} | {reset:.1f} |", flush=True)


if __name__ == "__main__":
    main()
