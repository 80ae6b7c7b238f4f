"""Search time on a fragile task with early stopping against the same search without it.

Run by hand: ``python benchmarks/bench_early_stopping.py [--trials 20] [--steps 60]``.
Both searches use the same seed, sampler, space and fresh sqlite stores, one after the
other in this process, after a throwaway search that pays the process's one-time costs
(imports, first store creation) so that neither side is charged for them. The sampler
is random: its proposals do not depend on earlier results, so both searches measure the
same policies and differ only by early stopping (a model-based sampler would also react
to the pruned trials, and the two searches would wander apart). Target: at least 30%
less time with early stopping, and the same best policy.
"""

from __future__ import annotations

import argparse
import time

from _fresh import fresh_folder

import autoprec


def run(task: str, trials: int, steps: int, early_stopping: bool, prefer: str) -> dict:
    with fresh_folder():
        started = time.perf_counter()
        result = autoprec.search(
            task,
            trials=trials,
            steps=steps,
            device="cpu",
            prefer=prefer,
            early_stopping=early_stopping,
            sampler="random",
        )
        wall_s = time.perf_counter() - started
    summary = result.summary
    states = [t["state"] for t in summary["trials"]]
    return {
        "wall_s": wall_s,
        "trial_s": summary["trial_time_s"],
        "pruned": states.count("pruned"),
        "best": summary["best"]["number"],
        "best_params": summary["best"]["params"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["digits-overflow", "digits-underflow"])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prefer", default="memory")
    args = parser.parse_args()
    print(
        f"{args.trials} trials x {args.steps} steps, --prefer {args.prefer}, CPU, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{'task':<18} {'early stop':<10} {'wall s':>8} {'trials s':>9} {'pruned':>7} "
        f"{'best':>5}  best policy"
    )
    run(args.tasks[0], 2, 10, True, args.prefer)  # warm-up, discarded
    for task in args.tasks:
        rows = {
            flag: run(task, args.trials, args.steps, flag, args.prefer) for flag in (False, True)
        }
        for flag, r in rows.items():
            label = " ".join(
                f"{k.removeprefix('dtype.')}={v}"
                for k, v in r["best_params"].items()
                if k.startswith("dtype.")
            )
            print(
                f"{task:<18} {'on' if flag else 'off':<10} {r['wall_s']:>8.1f} "
                f"{r['trial_s']:>9.1f} {r['pruned']:>7} {r['best']!s:>5}  {label}"
            )
        saving = 1 - rows[True]["wall_s"] / rows[False]["wall_s"]
        same = rows[True]["best_params"] == rows[False]["best_params"]
        print(f"{task:<18} time saved {saving:.0%}; same best policy: {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
