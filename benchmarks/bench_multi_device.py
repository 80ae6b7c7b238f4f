"""Step time and per-rank peak memory of a trial at 1 rank against 2 ranks, in one run.

Run by hand: ``python benchmarks/bench_multi_device.py [--task digits-mlp] [--steps 60]
[--rounds 2] [--threads 1] [--device cpu]``. Each configuration is one launch of the
real torchrun, as ``autoprec search --nproc-per-trial N`` launches a trial
(`autoprec.distributed.launch`): 1 rank (DDP over a world of one), 2 ranks under DDP, 2
ranks under FSDP2, each on the same task, policy and global batch. The configurations
alternate round after round, so that the shared machine's drift reaches all of them
alike; the medians are printed side by side, with each rank's own step time and peak
memory. Every rank gets ``--threads`` CPU threads (default 1): on a loaded machine one
process with 2 threads can be slower than two with 1 each, for OpenMP's spinning
threads, not for anything of the launch.

What 2 CPU cores can show: that a trial spans ranks (gloo), the per-rank split of the
global batch (activations per rank), what FSDP2's sharding does to a rank's share of
the parameters, gradients and optimizer state (CPU memory is autoprec's estimate, not an
allocator's), and what the collectives cost on top of compute. What they cannot show:
a speed-up worth the name. At one thread a rank, 2 ranks do half the batch each on
twice the cores, but share the memory bandwidth and 8 engineers' load, and pay gloo's
all-reduce over loopback. Nothing of nccl,
hccl, an interconnect's bandwidth, a bf16 ``reduce_dtype``'s saving, device memory, or 8
devices is measured on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from autoprec import Policy
from autoprec.distributed.launch import BACKENDS, LaunchPlan, launch, read_result
from autoprec.trials.training import Budget, TrialResult

CONFIGS = ((1, "ddp"), (2, "ddp"), (2, "fsdp2"))


def run_once(
    task: str,
    policy: Policy,
    budget: Budget,
    nproc: int,
    parallel: str,
    device: str,
    threads: int,
    folder: Path,
) -> dict:
    kind = device.split(":")[0]
    group = ["cpu"] * nproc if kind == "cpu" else [f"{kind}:{i}" for i in range(nproc)]
    plan = LaunchPlan(
        nproc=nproc,
        parallel=parallel,
        backend=BACKENDS[kind],
        group=group,
        task_spec=task,
        folder=folder,
        limit_s=900.0,
        threads=threads,
        budget=asdict(budget),
    )
    outcome = launch(plan.spec(policy), nproc, folder, plan.limit_s, plan.environment())
    if not outcome.result_path.is_file():
        sys.exit(f"{nproc} ranks, {parallel}: {outcome.reason(plan.limit_s, nproc)}")
    result = read_result(outcome.result_path, TrialResult)
    if result.state != "complete":
        sys.exit(f"{nproc} ranks, {parallel}: {result.state} ({result.reason})")
    ranks = result.telemetry["distributed"]["ranks"]
    return {
        "step_ms": result.step_time_ms,
        "rank_step_ms": [r["step_time_ms"] for r in ranks],
        "rank_peak_mb": [r["peak_memory_mb"] for r in ranks],
        "launch_s": outcome.elapsed_s,
        "estimate": result.peak_memory_is_estimate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits-mlp")
    parser.add_argument("--policy", default="fp32", help="a uniform dtype")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu (its first 2)")
    args = parser.parse_args()
    policy = Policy.uniform(args.policy)
    budget = Budget(steps=args.steps)
    runs: dict[tuple[int, str], list[dict]] = {config: [] for config in CONFIGS}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for nproc, parallel in CONFIGS:
                where = Path(folder) / f"{round_}-{nproc}-{parallel}"
                runs[(nproc, parallel)].append(
                    run_once(
                        args.task, policy, budget, nproc, parallel, args.device, args.threads, where
                    )
                )
    print(
        f"{args.task}, uniform {args.policy}, {args.steps} steps, {args.rounds} rounds "
        f"alternating, {args.device} ({os.cpu_count()} cores, {args.threads} thread(s) a rank), "
        f"torch {torch.__version__}"
    )
    print(
        f"{'ranks':>5} {'parallel':>8} {'step ms':>9} {'vs 1':>6} {'per-rank step ms':>20} "
        f"{'per-rank peak MB':>20} {'launch s':>9}"
    )
    base = statistics.median(r["step_ms"] for r in runs[CONFIGS[0]])
    for (nproc, parallel), done in runs.items():
        step = statistics.median(r["step_ms"] for r in done)
        rank_steps = [statistics.median(r["rank_step_ms"][i] for r in done) for i in range(nproc)]
        rank_peaks = [max(r["rank_peak_mb"][i] for r in done) for i in range(nproc)]
        launch_s = statistics.median(r["launch_s"] for r in done)
        print(
            f"{nproc:>5} {parallel:>8} {step:>9.3f} {step / base:>5.2f}x "
            f"{' / '.join(f'{t:.3f}' for t in rank_steps):>20} "
            f"{' / '.join(f'{m:.3f}' for m in rank_peaks):>20} {launch_s:>9.1f}"
        )
    estimate = any(r["estimate"] for done in runs.values() for r in done)
    print(
        "step ms: the slowest rank's median step; peak MB: each rank's own"
        + (
            " (CPU: autoprec's estimate of parameters, gradients, optimizer state and saved"
            " activations)"
            if estimate
            else ""
        )
    )


if __name__ == "__main__":
    main()
