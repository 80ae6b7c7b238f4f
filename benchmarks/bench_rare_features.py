"""The built-in fragile optimizer-state task, trained with each state policy side by
side: fp32 states, all 8-bit, and ``inputs`` (rare one-hot codes beside raw
measurements) kept in fp32 or bf16 with the rest in 8 bits.

Each run trains ``rare-features`` for ``--steps`` steps with the task's AdamW, its
optimizer built by ``policy.optimizer``, and prints the share of validation rows within
0.25 of the target (the task's metric), the validation MSE, the largest
``|inputs.weight|`` (fp32 keeps it under 0.5; collapsed 8-bit second moments blow it up)
and the optimizer state's bytes as stored. One process: torchao's 8-bit step compiles
once (minutes on a loaded CPU) and the later runs reuse it.

    python benchmarks/bench_rare_features.py [--steps 200] [--seeds 0,1]
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F

from autoprec.optim.state import OptimizerStates, StateGroup, optimizer_state_nbytes
from autoprec.policy import Policy
from autoprec.tasks import load_task

POLICIES = {
    "fp32": OptimizerStates(),
    "8bit": OptimizerStates("8bit"),
    "inputs-fp32": OptimizerStates(
        "8bit", groups=(StateGroup(patterns=("inputs",), state="fp32", name="inputs"),)
    ),
    "inputs-bf16": OptimizerStates(
        "8bit", groups=(StateGroup(patterns=("inputs",), state="bf16", name="inputs"),)
    ),
}


def run(states: OptimizerStates, seed: int, steps: int) -> str:
    task = load_task("rare-features")
    torch.manual_seed(seed)
    model = task.model()
    optimizer = Policy(optimizer_states=states).optimizer(model, task.optimizer)
    batches = task.train_data(seed)
    for _ in range(steps):
        x, y = next(batches)
        loss = task.loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        pairs = [(model(x), y) for x, y in task.val_data()]
    outputs = torch.cat([o for o, _ in pairs])
    targets = torch.cat([t for _, t in pairs])
    return (
        f"{task.metric(outputs, targets):.3f} | {F.mse_loss(outputs, targets).item():.4f} | "
        f"{model.inputs.weight.abs().max().item():.3g} | "
        f"{optimizer_state_nbytes(optimizer) / 2**20:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    print("| states | seed | within 0.25 | val MSE | max abs inputs.weight | state MB |")
    print("|---|---|---|---|---|---|")
    for name, states in POLICIES.items():
        for seed in (int(s) for s in args.seeds.split(",")):
            print(f"| {name} | {seed} | {run(states, seed, args.steps)} |", flush=True)


if __name__ == "__main__":
    main()
