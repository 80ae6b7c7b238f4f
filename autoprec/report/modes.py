"""What the report says differently per mode: the names of its time and memory, the
colours of its dtypes. The mode object names its words (`autoprec.trials.Mode.text`),
so that no view asks which mode it is in; where they leave the time unnamed, it is named
by the mode's own label for it (`autoprec.trials.Mode.time_label`: ``step time``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoprec.study.summary_schema import Summary
from autoprec.trials import mode_named

DTYPE_COLOURS = {"fp32": "#4c72b0", "bf16": "#55a868", "fp16": "#dd8452", "fp8": "#c44e52"}
SERVING_DTYPE_COLOURS = {**DTYPE_COLOURS, "int8": "#8172b3"}


@dataclass(frozen=True, kw_only=True)
class ModeText:
    """How one mode's figures are named in tables, notes and plots."""

    memory_counted: str  # what a CPU estimate of peak memory counts
    colours: dict[str, str]  # dtype -> colour, in legend order
    style: str = ""  # what the page adds to the shared style
    # What its time is, in a sentence, and the time's column header ("": of the mode's
    # label for its time, ``step time`` and ``step ms``; see `mode_text`).
    time_words: str = ""
    time_column: str = ""

    def time_at(self, summary: Summary) -> str:
        """``step time``, or ``latency at batch 8`` where the study served one size."""
        size = summary.batch_size
        return self.time_words if size is None else f"{self.time_words} at batch {size}"


TRAINING_TEXT = ModeText(  # the time named by its label: step time, step ms
    memory_counted="parameters, gradients, optimizer state and saved activations",
    colours=DTYPE_COLOURS,
)
SERVING_TEXT = ModeText(
    time_words="latency",
    time_column="latency ms",
    memory_counted="weights plus the peak of live activations",
    colours=SERVING_DTYPE_COLOURS,
    style=".int8{color:#8172b3}\n",
)


def mode_text(summary: Summary) -> ModeText:
    """The words of the study's mode (`autoprec.trials.Mode.text`), its time named by its
    label where they leave it unnamed."""
    mode = mode_named(summary.mode)
    text: ModeText = mode.report_text()
    label = mode.time_label()
    return replace(
        text,
        time_words=text.time_words or f"{label} time",
        time_column=text.time_column or f"{label} ms",
    )
