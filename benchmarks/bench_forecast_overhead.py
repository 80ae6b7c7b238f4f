"""The range forecast's extra cost per trial (issue 21) against the trial's step time.

Run by hand: ``python benchmarks/bench_forecast_overhead.py [--steps 200] [--rounds 7]``.
One model per task trains under a uniform fp16 policy, on pre-drawn batches. In each
round, side by side: a block of plain steps (what a trial times), a block of observed
steps with the telemetry as it was before the forecast (``GradientMonitor(ranges=False)``)
and a block with the range series (``ranges=True``, the default). The forecast's extra
cost per trial is (observed step with ranges - without) x the observed steps of a trial
(one in ``TELEMETRY_EVERY``), plus the fit of every layer's series at its end
(`autoprec.numerics.forecast.forecast`, timed on the series the run recorded). It is shown
against the trial's training time, plain step x steps. Target: at most 5%.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autoprec import Policy
from autoprec.devices import get_backend
from autoprec.numerics.forecast import forecast
from autoprec.numerics.telemetry import GradientMonitor
from autoprec.tasks import load_task
from autoprec.trials.training import TELEMETRY_EVERY, train_step

BLOCK = 10  # steps per block and arm


def bench(name: str, steps: int, rounds: int) -> dict[str, float]:
    backend = get_backend("cpu")
    task = load_task(name)
    torch.manual_seed(0)
    model = task.model()
    optimizer = task.make_optimizer(model.parameters())
    prec = Policy.uniform("fp16").apply(model, backend)
    data = iter(task.train_data(0))
    batches = [[task.batch(next(data))] for _ in range(BLOCK)]
    monitors = {False: GradientMonitor(model, ranges=False), True: GradientMonitor(model)}
    times_ms: dict[str, list[float]] = {"plain": [], "without": [], "with": []}

    def block(arm: str, monitor: GradientMonitor | None) -> None:
        for index, step_batches in enumerate(batches):
            started = time.perf_counter()
            if monitor is None:
                train_step(task, model, optimizer, prec, step_batches)
            else:
                scale = prec.loss_scale
                with monitor.activations(len(times_ms[arm]) * TELEMETRY_EVERY + index):
                    train_step(task, model, optimizer, prec, step_batches)
                monitor.observe_gradients(scale)
                monitor.stats  # noqa: B018 - the host transfer a trial makes
            times_ms[arm].append(1000 * (time.perf_counter() - started))

    try:
        block("plain", None)  # warm-up, discarded
        for key in times_ms:
            times_ms[key].clear()
        for _ in range(rounds):
            block("plain", None)
            block("without", monitors[False])
            block("with", monitors[True])
    finally:
        prec.remove()
    series = monitors[True].ranges
    assert series is not None
    # A trial's series: one point per observed step, as many as the trial observes.
    observed = steps // TELEMETRY_EVERY
    for layer in series.steps:
        series.steps[layer] = [i * TELEMETRY_EVERY for i in range(observed)]
        series.act_max[layer] = (series.act_max[layer] * observed)[:observed]
    for layer in series.grad_steps:
        series.grad_steps[layer] = [i * TELEMETRY_EVERY for i in range(observed)]
        series.grad_max[layer] = (series.grad_max[layer] * observed)[:observed]
        series.grad_low[layer] = (series.grad_low[layer] * observed)[:observed]
    fits_ms = []
    for _ in range(5):
        started = time.perf_counter()
        forecast(series, 10 * steps, steps)
        fits_ms.append(1000 * (time.perf_counter() - started))
    plain, without, with_ranges = (statistics.median(times_ms[k]) for k in times_ms)
    fit_ms = statistics.median(fits_ms)
    extra_ms = (with_ranges - without) * observed + fit_ms
    trial_ms = plain * steps
    return {
        "layers": len(series.steps),
        "plain_ms": plain,
        "observed_without_ms": without,
        "observed_with_ms": with_ranges,
        "fit_ms": fit_ms,
        "extra_per_trial_ms": extra_ms,
        "trial_ms": trial_ms,
        "share": extra_ms / trial_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per trial")
    parser.add_argument("--rounds", type=int, default=7, help="side-by-side rounds")
    parser.add_argument("--tasks", nargs="+", default=["digits-mlp", "late-overflow", "digits-cnn"])
    args = parser.parse_args()
    print(
        "| task | layers | step ms | observed ms, without / with ranges | fit ms "
        "| extra per trial ms | trial ms | share |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.tasks:
        r = bench(name, args.steps, args.rounds)
        print(
            f"| {name} | {r['layers']} | {r['plain_ms']:.3f} | {r['observed_without_ms']:.3f} / "
            f"{r['observed_with_ms']:.3f} | {r['fit_ms']:.2f} | {r['extra_per_trial_ms']:.1f} "
            f"| {r['trial_ms']:.0f} | {r['share']:.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
