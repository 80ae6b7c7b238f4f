"""Step time of a policy applied through autoprec against plain torch.autocast.

Run by hand: ``python benchmarks/bench_apply_overhead.py [--device cpu] [--steps 30]``.
The two loops train the same model on the same batches; they alternate in short
blocks so that drift of a shared machine hits both alike, and each figure is the
median over all timed steps. Target: a uniform bf16 policy costs at most 1.03x
plain autocast.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import autoprec
from autoprec.devices import get_backend
from autoprec.policy import Rule
from autoprec.tasks import load_task


def _batches(task: autoprec.Task, device: torch.device, count: int) -> list:
    data = iter(task.train_data(0))
    return [tuple(t.to(device) for t in next(data)) for _ in range(count)]


def _time_block(step, batches, backend) -> list[float]:
    times = []
    for x, y in batches:
        start = backend.now_s()
        step(x, y)
        times.append(backend.now_s() - start)
    return times


def compare(
    task_name: str, policy: autoprec.Policy, backend, steps: int, rounds: int
) -> tuple[float, float]:
    task = load_task(task_name)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[policy.default]

    torch.manual_seed(0)
    plain_model = task.model().to(backend.device)
    plain_opt = torch.optim.Adam(plain_model.parameters(), lr=1e-3)

    def plain_step(x, y):
        plain_opt.zero_grad(set_to_none=True)
        with torch.autocast(backend.kind, dtype=dtype):
            out = plain_model(x)
        loss = task.loss(out.float(), y)
        loss.backward()
        plain_opt.step()

    torch.manual_seed(0)
    model = task.model().to(backend.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prec = policy.apply(model, backend)

    def autoprec_step(x, y):
        opt.zero_grad(set_to_none=True)
        with prec.autocast():
            out = model(x)
        loss = task.loss(out.float(), y)
        prec.backward(loss)
        prec.step(opt)

    batches = _batches(task, backend.device, steps)
    for step in (plain_step, autoprec_step):  # warm-up, untimed
        _time_block(step, batches[:5], backend)
    plain, ours = [], []
    for _ in range(rounds):
        plain += _time_block(plain_step, batches, backend)
        ours += _time_block(autoprec_step, batches, backend)
    return statistics.median(plain) * 1e3, statistics.median(ours) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=30, help="steps per block")
    parser.add_argument("--rounds", type=int, default=10, help="alternating blocks per loop")
    args = parser.parse_args()
    backend = get_backend(args.device)
    dtype = "bf16" if backend.supports("bf16") else "fp16"
    uniform = autoprec.Policy.uniform(dtype, loss_scale=autoprec.LossScale())
    print(f"device {backend.name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'task':<12} {'policy':<28} {'autocast ms':>12} {'autoprec ms':>12} {'ratio':>7}")
    for task_name in ("digits-mlp", "digits-cnn"):
        plain_ms, ours_ms = compare(task_name, uniform, backend, args.steps, args.rounds)
        print(
            f"{task_name:<12} {'uniform ' + dtype:<28} {plain_ms:>12.3f} {ours_ms:>12.3f} "
            f"{ours_ms / plain_ms:>7.3f}"
        )
    # For reference: the price of per-layer regions (norms kept in fp32 inside bf16).
    islands = autoprec.Policy(
        rules=(Rule("fp32", types=("_NormBase", "LayerNorm")),), default=dtype
    )
    for task_name in ("digits-mlp", "digits-cnn"):
        plain_ms, ours_ms = compare(task_name, islands, backend, args.steps, args.rounds)
        print(
            f"{task_name:<12} {dtype + ' + fp32 norms (regions)':<28} {plain_ms:>12.3f} "
            f"{ours_ms:>12.3f} {ours_ms / plain_ms:>7.3f}"
        )
    print(
        "ratio = autoprec / plain torch.autocast over the whole model (median step time);"
        " target for the uniform policy: <= 1.03"
    )


if __name__ == "__main__":
    main()
