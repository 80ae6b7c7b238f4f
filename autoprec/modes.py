"""The modes of search as the generic code sees them: the `Mode` base class, whose defaults
are the plain case, the two modes autoprec ships, and their registry, `MODES`.

A mode owns everything that differs between modes: its `Trials` class, its own settings
section, its preferences and dtypes, whether its trials train, how a policy resolves on a
model under its trials, the export formats it allows, its report view and words, and its
summary's own part. The generic code asks the mode object (found by `mode_named`) and
never names a mode.

A new mode subclasses `Mode` and sets what differs; only ``name`` and ``trials`` are
required; `register` adds it. Heavy parts (the `Trials` class, the report view) are named
as ``"module:attribute"`` and loaded on first use, so that this module imports nothing
heavy, and nothing above the policy: the space, the policy's resolution and the settings
find a mode here, below the trials (`autoprec.trials`) that implement it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar

import autoprec.formats as formats
from autoprec.errors import AutoprecError
from autoprec.selection import TRAINING_PREFERENCES
from autoprec.serving.scenarios import SERVING_PREFERENCES

if TYPE_CHECKING:
    from torch import nn

    from autoprec.precision.view import PolicyView


def load(reference: str) -> Any:
    """The attribute a ``"module:attribute"`` reference names, its module imported."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


