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


def first_step_s(kind: str, width: int) -> float:
    net = model(width)
    optimizer = Policy(optimizer_states=OptimizerStates(kind)).optimizer(net, lr=1e-3)
    net(torch.randint(0, 512, (8,))).square().mean().backward()
    started = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="8bit,4bit,fp8,bf16,fp8-bf16")
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, model width {args.width}, 4 parameter shapes each")
    print("| state | first step s | again s | after dynamo reset s |")
    print("|---|---|---|---|")
    for kind in args.kinds.split(","):
        first = first_step_s(kind, args.width)
        again = first_step_s(kind, args.width)
        torch._dynamo.reset()
        reset = first_step_s(kind, args.width)
        print(f"| {kind} | {first:.1f} | {again:.2f} | {reset:.1f} |", flush=True)


if __name__ == "__main__":
    main()
