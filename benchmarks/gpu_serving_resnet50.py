"""Issue 13's GPU check: which precision serves a ResNet-50 fastest at batch 1, and at 128?

For a machine with a GPU (or an Ascend NPU) and torchvision:

    python benchmarks/gpu_serving_resnet50.py [--device cuda] [--trials 16] [--steps 30]
        [--batch-sizes 1,128] [--image 128] [--rounds 10] [--out DIR]

The issue expects, on an H200: fp32 or TF32 fastest at batch 1 (kernel launches dominate;
measured with torch 2.11: fp32 3.30 ms, bf16 4.23 ms, fp16 4.45 ms) and fp16 or bf16 at
batch 128. This script prints what it measures, whatever that is.

What it does, in a fresh folder: torchvision's ResNet-50 (imported lazily, as
bench_resnet50_gpu.py does, on the same synthetic data: class prototype images plus
noise) is trained in fp32 for ``--steps`` and kept as fp32.pt; one serving study
(scenario ``server`` at the first batch size, every trial also timed at the others)
searches per-layer fp32/fp16/bf16/int8, TF32 on CUDA. Printed: the practitioner's table
(precision, accuracy, memory, latency), the best choice at each batch size, and then,
at each batch size, fp32, fp32 with TF32 (CUDA), each feasible uniform anchor, the
study's choice and the best there, all timed side by side in alternating blocks, the
fastest named. The report (report.html and its PNGs) goes to ``--out``.

The same code path runs on the CPU with the package's ResNet-50-style network in place of
torchvision's (no torchvision needed), as a dry run:

    python benchmarks/gpu_serving_resnet50.py --device cpu --model digits-resnet \\
        --trials 6 --steps 10 --batch-sizes 1,16 --rounds 3

Not run on a GPU yet: none was lent to the session that wrote it; the CPU dry run above
ran end to end (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch
from _fresh import fresh_folder
from bench_resnet50_gpu import resnet50_task
from torch import nn

import autoprec
from autoprec.devices import Backend, get_backend
from autoprec.report import batch_size_text, benchmark_text, gains_line, render_report, text_table
from autoprec.selection import TIME_TIE
from autoprec.serving import timing_batch
from autoprec.serving.conversion import convert_policy
from autoprec.tasks import Task, load_task
from autoprec.trials.serving import time_models_side_by_side

UNIFORM = {"uniform-fp16": "fp16", "uniform-bf16": "bf16", "uniform-int8": "int8"}


class Switched(nn.Module):
    """A converted model that runs with its policy's TF32/HF32 switches set, so that
    models with different switches can alternate in one side-by-side timing."""

    def __init__(self, model: nn.Module, backend: Backend, policy: autoprec.Policy) -> None:
        super().__init__()
        self.model, self.backend, self.policy = model, backend, policy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        previous = self.backend.set_switches(self.policy.tf32, self.policy.hf32)
        try:
            return self.model(*args, **kwargs)
        finally:
            self.backend.restore_switches(previous)


def variants(summary: dict[str, Any], size: int, backend: Backend) -> dict[str, autoprec.Policy]:
    """What is timed at ``size``: fp32 (TF32 off), fp32 with TF32 on CUDA, each feasible
    uniform anchor, the study's choice and the best at that batch size; a policy already
    listed gets the second name added to its own instead of being timed twice."""
    entries = {str(e["number"]): e for e in [summary["baseline"], *summary["trials"]]}
    fp32 = autoprec.Policy.from_dict(summary["baseline"]["policy"])
    found = {"fp32": dataclasses.replace(fp32, tf32=False) if backend.kind == "cuda" else fp32}
    if backend.kind == "cuda":
        found["fp32+tf32"] = dataclasses.replace(fp32, tf32=True)
    for entry in summary["trials"]:
        if entry.get("anchor") in UNIFORM and entry["state"] == "complete" and entry["feasible"]:
            found[UNIFORM[entry["anchor"]]] = autoprec.Policy.from_dict(entry["policy"])
    extra = [(f"chosen at {summary['serving']['batch_sizes'][0]}", summary["best"])]
    extra += [
        (f"best at {size}", entries[str(row["best"])])
        for row in summary["serving"]["by_batch_size"]
        if row["batch_size"] == size and str(row["best"]) in entries
    ]
    for label, entry in extra:
        policy = autoprec.Policy.from_dict(entry["policy"])
        same = next((name for name, p in found.items() if p.to_dict() == policy.to_dict()), None)
        if same is None:
            found[f"{label} (trial {entry['number']})"] = policy
        else:
            found = {(f"{n}, {label}" if n == same else n): p for n, p in found.items()}
    return found


def side_by_side(
    task: Task, summary: dict[str, Any], backend: Backend, rounds: int
) -> dict[int, dict[str, float]]:
    """Median latency (ms) of each variant at each batch size, timed in turn."""
    model = task.model()
    path = summary["serving"]["fp32_checkpoint"]
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    int8 = summary["serving"]["int8"]
    found = {}
    for size in summary["serving"]["batch_sizes"]:
        policies = variants(summary, size, backend)
        models = [
            Switched(convert_policy(model, p, backend, int8), backend, p) for p in policies.values()
        ]
        batch = timing_batch(task, size, backend)
        times_ms = time_models_side_by_side(models, batch, backend, rounds=rounds)
        found[size] = dict(zip(policies, times_ms, strict=True))
        del models
        backend.empty_cache()
    return found


def print_side_by_side(found: dict[int, dict[str, float]]) -> None:
    """Each variant's latency and speed against fp32; then, per batch size, the fastest
    and those within the selection's time tie of it (5%: not told apart by one run)."""
    lines = [["batch", "variant", "ms", "vs fp32", ""]]
    for size, times in found.items():
        fp32 = next(ms for name, ms in times.items() if name.split(",")[0] == "fp32")
        fastest = min(times.values())
        for name, ms in times.items():
            mark = "fastest" if ms == fastest else ("tie" if ms <= fastest * (1 + TIME_TIE) else "")
            lines.append([str(size), name, f"{ms:.3f}", f"{fp32 / ms:.2f}x", mark])
    print(text_table(lines))
    for size, times in found.items():
        order = sorted(times, key=times.__getitem__)
        tied = [n for n in order[1:] if times[n] <= times[order[0]] * (1 + TIME_TIE)]
        print(
            f"batch {size}: fastest {order[0]} ({times[order[0]]:.3f} ms)"
            + (f"; within {TIME_TIE:.0%}: {', '.join(tied)}" if tied else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "digits-resnet"))
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-sizes", default="1,128")
    parser.add_argument("--train-batch", type=int, default=64)
    parser.add_argument("--image", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10, help="side-by-side rounds")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_serving_resnet50"))
    args = parser.parse_args()

    backend = get_backend(args.device)
    if args.model == "resnet50":
        task = resnet50_task(args.train_batch, args.image)
    else:
        task = load_task("digits-resnet")
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    print(f"{task.name} on {backend.name}, torch {torch.__version__}, batch sizes {sizes}")
    out = Path(args.out).resolve()
    with fresh_folder():
        started = time.perf_counter()
        summary = autoprec.search(
            task,
            study="resnet50-serving",
            mode="serving",
            scenario="server",
            batch_size=sizes[0],
            batch_sizes=args.batch_sizes,
            trials=args.trials,
            steps=args.steps,
            device=backend,
        ).summary
        print(f"search: {time.perf_counter() - started:.0f} s; {gains_line(summary)}")
        print(benchmark_text(summary))
        print(batch_size_text(summary))
        found = side_by_side(task, summary, backend, args.rounds)
    print("\nside by side, in alternating blocks:")
    print_side_by_side(found)
    files = render_report(summary, out)
    print(f"report: {files[0]}")


if __name__ == "__main__":
    main()
