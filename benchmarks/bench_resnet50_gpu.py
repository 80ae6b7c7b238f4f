"""Profile plus a guided search of torchvision's ResNet-50 on synthetic data, then fp32,
uniform fp16, uniform bf16 and the best policy found, side by side.

Issue 4's device check, for a machine with a GPU (or an Ascend NPU) and torchvision:

    python benchmarks/bench_resnet50_gpu.py [--device cuda] [--trials 20] [--steps 40]
        [--batch 64] [--image 128]

The same code path runs on the CPU with the package's own ResNet-50-style network in
place of torchvision's (no torchvision needed), as a dry run:

    python benchmarks/bench_resnet50_gpu.py --device cpu --model digits-resnet \\
        --trials 6 --steps 12

The data: ten fixed random "prototype" images, one per class, each sample a prototype
plus as much Gaussian noise; a pool of batches is made once, so that making data costs
nothing in the timed steps. Everything runs in a fresh folder (fresh sqlite stores).
Step times in the table are the trials' own and, in the last columns, those of the
four policies timed again in alternating blocks (the fair comparison); peak memory is
the allocator's peak during each trial.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from _fresh import fresh_folder

import autoprec
from autoprec.devices import get_backend
from autoprec.tasks import Task, load_task
from autoprec.trials.training import Budget, time_policies_side_by_side

CLASSES = 10
POOL_BATCHES = 16


def resnet50_task(batch: int, image: int) -> Task:
    """torchvision's ResNet-50 (imported here: it is not installed beside the CPU wheel)
    on class prototypes plus noise, ``batch`` images of ``image`` x ``image`` pixels."""
    from torchvision.models import resnet50

    generator = torch.Generator().manual_seed(1234)
    prototypes = torch.randn(CLASSES, 3, image, image, generator=generator)

    def pool(seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        batches = []
        for _ in range(count):
            labels = torch.randint(0, CLASSES, (batch,), generator=g)
            noise = torch.randn(batch, 3, image, image, generator=g)
            batches.append((prototypes[labels] + noise, labels))
        return batches

    def train_data(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return itertools.cycle(pool(seed, POOL_BATCHES))

    def val_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return pool(10_000, 4)

    return Task(
        "resnet50-synthetic",
        lambda: resnet50(num_classes=CLASSES),
        train_data,
        val_data,
        F.cross_entropy,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "digits-resnet"))
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--image", type=int, default=128)
    parser.add_argument("--prefer", default="speed", choices=("speed", "memory", "balanced"))
    args = parser.parse_args()

    backend = get_backend(args.device)
    if args.model == "resnet50":
        task = resnet50_task(args.batch, args.image)
    else:
        task = load_task("digits-resnet")
    modules = len(list(task.model().named_modules()))
    print(f"{task.name}: {modules} modules on {backend.name}, torch {torch.__version__}")
    with fresh_folder():
        started = time.perf_counter()
        profile = autoprec.profile_task(task, backend)
        profile_s = time.perf_counter() - started
        print(f"profile: {profile_s:.1f} s; top 3:")
        for m in profile.modules[:3]:
            print(f"  {m.rank}. {m.name}  risk {m.risk:.3g}  {m.reason}")
        mark = time.perf_counter()
        result = autoprec.search(
            task,
            trials=args.trials,
            steps=args.steps,
            device=backend,
            study="resnet50",
            prefer=args.prefer,
        )
        search_s = time.perf_counter() - mark
    summary = result.summary
    count = len(summary["trials"])
    feasible = sum(t["feasible"] for t in summary["trials"])
    print(f"search: {search_s:.1f} s, {count} trials x {args.steps} steps, {feasible} feasible")

    anchors = {t["anchor"]: t for t in summary["trials"] if t["anchor"]}
    rows = [("fp32", summary["baseline"])]
    for name, anchor in (("fp16", "uniform-fp16"), ("bf16", "uniform-bf16")):
        if anchor in anchors:
            rows.append((name, anchors[anchor]))
        else:  # the device does not run that dtype, or the budget ended first
            print(f"{name}: not measured in this search")
    best_trial = summary["best"]["trial"]
    if best_trial == "baseline":
        print("best: the fp32 baseline (no feasible policy was faster)")
    else:
        rows.append((f"best (trial {best_trial})", summary["best"]))
    policies = [autoprec.Policy.from_dict(entry["policy"]) for _, entry in rows]
    times_ms = time_policies_side_by_side(task, policies, backend, Budget(steps=args.steps, seed=0))

    base = rows[0][1]["metrics"]
    print(
        f"{'policy':<16} {'state':<9} {'accuracy':>8} {'step ms':>8} {'peak MB':>9} "
        f"{'memory':>7} {'side-by-side ms':>15} {'speed':>6}"
    )
    for (name, entry), side_ms in zip(rows, times_ms, strict=True):
        m = entry["metrics"]
        accuracy = f"{m['accuracy']:.3f}" if "accuracy" in m else "-"
        step = f"{m['step_time_ms']:.1f}" if "step_time_ms" in m else "-"
        peak = m.get("peak_memory_mb")
        memory = f"{peak / base['peak_memory_mb']:.2f}x" if peak else "-"
        print(
            f"{name:<16} {entry['state']:<9} {accuracy:>8} {step:>8} "
            f"{(f'{peak:.0f}' if peak else '-'):>9} {memory:>7} {side_ms:>15.1f} "
            f"{times_ms[0] / side_ms:>5.2f}x"
        )
    layers = [row for row in summary["best"]["layers"] if row["params"]]
    kept = [row["name"] for row in layers if row["dtype"] == "fp32"]
    print(
        f"best: {len(kept)} of {len(layers)} layers with parameters kept in fp32"
        + (f" ({', '.join(kept[:6])}{', ...' if len(kept) > 6 else ''})" if kept else "")
    )
    # The search profiles the model again for its own study (it keeps the profile there).
    print(f"total: {(profile_s + search_s) / 60:.1f} min for the profile and the search")


if __name__ == "__main__":
    main()
