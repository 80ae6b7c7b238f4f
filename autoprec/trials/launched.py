"""Trials launched across several devices: any mode's trials, each trial one torchrun
launch of ``--nproc-per-trial`` ranks.

`LaunchedTrials` wraps the search's `Trials` and replaces only how a trial is measured
(and re-timed): each is a launch whose ranks run the mode's `Mode.rank_trial`
(`autoprec.distributed.launch.launched_trial`), and the result is read back as the mode's
`result_type`. Everything else (the space, the choice, the profile, the summary, what a
search leaves behind) is the wrapped trials', in this process. A mode is launchable where
it names its ``rank_trial`` (the training mode does); the launch and the ranks' own
mechanics are `autoprec.distributed`'s.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec.distributed.launch import LaunchPlan, launched_trial, plan_for
from autoprec.errors import AutoprecError
from autoprec.trials import mode_named
from autoprec.trials.base import TRIAL_TIMEOUT_FACTOR, TRIAL_TIMEOUT_MIN_S

if TYPE_CHECKING:
    from autoprec.policy import Policy
    from autoprec.profile.sensitivity import Profile
    from autoprec.space import SearchSpace
    from autoprec.trials.base import Result, Trials


class LaunchedTrials:
    """``inner``'s trials with every trial launched across ``plan.nproc`` devices: what is
    measured comes from the ranks; the rest is ``inner``'s (every attribute this class
    does not define is read from it: its mode, objectives, result type, choice, ...)."""

    def __init__(self, inner: Trials, plan: LaunchPlan) -> None:
        self.inner = inner
        self.plan = plan

    def __getattr__(self, name: str) -> Any:
        inner = vars(self).get("inner")  # none yet while an instance is being made
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def settings(self) -> dict[str, Any]:
        """The wrapped trials', and the ranks' collective backend (the search records how
        many ranks, and in which parallel mode)."""
        return {**self.inner.settings, "backend": self.plan.backend}

    def fit(self, space: SearchSpace, profile: Profile | None) -> SearchSpace:
        """The wrapped trials' space, fitted to the launch (`LaunchPlan.fit`: the dtype
        gradients are communicated in searched too)."""
        return self.plan.fit(self.inner.fit(space, profile))

    def warm_up(self, space: SearchSpace, limit_s: float) -> None:
        """Nothing: every launch is a fresh set of processes, which no warm-up here helps."""

    def judged_against(self, baseline: Result, early_stopping: bool) -> LaunchedTrials:
        """These trials, stopped early on the ranks against the baseline
        (``early_stopping``: the ranks are handed its result, and the mode's rank trial
        judges by it), with the search's default time limit once the baseline sets it
        (25x its trial, at least 300 s) where no ``--trial-timeout`` was given."""
        plan = self.plan
        if plan.default_limit:
            limit_s = max(TRIAL_TIMEOUT_MIN_S, TRIAL_TIMEOUT_FACTOR * baseline.run_time_s)
            plan = replace(plan, limit_s=limit_s, default_limit=False)
        if early_stopping:
            plan = replace(plan, baseline=baseline.to_dict())
        return self if plan is self.plan else LaunchedTrials(self.inner, plan)

    def measure(self, policy: Policy) -> Result:
        """One launch of the policy's trial (`launched_trial`)."""
        return launched_trial(self.plan, policy, self.inner.result_type)

    def retime(self, policies: list[Policy]) -> list[float]:
        """Each policy launched again, one after another (a launch holds the devices: no
        two run side by side); a launch that gives no time counts as infinitely slow."""
        times = []
        for policy in policies:
            time_ms = self.measure(policy).time_ms
            times.append(time_ms if time_ms is not None else math.inf)
        return times


def launched(
    trials: Trials,
    config: Any,
    task_spec: str | None,
    devices: list[str],
    folder: Path,
    budget: Any,
) -> Trials:
    """The search's trials, launched across devices where ``--nproc-per-trial`` says so,
    each rank running the mode's `Mode.rank_trial` over ``budget``."""
    if getattr(config, "nproc_per_trial", 1) <= 1:
        return trials
    mode = mode_named(trials.mode)
    if mode.rank_trial is None:  # refused with the settings (`settle_parallel`) already
        raise AutoprecError(f"--nproc-per-trial: --mode {mode.name} runs on one device only")
    plan = plan_for(config, task_spec, devices, folder, budget, mode.rank_trial)
    # Its class variables (mode, objectives, ...) are the wrapped trials', read through.
    return LaunchedTrials(trials, plan)  # type: ignore[return-value]
