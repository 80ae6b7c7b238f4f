"""Text views of a finished search: the Pareto-front table and the chosen policy's gains."""

from __future__ import annotations

from typing import Any


def policy_label(params: dict[str, str]) -> str:
    """A short label of a policy, e.g. ``fc1=fp16 fc2=bf16 head=fp32 scale=dynamic``."""
    parts = [f"{k.removeprefix('dtype.')}={v}" for k, v in params.items() if k.startswith("dtype.")]
    mode = params.get("loss_scale.mode", "none")
    if mode != "none":
        parts.append(f"scale={mode}:{params.get('loss_scale.init_scale', '-')}")
    elif "fp16" in params.values():
        parts.append("scale=none")
    return " ".join(parts)


def _fmt(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, int | float) else format(value, spec)


def front_table(summary: dict[str, Any]) -> str:
    """The Pareto front (and the baseline) as an aligned text table; the best is marked."""
    best = summary["best"]["number"]
    rows = [summary["baseline"], *summary["trials"]]
    front = [r for r in rows if r["pareto"] or r["number"] in (best, "baseline")]
    memory_label = "memory MB" + ("~" if summary.get("peak_memory_is_estimate") else "")
    header = ["", "trial", "accuracy", "drop", "step ms", memory_label, "feasible", "policy"]
    lines = [header]
    for r in front:
        m = r["metrics"]
        lines.append(
            [
                "*" if r["number"] == best else "",
                str(r["number"]),
                _fmt(m.get("accuracy"), ".4f"),
                _fmt(m.get("accuracy_drop"), "+.4f"),
                _fmt(m.get("confirmed_step_time_ms", m.get("step_time_ms")), ".2f")
                + ("+" if "confirmed_step_time_ms" in m else ""),
                _fmt(m.get("peak_memory_mb"), ".2f"),
                "yes" if r["feasible"] else "no",
                policy_label(r["params"]),
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in lines
    ]
    notes = [
        "* chosen policy; rows: the Pareto front (accuracy, memory, step time) "
        "and the fp32 baseline"
    ]
    if summary.get("step_times_confirmed"):
        notes.append("+ step time re-measured side by side with the fp32 baseline")
    if summary.get("peak_memory_is_estimate"):
        notes.append(
            "~ CPU memory is an estimate: parameters, gradients, optimizer state "
            "and saved activations"
        )
    return "\n".join(text + notes)


def gains_line(summary: dict[str, Any]) -> str:
    """E.g. ``best: trial 7 - 1.90x faster, 48% less memory, accuracy -0.2 pt vs fp32``."""
    best = summary["best"]
    if best["number"] == "baseline":
        return "best: the fp32 baseline - no policy in this search beat it under the preference"
    speedup = best["speedup_vs_fp32"]
    saving = best["memory_saving_vs_fp32"]
    drop_pt = 100.0 * best["metrics"].get("accuracy_drop", 0.0)
    speed = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    memory = f"{abs(saving) * 100:.0f}% {'less' if saving >= 0 else 'more'} memory"
    return f"best: trial {best['number']} - {speed}, {memory}, accuracy {-drop_pt:+.1f} pt vs fp32"
