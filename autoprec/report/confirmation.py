"""The report's section on a long confirmation (``--confirm-steps``): each candidate
trained that long beside fp32, whether it held and what failed, beside the short
trials' tables."""

from __future__ import annotations

import html

from autoprec.report.page import cell, html_table
from autoprec.study.summary_schema import Summary

HEADER = [
    "candidate",
    "held",
    "state",
    "steps run",
    "accuracy",
    "drop",
    "non-finite steps",
    "skipped steps",
    "what failed",
    "MLflow run",
]


def confirmation_section(summary: Summary) -> str:
    """The section's HTML; empty for a search without a confirmation."""
    confirmation = summary.confirmation
    if confirmation is None:
        return ""
    rows = [
        [
            html.escape(c.label) + (" (read back from the study)" if c.reused else ""),
            cell(c.held),
            cell(c.state),
            cell(c.steps_run),
            cell(c.accuracy, ".4f"),
            cell(c.accuracy_drop, "+.4f"),
            cell(c.nonfinite_steps),
            cell(c.overflow_steps),
            html.escape(c.reason or ""),
            cell(c.mlflow_run_id),
        ]
        for c in confirmation.checks
    ]
    classes = ["best" if c.held else "" for c in confirmation.checks]
    fp32 = "reused from the study" if confirmation.fp32_reused else "trained for it"
    head, *_ = confirmation.lines()
    return f"""<h2>Long confirmation: {confirmation.steps} steps</h2>
<p class="note">{html.escape(head)}. Each candidate, in the order the choice ranks them,
trained {confirmation.steps} steps beside fp32 trained as long ({fp32}; accuracy
{cell(confirmation.fp32_accuracy, ".4f")}), from the same weights on the same batches.</p>
{html_table(HEADER, rows, classes)}"""
