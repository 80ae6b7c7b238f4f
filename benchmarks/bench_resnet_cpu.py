"""Profile plus a 20-trial guided search of a 150-module ResNet on the CPU.

Run by hand: ``python benchmarks/bench_resnet_cpu.py [--trials 20] [--steps 30]``.
On fresh sqlite stores in a temporary folder: ``autoprec profile`` of the built-in
digits-resnet (ResNet-50-style bottleneck layout, 150 modules), then
``autoprec search`` with the default guided sampler and the default (automatic)
space. Target (issue 4): both together under 10 minutes on the CPU with a small
budget, ending with a feasible policy.
"""

from __future__ import annotations

import argparse
import time

from _fresh import fresh_folder

import autoprec
from autoprec.tasks import load_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    # On this CPU fp32 is the fastest dtype, so --prefer speed honestly returns fp32.
    parser.add_argument("--prefer", default="memory", choices=("speed", "memory", "balanced"))
    args = parser.parse_args()
    task = load_task("digits-resnet")
    modules = len(list(task.model().named_modules()))
    with fresh_folder():
        started = time.perf_counter()
        profile = autoprec.profile_task(task, "cpu")
        profile_s = time.perf_counter() - started
        mark = time.perf_counter()
        result = autoprec.search(
            task,
            trials=args.trials,
            steps=args.steps,
            device="cpu",
            study="resnet",
            prefer=args.prefer,
        )
        search_s = time.perf_counter() - mark
    summary = result.summary
    best = summary["best"]
    groups = [k for k in summary["trials"][0]["params"] if k.startswith("dtype.")]
    phases = {}
    for trial in summary["trials"]:
        phase = "anchor" if trial["anchor"] else trial["guided"] or "tpe"
        phases[phase] = phases.get(phase, 0) + 1
    print(f"digits-resnet: {modules} modules, {len(groups)} groups: {', '.join(groups)}")
    top = profile.modules[0]
    print(f"profile: {profile_s:.1f} s; riskiest: {top.name} ({top.reason})")
    count = len(summary["trials"])
    print(f"search: {search_s:.1f} s for {count} trials x {args.steps} steps {phases}")
    feasible = sum(t["feasible"] for t in summary["trials"])
    print(f"feasible trials: {feasible} of {count}; --prefer {args.prefer}")
    print(f"total:  {(profile_s + search_s) / 60:.1f} min (target: under 10)")
    metrics = best["metrics"]
    print(
        f"best: trial {best['trial']}, feasible={best['feasible']}, accuracy "
        f"{metrics['accuracy']:.3f} (fp32 {summary['baseline']['metrics']['accuracy']:.3f}), "
        f"{metrics['low_precision_share']:.0%} of parameters in low precision, "
        f"{best['speedup_vs_fp32']:.2f}x fp32 speed, {best['memory_saving_vs_fp32']:.0%} "
        "less memory"
    )


if __name__ == "__main__":
    main()
