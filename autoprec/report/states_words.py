"""The chosen policy's optimizer states in words, for the search's last line: what they
keep against fp32's, and each group kept in more bytes than some trial stored it in, with
that trial's outcome, so that the answer says why a group was kept high."""

from __future__ import annotations

from autoprec.optim.state import STATE_BYTES_PER_ELEMENT
from autoprec.study.summary_schema import Entry, Summary


def states_words(summary: Summary) -> str:
    """What the chosen policy's optimizer keeps, for the gains line: its state against
    fp32's, and each group kept in a kind that stores more than one some trial measured
    for it, with the nearest such trial's outcome (``optimizer state 0.25 MB against
    fp32's 1.57 MB; kept high: embeddings in 8bit (in 4bit: trial 6, accuracy -2.1 pt,
    beyond the tolerance)``). Empty where the study searched no states."""
    best, baseline = summary.best, summary.baseline
    chosen = {k: v for k, v in best.params.items() if k.startswith("state.")}
    if not chosen:
        return ""
    mb = best.metrics.get("optimizer_state_mb")
    fp32_mb = baseline.metrics.get("optimizer_state_mb")
    words = []
    if mb is not None and fp32_mb:
        words.append(f"optimizer state {mb:.2f} MB against fp32's {fp32_mb:.2f} MB")
    kept = [_kept_high(summary, key, kind) for key, kind in chosen.items()]
    kept_words = [k for k in kept if k]
    if kept_words:
        words.append("kept high: " + ", ".join(kept_words))
    return "; ".join(words)


def _kept_high(summary: Summary, key: str, kind: str) -> str:
    """The group of ``key`` kept in ``kind``, where a trial stored it in fewer bytes, with
    the outcome of the trial nearest the chosen policy that did; else empty."""
    size = STATE_BYTES_PER_ELEMENT
    lower = [
        t
        for t in summary.trials
        if t.params.get(key) in size and kind in size and size[t.params[key]] < size[kind]
    ]
    if not lower:
        return ""
    best = summary.best

    def distance(entry: Entry) -> int:
        return sum(entry.params.get(k) != v for k, v in best.params.items())

    nearest = min(lower, key=lambda t: (distance(t), t.key))
    group = key.removeprefix("state.")
    return f"{group} in {kind} (in {nearest.params[key]}: {_outcome(summary, nearest)})"


def _outcome(summary: Summary, entry: Entry) -> str:
    """Why a lighter-stored trial lost: it did not finish, fell outside the tolerance, or
    used more memory in all."""
    name = f"trial {entry.key}"
    if not entry.complete:
        return f"{name} {entry.state}"
    drop_pt = 100.0 * (entry.accuracy_drop or 0.0)
    if not entry.feasible:
        return f"{name}, accuracy {-drop_pt + 0.0:+.1f} pt, beyond the tolerance"
    mb, best_mb = entry.peak_memory_mb, summary.best.peak_memory_mb
    if mb is not None and best_mb is not None:
        return f"{name}, {mb:.2f} MB in all against {best_mb:.2f} MB"
    return f"{name}, feasible, not chosen"
