"""The search's last word: what the chosen policy gains over fp32, in one line.

A speed claim is only as good as its timing. Trials are timed one after another on a
machine whose load changes, so only the side-by-side re-timing (``--confirm-top``) makes
two policies' times comparable: every speed figure here says which timing it is from.
When fp32 itself is chosen, the line says why (the preference, the device) and how close
the best low-precision policy came.
"""

from __future__ import annotations

from typing import Any

from autoprec.report.states_words import states_words
from autoprec.selection import TIME_TIE
from autoprec.study.summary_schema import CONFIRMED_TIME, Entry, Summary, as_summary

DEVICE_WORDS = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}
TIME_PREFERENCES = ("speed", "latency", "throughput")


def speed_words(speedup: float) -> str:
    """A time ratio (fp32's over this one) as people say it: ``1.90x faster``, ``1.60x slower``."""
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


def gains_line(summary: Summary | dict[str, Any]) -> str:
    """E.g. ``best: trial 7 - 1.90x faster side by side with fp32, 48% less memory,
    accuracy -0.2 pt vs fp32``; or, where fp32 is chosen, why and who came closest."""
    summary = as_summary(summary)
    best = summary.best
    if best.is_baseline:
        return "best: the fp32 baseline - " + _why_fp32(summary)
    saving = best.memory_saving_vs_fp32 or 0.0
    memory = f"{abs(saving) * 100:.0f}% {'less' if saving >= 0 else 'more'} memory"
    accuracy = f"accuracy {_change_pt(best)} pt vs fp32"
    speed = speed_words(best.speedup_vs_fp32 or 1.0) + _at_batch(summary)
    states = states_words(summary)
    states = f"; {states}" if states else ""
    if summary.retimed(best):
        return f"best: {best.name} - {speed} side by side with fp32, {memory}, {accuracy}{states}"
    return (
        f"best: {best.name} - {memory}, {accuracy}; speed not re-timed side by side with fp32 "
        f"({_why_not_retimed(summary)}): {speed} in the trials' own timing{states}"
    )


def closest_entry(summary: Summary | dict[str, Any]) -> Entry | None:
    """The low-precision policy the gains line names as "the closest" when fp32 is
    chosen (None when it names none), so that the table beside it can show it: the most
    accurate when none was feasible, else the lightest (``--prefer memory``), else the
    fastest against fp32 (re-timed side by side where any was)."""
    summary = as_summary(summary)
    if not summary.best.is_baseline:
        return None
    trials = [t for t in summary.trials if t.complete and t.metrics]
    feasible = [t for t in trials if t.feasible]
    if not trials:
        return None
    if not feasible:
        return max(trials, key=lambda t: _or(t.accuracy, float("-inf")))
    if summary.prefer == "memory":
        return min(feasible, key=lambda t: _or(t.peak_memory_mb, float("inf")))
    retimed = [t for t in feasible if summary.retimed(t)]
    return max(retimed or feasible, key=lambda t: _speedup(summary, t))


def _why_fp32(summary: Summary) -> str:
    """Why no low-precision policy was chosen, and the closest one's figures."""
    trials = [t for t in summary.trials if t.complete and t.metrics]
    feasible = [t for t in trials if t.feasible]
    closest = closest_entry(summary)
    if closest is None:
        return _none_finished(summary.trials)
    if not feasible:
        return (
            f"no low-precision policy kept accuracy within {summary.accuracy_tolerance:g} "
            f"of fp32's; the closest, {closest.name}, changed it by {_change_pt(closest)} pt"
        )
    if summary.prefer == "memory":
        more = _or(closest.peak_memory_mb, 0.0) / _or(summary.baseline.peak_memory_mb, 1.0) - 1
        return (
            "it uses the least memory (--prefer memory): no feasible low-precision policy "
            f"used less; the closest, {closest.name}, used {more:.0%} more"
        )
    return _why_fp32_on_time(summary, feasible, closest)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _none_finished(trials: list[Entry]) -> str:
    """No low-precision trial finished: how many ended how, and the first one's reason."""
    if not trials:
        return "no low-precision policy was tried"
    states: dict[str, int] = {}
    for t in trials:
        states[t.state] = states.get(t.state, 0) + 1
    counts = ", ".join(f"{n} {state}" for state, n in states.items())
    first = trials[0]
    reason = f": {first.reason}" if first.reason else ""
    return f"no low-precision trial finished ({counts}); {first.name} was {first.state}{reason}"


def _why_fp32_on_time(summary: Summary, feasible: list[Entry], closest: Entry) -> str:
    """fp32 chosen for its time (or time and memory): against the re-timing where there
    is one, else the trials' own timing, said as such."""
    retimed = [t for t in feasible if summary.retimed(t)]
    speedup = _speedup(summary, closest)
    timing = "side by side" if retimed else "in the trials' own timing"
    caveat = "" if retimed else f" (not re-timed side by side: {_why_not_retimed(summary)})"
    device = _device(summary)
    if summary.prefer not in TIME_PREFERENCES:
        head = f"fp32 scores best on time and memory together on this {device}"
    elif speedup > 1:
        head = (
            f"fp32 is as fast as any policy on this {device} (within {TIME_TIE:.0%}, a tie "
            "that goes to less memory)"
        )
    else:
        head = f"fp32 is fastest on this {device}: no low-precision policy was faster {timing}"
    return (
        f"{head}{caveat}; the closest, {closest.name}, was {speed_words(speedup)}"
        f"{_at_batch(summary)}, accuracy {_change_pt(closest)} pt"
    )


def _speedup(summary: Summary, entry: Entry) -> float:
    """fp32's time over the entry's, both re-timed side by side where the entry was."""
    key = CONFIRMED_TIME if summary.retimed(entry) else summary.time_metric
    return summary.baseline.metrics[key] / entry.metrics[key]


def _why_not_retimed(summary: Summary) -> str:
    if summary.prefer == "memory":
        return "--prefer memory re-times nothing"
    if summary.interrupted:
        return "the search was interrupted before"
    if summary.settings.confirm_top == 0:
        return "--confirm-top 0"
    return "this policy was not among the fastest re-timed"


def _at_batch(summary: Summary) -> str:
    """Serving speeds are latencies at the batch size served."""
    size = summary.batch_size
    return "" if size is None else f" at batch {size}"


def _device(summary: Summary) -> str:
    kind = summary.settings.device
    return DEVICE_WORDS.get(kind.split(":")[0], kind)


def _change_pt(entry: Entry) -> str:
    drop_pt = 100.0 * _or(entry.accuracy_drop, 0.0)
    return f"{-drop_pt + 0.0:+.1f}"  # + 0.0: no "-0.0"
