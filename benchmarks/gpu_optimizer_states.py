"""Optimizer states on a GPU: GPT-2-small-shaped training at 8 x 1024 tokens with Adam's
states in fp32, 8 bits, 4 bits and fp8 (torchao's AdamW8bit, AdamW4bit, AdamWFp8) and a
searched (or given) per-group policy, side by side: peak memory, step time, loss.

Issue 30's prepared device check, for a CUDA GPU:

    python benchmarks/gpu_optimizer_states.py                          # fp32 / 8bit / 4bit / fp8
    python benchmarks/gpu_optimizer_states.py --policy best_policy.yaml  # and a searched policy
    python benchmarks/gpu_optimizer_states.py --smoke                  # tiny, on the CPU

- The model and data are `gpu_fp8.py`'s: GPT-2 small's shape (12 layers, d_model 768,
  vocabulary 50257, untied head), the induction language, bf16 autocast over the whole
  model, AdamW (lr 3e-4). Every optimizer is built by ``policy.optimizer``; the states of
  tensors under 4,096 elements stay fp32, as torchao keeps them.
- Each variant runs in turn from the same weights on the same batches: ``--warmup`` steps
  (torchao compiles its step on the first; that time is printed apart), then ``--steps``
  timed steps; peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps,
  and the optimizer state's bytes are counted from its tensors as stored.
- Expected from the bytes alone (124M parameters): fp32 states 0.99 GB, 8-bit about
  0.25 GB, 4-bit about 0.13 GB; the step times are what this script is for.
- ``--smoke`` ran on the CPU (2 shared cores, heavily loaded, 2026-12-01): fp32 and 8-bit,
  one warm-up step each; 8-bit's warm-up (torchao compiling the step for each parameter
  shape) took 173 s there.

Refused in one line, exit status 2, without CUDA (``--smoke`` aside, whose CPU figures
mean nothing). Never run on a GPU: no device was lent to the session that wrote it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_fp8 import GPT, GPT2_SMALL, SMOKE, batches, lm_loss

from autoprec.optim.state import OptimizerStates, optimizer_state_nbytes
from autoprec.policy import Policy, load_policy

UNIFORM = ("fp32", "8bit", "4bit", "fp8")
LEARNING_RATE = 3e-4


def run(
    name: str, policy: Policy, shape: object, data: list, device: torch.device, warmup: int
) -> dict[str, float | str]:
    torch.manual_seed(0)
    model = GPT(shape).to(device)  # type: ignore[arg-type]
    optimizer = policy.optimizer(model, torch.optim.AdamW, lr=LEARNING_RATE)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return float(loss)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    started = time.perf_counter()
    for x, y in data[:warmup]:
        step(x.to(device), y.to(device))
    sync()
    warmup_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for x, y in data[warmup:]:
        x, y = x.to(device), y.to(device)
        sync()
        started = time.perf_counter()
        losses.append(step(x, y))
        sync()
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {
        "policy": name,
        "state_mb": optimizer_state_nbytes(optimizer) / 2**20,
        "peak_gb": peak,
        "step_ms": statistics.median(times) * 1000,
        "warmup_s": warmup_s,
        "final_loss": losses[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", help="a policy YAML (its optimizer section) to time too")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (the compile)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument(
        "--kinds", default=",".join(UNIFORM), help="uniform state kinds to time (first: the base)"
    )
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_optimizer_states.py: needs a CUDA GPU (or --smoke on the CPU)", file=sys.stderr)
        return 2
    policy = None
    if args.policy:
        try:
            policy = load_policy(args.policy)
        except Exception as error:  # one line, as the CLI says it
            print(f"gpu_optimizer_states.py: {error}", file=sys.stderr)
            return 2
    warnings.filterwarnings("ignore")
    shape = SMOKE if args.smoke else GPT2_SMALL
    device = torch.device("cpu" if args.smoke else "cuda")
    data = batches(shape, seed=1, count=args.warmup + args.steps)
    kinds = args.kinds.split(",")
    variants = [(f"uniform-{k}", Policy(optimizer_states=OptimizerStates(k))) for k in kinds]
    if policy is not None:
        variants.append((policy.name or Path(args.policy).stem, policy))
    rows = [run(name, p, shape, data, device, args.warmup) for name, p in variants]
    base = rows[0]
    print(f"{'smoke, CPU: figures mean nothing' if args.smoke else torch.cuda.get_device_name()}")
    print("| policy | state MB | peak GB | peak vs fp32 | step ms | vs fp32 | warm-up s | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['policy']} | {row['state_mb']:.2f} | {row['peak_gb']:.2f} | "
            f"{float(row['peak_gb']) / float(base['peak_gb']):.2f} | {row['step_ms']:.1f} | "
            f"{float(row['step_ms']) / float(base['step_ms']):.2f} | {row['warmup_s']:.1f} | "
            f"{row['final_loss']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