class Mode:
    """One mode of search. Subclass it and set ``name`` and ``trials``; the rest has the
    defaults of a mode whose trials measure policies without training or serving anything
    of their own (no settings section, speed/memory/balanced preferences, the autocast
    dtypes, the training space's rules, YAML export, the training report)."""

    # -- what it is --
    name: ClassVar[str]  # the --mode that selects it, and summary.json's "mode"
    trials: ClassVar[str]  # "module:Class" of its `Trials` (`autoprec.trials.base`)
    aliases: ClassVar[tuple[str, ...]] = ()  # names it was known by, still accepted
    help: ClassVar[str] = ""  # what its trials do, for --mode's help

    # -- its settings --
    # The settings section (and SearchConfig field) holding its own settings; None: none.
    settings: ClassVar[str | None] = None
    # "module:Class" of its own settings: SearchConfig's field ``settings`` holds one, made
    # of that section's settings (also given flat), with ``to_dict``; None: none.
    config: ClassVar[str | None] = None
    # Whether its trials train: the options of training (loss scaling, optimizer states,
    # compiled trials, longer runs and their confirmation, the range forecast) apply.
    trains: ClassVar[bool] = False
    preferences: ClassVar[tuple[str, ...]] = TRAINING_PREFERENCES

    # -- what it searches --
    # Its search spaces' rules (`autoprec.space.SpaceRules`): which layers are searched
    # and in which dtypes, the parameters beside them, the anchors, what policies record.
    space_rules: ClassVar[str] = "autoprec.trials.training_space:RULES"
    # What each rank of a trial launched across devices (``--nproc-per-trial``) runs to
    # measure a policy: "module:function" taking the launch's spec, the process group up,
    # and giving the result and the ranks' record (`autoprec.distributed.rank`'s
    # interface); None: the mode's trials run on one device only.
    rank_trial: ClassVar[str | None] = None

    # -- what it leaves behind: the summary, the report, the exports --
    # "module:Class" of its own part of summary.json (an
    # `autoprec.study.summary_schema.SummaryPart`, which names its key); None: none.
    summary_part: ClassVar[str | None] = None
    # Its report: the view (`autoprec.report.View`) and the words (`ModeText`).
    view: ClassVar[str] = "autoprec.report.training:training_view"
    text: ClassVar[str] = "autoprec.report.modes:TRAINING_TEXT"
    # ``autoprec export --format``s its studies allow, the first the default.
    # ``autoprec export --format``'s default for its studies; whether they allow the other
    # formats, and those of converted weights (`autoprec.exports.registry.format_names`).
    export_default: ClassVar[str] = "yaml"
    exports_others: ClassVar[bool] = False
    exports_converted: ClassVar[bool] = False
    # How its studies' policies are used, for ``autoprec export``'s refusal of a format.
    policy_use: ClassVar[str] = "whose policy is applied with autoprec.Precision"
    # Why ``autoprec export`` finds no trained fp32 weights ({weights}: where it looked).
    missing_weights: ClassVar[str] = "{weights} does not exist"
    # Whether ``autoprec resolve`` watches one batch of the task on this machine's device
    # kind (what `resolve_policy` answers depends on what runs there).
    watches_batch: ClassVar[bool] = True

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes its policies' layers may take (the summary reader checks them): the
        formats that say they serve it (`autoprec.formats`), else the autocast ones."""
        found = formats.names(self.name)
        return found or tuple(f.name for f in formats.all_formats() if f.autocasts)

    def trials_class(self) -> type[Any]:
        """Its `Trials` class, imported on first use."""
        return load(self.trials)  # type: ignore[no-any-return]

    def config_class(self) -> type[Any]:
        """The class of its own settings (`config`), imported on first use."""
        if self.config is None:
            raise TypeError(f"{self!r}: no class of its own settings (Mode.config)")
        return load(self.config)  # type: ignore[no-any-return]

    @property
    def export_formats(self) -> tuple[str, ...]:
        """``autoprec export --format``s its studies allow, the first the default."""
        if not self.exports_others:
            return (self.export_default,)
        names = load("autoprec.exports.registry:format_names")
        return names(self.export_default, converted=self.exports_converted)  # type: ignore[no-any-return]

    def load_space_rules(self) -> Any:
        """Its space rules, imported on first use."""
        return load(self.space_rules)

    @property
    def launchable(self) -> bool:
        """Whether its trials may be launched as several ranks (`rank_trial`)."""
        return self.rank_trial is not None

    def time_metric(self) -> str:
        """The metric its trials' time is, and its studies are compared on (its result's
        ``TIME_METRIC``: ``step_time_ms``, ``latency_p50_ms``)."""
        return self.trials_class().result_type.TIME_METRIC  # type: ignore[no-any-return]

    def time_label(self) -> str:
        """What a person calls its time (its result's ``TIME_LABEL``: ``step``)."""
        return self.trials_class().result_type.TIME_LABEL  # type: ignore[no-any-return]

    def summary_part_class(self) -> type[Any] | None:
        """The class of its summary's own part (`summary_part`); None: none."""
        return None if self.summary_part is None else load(self.summary_part)  # type: ignore[no-any-return]

    def report_view(self) -> Any:
        """Its report's view, imported on first use."""
        return load(self.view)

    def report_text(self) -> Any:
        """Its report's words, imported on first use."""
        return load(self.text)

    def resolve_policy(
        self, policy: PolicyView, model: nn.Module, device: Any = None, example: Any = None
    ) -> dict[str, str]:
        """Each leaf with parameters and the dtype it runs in under this mode's trials:
        under autocast on ``device``'s kind, as `Policy.resolve` says (``example``: as a
        forward of that batch shows it)."""
        return policy.resolve(model, device, example=example)

    def resolved_where(self, policy: PolicyView, model: nn.Module, kind: str, watched: bool) -> str:
        """Where `resolve_policy`'s dtypes hold, for ``autoprec resolve``: the device kind,
        and the regions the policy's plan puts there."""
        plan = policy.plan(model, kind)
        where = f"on {kind}" + (" (watched on one batch)" if watched else "")
        return f"{where}: outer region {plan.outer_dtype}; own regions: {len(plan.regions)}"

    def __repr__(self) -> str:
        return f"<mode {self.name}>"


class TrainingMode(Mode):
    """Trials train the task under each policy (the default mode)."""

    name = "training"
    trials = "autoprec.trials.training:TrainingTrials"
    help = "trials train the model under each policy"
    trains = True
    exports_others = True  # but no format of converted weights: it keeps none
    rank_trial = "autoprec.distributed.rank:run_rank"
    missing_weights = "a training search keeps no weights: its trials train only --steps steps"


class ServingMode(Mode):
    """Trials convert a trained fp32 model's weights under each policy and serve it."""

    name = "serving"
    aliases = ("inference",)
    trials = "autoprec.trials.serving:ServingTrials"
    help = (
        "trials convert a trained fp32 model's weights per layer (fp32/fp16/bf16/int8/fp8) "
        "and serve it"
    )
    settings = "serving"
    preferences = SERVING_PREFERENCES
    export_default = "model"
    exports_others = True
    exports_converted = True
    config = "autoprec.trials.serving:ServingConfig"
    space_rules = "autoprec.trials.serving_space:RULES"
    summary_part = "autoprec.study.serving_summary:Serving"
    view = "autoprec.report.serving:serving_view"
    text = "autoprec.report.modes:SERVING_TEXT"
    watches_batch = False
    policy_use = "whose policy converts a trained model's weights (autoprec.load_served_model)"

    def resolve_policy(
        self, policy: PolicyView, model: nn.Module, device: Any = None, example: Any = None
    ) -> dict[str, str]:
        """Each leaf with parameters and the dtype its weights are served in, as
        `Policy.resolve_served` says: serving converts the weights, on any device."""
        return policy.resolve_served(model)

    def resolved_where(self, policy: PolicyView, model: nn.Module, kind: str, watched: bool) -> str:
        return "served"


# Every mode by its name: the one registry.
MODES: dict[str, Mode] = {}
DEFAULT_MODE = "training"


def register(mode: Mode) -> Mode:
    """Add ``mode`` to `MODES` under its name (a mode of that name is replaced)."""
    MODES[mode.name] = mode
    return mode


register(TrainingMode())
register(ServingMode())


def mode_named(name: str | None) -> Mode:
    """The mode of that name, or of a name it was known by (``inference``: serving);
    None is the default mode. Any other name is an AutoprecError listing the modes."""
    if name is None:
        return MODES[DEFAULT_MODE]
    found = MODES.get(name) or next((m for m in MODES.values() if name in m.aliases), None)
    if found is None:
        raise AutoprecError(f"--mode: expected {' or '.join(MODES)}, got {name!r}")
    return found


def mode_of(mode: Mode | str | None) -> Mode:
    """A `Mode` as it is, or the mode of that name (None: the default mode)."""
    return mode if isinstance(mode, Mode) else mode_named(mode)


def canonical(name: Any) -> Any:
    """A mode's name as it is now, where ``name`` is one it was known by; anything else
    unchanged (an unknown name is for the caller to refuse in its own words)."""
    for mode in MODES.values():
        if name in mode.aliases:
            return mode.name
    return name
