"""What the report says differently per mode: the names of its time and memory, the
colours of its dtypes. The mode object names its words (`autoprec.trials.Mode.text`),
so that no view asks which mode it is in; where they leave the time unnamed, it is named
by the mode's own label for it (`autoprec.trials.Mode.time_label`: ``step time``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import autoprec.formats as formats
from autoprec.study.summary_schema import Summary
from autoprec.trials import mode_named


def dtype_colours(mode: str) -> dict[str, str]:
    """The colour of each format ``mode`` may assign, widest first (the legend's order)."""
    made = sorted(formats.all_formats(), key=lambda f: (-f.bytes_per_element, -f.limits.range_bits))
    return {f.name: f.colour for f in made if mode in f.modes}


DTYPE_COLOURS = dtype_colours("training")
SERVING_DTYPE_COLOURS = dtype_colours("serving")


@dataclass(frozen=True, kw_only=True)
class ModeText:
    """How one mode's figures are named in tables, notes and plots."""

    memory_counted: str  # what a CPU estimate of peak memory counts
    formats_of: str  # the mode whose formats it colours (`dtype_colours`)
    # What its time is, in a sentence, and the time's column header ("": of the mode's
    # label for its time, ``step time`` and ``step ms``; see `mode_text`).
    time_words: str = ""
    time_column: str = ""

    @property
    def colours(self) -> dict[str, str]:
        """Each format's colour, in legend order."""
        return dtype_colours(self.formats_of)

    @property
    def style(self) -> str:
        """What the page adds to the shared style: each format only this mode has whose
        method a policy records (int8; the block-scaled formats are not styled yet)."""
        only = [f for f in formats.all_formats() if f.modes == (self.formats_of,)]
        only = [f for f in only if f.policy_records]
        return "".join(f".{f.name}{{color:{f.colour}}}\n" for f in only)

    def time_at(self, summary: Summary) -> str:
        """``step time``, or ``latency at batch 8`` where the study served one size."""
        size = summary.batch_size
        return self.time_words if size is None else f"{self.time_words} at batch {size}"


TRAINING_TEXT = ModeText(  # the time named by its label: step time, step ms
    memory_counted="parameters, gradients, optimizer state and saved activations",
    formats_of="training",
)
SERVING_TEXT = ModeText(
    time_words="latency",
    time_column="latency ms",
    memory_counted="weights plus the peak of live activations",
    formats_of="serving",
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
