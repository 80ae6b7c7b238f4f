"""The console's text: aligned tables and the Pareto front with the chosen policy marked
(the gains line is `autoprec.report.gains`)."""

from __future__ import annotations

from typing import Any

from autoprec.precision.emulation import emulated_mark, emulated_note
from autoprec.report.gains import closest_entry
from autoprec.report.modes import mode_text
from autoprec.space import policy_label
from autoprec.study.summary_schema import Summary, as_summary


def text_table(rows: list[list[str]]) -> str:
    """Rows of strings as left-aligned columns, the first row being the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def fmt(value: Any, spec: str) -> str:
    """A number formatted, or ``-`` where there is none."""
    return "-" if not isinstance(value, int | float) else format(value, spec)


def front_table(summary: Summary | dict[str, Any]) -> str:
    """The Pareto front (and the baseline) as an aligned text table; the best is marked."""
    summary = as_summary(summary)
    text = mode_text(summary)
    best = summary.best.key
    closest = closest_entry(summary)  # the policy the gains line names, fp32 chosen
    named = None if closest is None else closest.key
    front = [e for e in summary.entries if e.pareto or e.key in (best, named) or e.is_baseline]
    memory_label = "memory MB" + ("~" if summary.peak_memory_is_estimate else "")
    header = ["", "trial", "accuracy", "drop", text.time_column, memory_label, "feasible"]
    lines = [[*header, "policy"]]
    for e in front:
        lines.append(
            [
                "*" if e.key == best else "",
                e.key,
                fmt(e.accuracy, ".4f"),
                fmt(e.accuracy_drop, "+.4f"),
                fmt(summary.time_ms(e), ".2f")
                + ("+" if e.confirmed_time_ms is not None else "")
                + emulated_mark(e.emulated),
                fmt(e.peak_memory_mb, ".2f") + emulated_mark(e.emulated),
                "yes" if e.feasible else "no",
                policy_label(e.params),
            ]
        )
    also = "" if closest is None or closest.pareto else f", and {closest.name}, the closest"
    notes = [
        "* chosen policy; rows: the Pareto front (accuracy, memory, "
        f"{text.time_at(summary)}) and the fp32 baseline{also}"
    ]
    if summary.step_times_confirmed:
        notes.append(f"+ {text.time_words} re-measured side by side with the fp32 baseline")
    if summary.peak_memory_is_estimate:
        notes.append(f"~ CPU memory is an estimate: {text.memory_counted}")
    emulated = emulated_note(summary.settings.emulated, (e.emulated for e in front))
    if emulated:
        notes.append(emulated)
    return "\n".join([text_table(lines), *notes, *retry_lines(summary)])


def retry_lines(summary: Summary) -> list[str]:
    """A line for each trial that ran again, and why: ``trial 0 (uniform-fp16): launched
    again after rank 1 was killed by SIGKILL (log: ...)``."""
    return [f"{e.label}: {e.retried}" for e in summary.entries if e.retried]
