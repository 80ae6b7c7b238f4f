"""The report's memory split: each policy's peak memory as weights, gradients, optimizer
state and activations, where the meter counted them apart (the CPU's estimate)."""

from __future__ import annotations

import html

from autoprec.report.page import cell, html_table
from autoprec.study.summary_schema import Entry

PARTS = ("weights", "gradients", "optimizer_state", "activations")
HEADER = ["policy", "weights MB", "gradients MB", "optimizer state MB", "activations MB"]


def memory_section(entries: list[Entry]) -> str:
    """A table of the entries that carry a split; empty where none does (a GPU's
    allocator peak is not split)."""
    rows = []
    for entry in entries:
        split = (entry.telemetry or {}).get("memory_split_mb")
        if isinstance(split, dict):
            rows.append([html.escape(entry.label), *(cell(split.get(k), ".4f") for k in PARTS)])
    if not rows:
        return ""
    return f"<h2>Memory split (CPU estimate)</h2>\n{html_table(HEADER, rows)}"
