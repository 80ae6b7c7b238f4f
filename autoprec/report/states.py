"""The report's optimizer-state sections: what each quantised kind loses on the fp32
baseline's real states, per group (the guided search's order), and, per policy, the
groups whose quantised states hurt, with the mechanism (underflow, saturation, blow-up)."""

from __future__ import annotations

import html

from autoprec.numerics.state_health import rank_state_groups
from autoprec.report.page import cell, html_table
from autoprec.study.summary_schema import Entry, Summary

LOSS_HEADER = [
    "kind",
    "rank",
    "group",
    "quantised elements",
    "exp_avg_sq relative error",
    "exp_avg_sq zero under live exp_avg",
]
HEALTH_HEADER = [
    "policy",
    "group",
    "state",
    "exp_avg_sq zero",
    "underflow (zero under live exp_avg)",
    "saturated",
    "updates past Adam's bound",
    "update/weight",
    "mechanisms",
    "reason",
]


def states_section(summary: Summary, entries: list[Entry]) -> str:
    """Both sections' HTML; empty for a study that searched no optimizer states."""
    return _loss_section(summary.baseline) + _health_section(summary, entries)


def _loss_section(baseline: Entry) -> str:
    losses = baseline.state_loss
    if not losses:
        return ""
    names = list(dict.fromkeys(loss.group for loss in losses))
    by_key = {(loss.group, loss.kind): loss for loss in losses}
    rows = []
    for kind in dict.fromkeys(loss.kind for loss in losses):
        for rank, group in enumerate(rank_state_groups(losses, kind, names), 1):
            loss = by_key.get((group, kind))
            if loss is None:
                continue
            rows.append(
                [
                    cell(kind),
                    cell(rank),
                    cell(group),
                    cell(f"{loss.quantised_elements} of {loss.elements}"),
                    cell(loss.second_moment_rel_error, ".4g"),
                    cell(loss.collapsed_share, ".4%"),
                ]
            )
    return f"""<h2>Optimizer states: what each kind loses (fp32 baseline's states)</h2>
<p class="note">The fp32 baseline's Adam moments at the end of its trial, copied into the
buffers each kind's optimizer stores them in (torchao's blockwise codes; bf16 rounded to
nearest) and read back. The guided search keeps the groups ranked first in higher precision
first: those whose second moments become zero while the first is not (their next updates
are lr * exp_avg / eps), then by the second moment's relative error.</p>
{html_table(LOSS_HEADER, rows)}"""


def _health_section(summary: Summary, entries: list[Entry]) -> str:
    shown = [e for e in entries if e.state_health]
    shown += [t for t in summary.trials if t not in shown and any(g.reason for g in t.state_health)]
    rows, classes = [], []
    for entry in shown:
        for group in entry.state_health:
            rows.append(
                [
                    html.escape(entry.label),
                    cell(group.group),
                    cell(group.state),
                    cell(group.zero_second_moment_share, ".4%"),
                    cell(group.collapsed_share, ".4%"),
                    cell(group.saturated_share, ".4%"),
                    cell(group.blown_up_share, ".4%"),
                    cell(group.update_weight_ratio, ".3g"),
                    cell(", ".join(group.mechanisms) or "none"),
                    html.escape(group.reason or ""),
                ]
            )
            classes.append("best" if entry.key == summary.best.key else "")
    if not rows:
        return ""
    return f"""<h2>Optimizer state health per group</h2>
<p class="note">Each group's Adam state at the end of the trial, as stored. Underflow: the
second moment stored as 0 under a live first moment; saturated: a moment non-finite or at
its dtype's largest value; past Adam's bound: steps larger than exact moments can give.</p>
{html_table(HEALTH_HEADER, rows, classes)}"""
