"""The real-models device check: a guided search of the built-in tiny-gpt2 task on a GPU
(or an Ascend NPU), then its figures: the profile, the fitted groups, the anchors and
the chosen policy against fp32.

    python benchmarks/gpu_tiny_gpt2.py [--device cuda] [--trials 12] [--steps 150]

Needs transformers (pip install -e '.[hf]'). It runs on the CPU as a dry run
(``--device cpu --trials 4 --steps 30``); on a GPU it checks what the CPU cannot:
LayerNorm stays fp32 under CUDA autocast (not searched), bf16 and fp16 have kernels, and
the allocator's peak memory. Everything runs in a fresh folder (fresh sqlite stores).
"""

from __future__ import annotations

import argparse
import time

from _fresh import fresh_folder

import autoprec

METRICS = ("accuracy", "step_time_ms", "peak_memory_mb")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prefer", default="speed")
    args = parser.parse_args()
    with fresh_folder():
        started = time.perf_counter()
        result = autoprec.search(
            "tiny-gpt2",
            trials=args.trials,
            steps=args.steps,
            device=args.device,
            prefer=args.prefer,
        )
        wall_s = time.perf_counter() - started
    summary = result.summary
    device = summary["settings"]["device_name"]
    print(f"device {device}, {wall_s:.0f} s, phases {summary['phase_time_s']}")
    print("profile, riskiest:", [(p["module"], p["risk"]) for p in summary["profile"][:3]])
    groups = [k.removeprefix("dtype.") for k in summary["trials"][0]["params"] if "dtype." in k]
    print("groups:", groups)
    base = summary["baseline"]["metrics"]
    print(f"{'trial':>10} {'state':>9} {'accuracy':>9} {'step ms':>8} {'memory MB':>10}  policy")
    for entry in [summary["baseline"], *summary["trials"]]:
        m = {k: entry["metrics"].get(k, float("nan")) for k in METRICS}
        label = entry.get("anchor") or entry.get("guided") or ""
        print(
            f"{entry['number']!s:>10} {entry['state']:>9} {m['accuracy']:9.4f} "
            f"{m['step_time_ms']:8.2f} {m['peak_memory_mb']:10.1f}  {label}"
        )
    best = summary["best"]
    print(
        f"best: trial {best['number']}, {best['speedup_vs_fp32']:.2f}x the fp32 step time, "
        f"{best['memory_saving_vs_fp32']:.0%} less memory, accuracy "
        f"{best['metrics']['accuracy']:.4f} against fp32 {base['accuracy']:.4f}"
    )


if __name__ == "__main__":
    main()
