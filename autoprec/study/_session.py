"""A search session: its checked inputs, its stores, and the study's one-off set-up,
shared by the search process and by every worker that joins the study.

Order of work, so that bad input never touches a store:
1. `prepare`: load and check the task, the space, the device and every setting;
2. `Session.open`: open the MLflow experiment and the Optuna study (created once;
   continued when it exists and fits), fail trials whose process died;
3. `Session.set_up`: once per study, under its set-up lease, the MLflow parent run, the
   sensitivity profile, the fp32 baseline and the anchors; a process that finds another
   doing it waits (`Session.join` reads what the set-up made, for workers);
4. `Session.context`: what every trial shares, for the trial loop;
5. `Session.confirm`: the fastest candidates timed again side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState
from torch import nn

from autoprec.devices import Backend, get_backend, parse_devices
from autoprec.distributed.data import check_shardable
from autoprec.distributed.launch import check_cores, trial_devices
from autoprec.errors import AutoprecError, StoreError, first_line, redact
from autoprec.numerics.state_health import GroupStateLoss
from autoprec.profile.guided import GuidedStrategy
from autoprec.profile.sensitivity import Profile
from autoprec.selection import rank_key
from autoprec.settings import study_settings
from autoprec.space import DEFAULT_SPACE, SearchSpace, builtin_spaces, load_space
from autoprec.space.fitting import fp8_group_order
from autoprec.study._events import Callbacks, Guarded
from autoprec.study._identity import (
    STUDY_ID_ATTR,
    StudyIdentity,
    of_outputs,
    of_parent_run,
    refuse_other_storage,
    refuse_other_study,
    summary_settings,
)
from autoprec.study._loop import (
    POLL_S,
    TrialContext,
    logged_trial,
    requeue_anchor,
    trial_log,
)
from autoprec.study._records import Feasibility, TrialRecord, record_of, result_of
from autoprec.study._studies import (
    RECORD_ATTR,
    Lease,
    fail_stale,
    finished,
    make_sampler,
    open_storage,
    open_study,
    stored_study_id,
    worker_id,
)
from autoprec.study.config import SearchConfig, check_study_name, check_tolerance
from autoprec.study.summary import candidates
from autoprec.tasks import Task, check_task, check_task_data, load_task
from autoprec.tracking import FLUSH_WAIT_S, Tracker, absolute_sqlite_uri
from autoprec.trials import trials_of
from autoprec.trials.base import TRIAL_TIMEOUT_FACTOR, TRIAL_TIMEOUT_MIN_S, Trials, TrialState
from autoprec.trials.launched import launched
from autoprec.trials.schedule import for_trials
from autoprec.trials.training import Budget

PROFILE_ATTR = "profile"  # study attribute: the ranking the groups and guidance use
BASELINE_RUN = "baseline-fp32"  # the MLflow child run of the fp32 baseline
CONFIRMED_ATTR = "confirmed_step_time_ms"  # study attribute: side-by-side re-timings


def default_space_for(task_name: str) -> str:
    """The shipped space named after the task if there is one, else the generic one."""
    return task_name if task_name in builtin_spaces() else DEFAULT_SPACE


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A search's inputs, loaded and checked; no store has been touched yet.

    ``space`` is fitted to the model and the device (without a profile: the fingerprint
    every process of the study must agree on); ``settings`` are what a study is
    identified by (it refuses to continue with others); ``trials`` is the search's mode
    (`autoprec.trials`), which owns everything that differs between modes."""

    config: SearchConfig
    task: Task
    task_spec: str | None
    space_spec: str | None
    model: nn.Module
    unfitted: SearchSpace
    space: SearchSpace
    backend: Backend
    devices: list[str]
    budget: Budget
    feasibility: Feasibility
    study: str
    workers: int
    prefer: str  # the selection's: speed, memory or balanced
    trials: Trials

    @property
    def tolerance(self) -> float:
        return self.feasibility.tolerance

    @property
    def settings(self) -> dict[str, Any]:
        """The study's fingerprint: the declared settings that change a record of the
        study (`autoprec.settings.study_settings`), as this search settled them."""
        config = self.config
        resolved = {  # the options first, then what follows from them (the fitted space)
            "task": self.task.name,
            "mode": config.mode,
            "steps": self.budget.steps,
            "seed": self.budget.seed,
            "device": self.backend.kind,
            "emulated": ",".join(self.backend.emulated()),  # figures of emulated dtypes
            "nproc_per_trial": config.nproc_per_trial,
            "parallel": config.parallel,
            **self.trials.settings,  # the mode's own
            # how the best is chosen from the trials (best_policy.yaml, the summary)
            "accuracy_tolerance": self.tolerance,
            "prefer": config.prefer or self.prefer,
            "sampler": config.sampler,
            "confirm_top": config.confirm_top,
            "early_stopping": config.early_stopping,
            "space": self.space.name,
            "space_fingerprint": self.space.fingerprint(),
        }
        return study_settings(resolved)

    @property
    def needs_profile(self) -> bool:
        return self.config.sampler == "guided" or self.unfitted.auto is not None

    @property
    def out_dir(self) -> Path:
        return Path(self.config.runs_dir) / self.study

    def fitted(self, profile: Profile | None) -> SearchSpace:
        """The space fitted to the model, the device, the mode and (in a ``groups: auto``
        space) the profile's riskiest modules."""
        return self.trials.fit(self.unfitted, profile)


def prepare(
    task: Task | str,
    space: SearchSpace | str | Path | None,
    config: SearchConfig,
    check_data: bool = True,
) -> Prepared:
    """Load and check everything a search is given, before any store is opened."""
    devices = parse_devices(config.devices)
    nproc = config.nproc_per_trial  # trials across several devices: one worker per group
    if nproc > 1:
        devices = trial_devices(devices, config.device, nproc)
        check_cores(devices, nproc)
    default_workers = max(1, len(devices) // nproc if devices and devices[0] != "cpu" else 1)
    workers = config.workers if config.workers is not None else default_workers
    if workers > 1 and not (isinstance(task, str) and isinstance(space, str | Path | None)):
        raise AutoprecError(
            "--workers: worker processes load the task and the space themselves; "
            "name them (built-in name, module:attr or file.py:attr; a space name or file)"
        )
    task_spec = task if isinstance(task, str) else None
    space_spec = str(space) if isinstance(space, str | Path) else None
    task = load_task(task) if isinstance(task, str) else task
    model = check_task(task)
    if not isinstance(space, SearchSpace):
        space_spec = space_spec or default_space_for(task.name)
        space = load_space(space_spec)
    if devices:
        backend, *_ = [get_backend(d, config.emulate) for d in devices]  # each must be there
        if config.device != "auto" and get_backend(config.device).kind != backend.kind:
            raise AutoprecError(
                f"--device {config.device!r} and --devices {config.devices!r} disagree"
            )
    else:
        backend = get_backend(config.device, config.emulate)
        devices = [str(backend.device)] if backend.kind != "cpu" else ["cpu"]
    budget = Budget(
        steps=config.steps, seed=config.seed, train_steps=config.train_steps, guarded=config.guard
    )
    if check_data:  # a long confirmation draws as many batches as it trains steps
        check_task_data(task, model, max(budget.steps, config.confirm_steps or 0), budget.seed)
        check_shardable(task.train_data, budget.seed, config.nproc_per_trial)
    task = for_trials(task, model, config)  # --trial-schedule compressed
    assert config.mode is not None  # settled when the config was made
    trials = trials_of(config.mode, config, task, model, backend, budget)
    # The study's name never depends on the space; launched trials, which keep their
    # launches under it, may search more of the space (FSDP2's reduction), so they fit it.
    study = check_study_name(trials.choice(space).study)
    launches = Path(config.runs_dir) / study / "launches"
    trials = launched(trials, config, task_spec, devices, launches.resolve(), budget)
    fitted = trials.fit(space, None)  # to a profile later
    choice = trials.choice(fitted)
    feasibility = replace(
        choice.feasibility, tolerance=check_tolerance(choice.feasibility.tolerance)
    )
    return Prepared(
        config=config,
        task=task,
        task_spec=task_spec,
        space_spec=space_spec,
        model=model,
        unfitted=space,
        space=fitted,
        backend=backend,
        devices=devices,
        budget=budget,
        feasibility=feasibility,
        study=study,
        workers=workers,
        prefer=choice.prefer,
        trials=trials,
    )


class Session:
    """A search's stores and its study, for the search process or a worker."""

    def __init__(
        self,
        prepared: Prepared,
        tracker: Tracker,
        study: optuna.Study,
        callbacks: Callbacks,
    ) -> None:
        self.prepared = prepared
        self.tracker = tracker
        self.study = study
        self.callbacks = callbacks
        self.profile: Profile | None = None
        self.space = prepared.space
        self.baseline: TrialRecord | None = None
        self.trials: Trials = prepared.trials
        # Seconds this process spent in each part of the set-up and re-timing: the
        # profile, the warm-up, waiting for MLflow before the baseline (summary.json's
        # phase_time_s).
        self.phases_s: dict[str, float] = {}

    def _timed(self, phase: str, started_s: float) -> None:
        self.phases_s[phase] = self.phases_s.get(phase, 0.0) + time.perf_counter() - started_s

    def warm_up(self) -> None:
        """The mode's warm-up (training: a short run of each dtype), before any timing.
        Until the baseline sets the default time limit, an explicit one or the minimum
        applies."""
        configured = self.prepared.config.trial_timeout_s
        limit_s = TRIAL_TIMEOUT_MIN_S if configured is None else configured
        started_s = time.perf_counter()
        self.trials.warm_up(self.prepared.space, limit_s)
        self._timed("warm_up", started_s)

    @classmethod
    def open(
        cls, prepared: Prepared, callbacks: Callbacks | None = None, worker: int = 0
    ) -> Session:
        """Both stores, reachable before either is written to; the study created or
        continued; trials whose process died failed, and their runs closed."""
        config = prepared.config
        callbacks = Guarded(callbacks or Callbacks())
        tracker = Tracker(
            config.tracking_uri, prepared.study, Path(config.runs_dir), callbacks.warning
        )  # it names its store in messages with the password redacted
        storage_url = absolute_sqlite_uri(config.storage)
        database = _sqlite_file(storage_url, Path(config.runs_dir))
        # Outputs of a study in another storage are refused before this one is touched.
        outputs = of_outputs(prepared.out_dir)
        refuse_other_storage(
            prepared.study,
            str(prepared.out_dir),
            outputs,
            StudyIdentity.of(storage_url, None).storage,
        )
        created = database is not None and not database.exists()
        try:
            storage = open_storage(
                storage_url, config.heartbeat_s, _on_stale(tracker), callbacks.warning
            )
        except Exception as error:  # unreachable server, missing driver, bad credentials
            where = config.public()["storage"]
            raise StoreError(f"Optuna storage {where}: {redact(first_line(error))}") from None
        sampler = make_sampler(config.sampler, config.seed, config.trials, worker)
        try:
            _refuse_records_of_another_study(prepared, tracker, storage, outputs)
            objectives = prepared.trials.objectives
            legacy = summary_settings(prepared.out_dir)  # for a study older than fingerprints
            study = open_study(
                prepared.study, storage, sampler, prepared.settings, objectives, legacy
            )
        except BaseException:  # a study of other settings: leave the database as it was
            storage.engine.dispose()
            if created and database is not None:
                _remove_sqlite(database)
            raise
        tracker.parent_tags = identity_of(study, storage_url).tags()
        fail_stale(study)
        return cls(prepared, tracker, study, callbacks)

    # -- the study's one-off set-up -----------------------------------------------------

    def set_up(self, parent_params: dict[str, Any]) -> None:
        """The study's parent run, profile, baseline and anchors, made once: by whoever
        holds the set-up lease; a process that finds it held waits for the holder."""
        lease = Lease(self.study, "setup", worker_id())
        waiting = False
        while True:
            if self._ready():
                # What the set-up made is read first: a study refused here (its fp32.pt
                # damaged, say) leaves its parent run as it was, not RUNNING again.
                self.join()
                self.tracker.start_parent(parent_params)  # reopened: RUNNING again
                self.catch_up()
                return
            if lease.acquire():
                break
            if not waiting:
                self.callbacks.waiting(lease.holder())
                waiting = True
            time.sleep(2 * POLL_S)
        try:
            self._set_up_holding_the_lease(parent_params)
        except BaseException:  # Ctrl-C or an error during set-up: the parent run is closed
            self.tracker.end_parent("KILLED")
            raise
        finally:
            lease.release()
        self.catch_up()

    def _ready(self) -> bool:
        attrs = self.study.user_attrs
        ready = attrs.get("baseline") is not None and attrs.get("anchors_enqueued")
        if self.prepared.needs_profile:
            ready = ready and attrs.get(PROFILE_ATTR) is not None
        return bool(ready)

    def _set_up_holding_the_lease(self, parent_params: dict[str, Any]) -> None:
        prepared = self.prepared
        self.tracker.start_parent(parent_params)
        self.trials.load(prepared.out_dir, True, self.callbacks.training_fp32)
        self.profile = self._stored_profile()
        if prepared.needs_profile and self.profile is None:
            self.callbacks.profiling()
            started_s = time.perf_counter()
            self.profile = self.trials.profile(prepared.budget.seed)
            path = self.profile.save(prepared.out_dir / "profile.json")
            self.tracker.log_profile(self.profile, path)
            self.study.set_user_attr(PROFILE_ATTR, self.profile.brief())
            self._timed("profile", started_s)
            self.callbacks.profiled(self.profile, path)
        self.space = prepared.fitted(self.profile)
        if self.study.user_attrs.get("baseline") is None:
            self.callbacks.baseline()
            self.warm_up()
        self.baseline = self._baseline()
        if not self.study.user_attrs.get("anchors_enqueued"):
            for name, params in self.space.anchors().items():
                self.study.enqueue_trial(params, user_attrs={"anchor": name})
            self.study.set_user_attr("anchors_enqueued", True)
        if self.prepared.workers > 1 or not self.prepared.config.storage.startswith("sqlite"):
            # Others will join: the parent run exists before the lease goes, so that none
            # of them makes a second (alone on a sqlite study, nobody need wait for it).
            self.tracker.flush(FLUSH_WAIT_S)

    def join(self) -> None:
        """Read what the study's set-up made: parent run, profile, fitted space, baseline."""
        prepared = self.prepared
        fingerprint = self.study.user_attrs.get("space_fingerprint")
        if fingerprint is not None and fingerprint != prepared.space.fingerprint():
            raise AutoprecError(
                f"study {prepared.study!r}: this process's space differs from the study's"
            )
        self.trials.load(prepared.out_dir, False, self.callbacks.training_fp32)
        self.profile = self._stored_profile()
        self.space = prepared.fitted(self.profile)
        self.baseline = self._baseline()

    def catch_up(self) -> None:
        """Have MLflow catch up with the study: the baseline and trials an earlier run
        measured but could not log (its tracking store was down or lost, or it died
        first), and the runs of trials that never finished, closed as KILLED."""
        logs, killed = [], {}
        if self.baseline is not None and self.study.user_attrs.get("baseline") is not None:
            tags = {"autoprec.role": "baseline"}
            logs.append(trial_log("baseline", BASELINE_RUN, self.space, self.baseline, tags))
        for t in self.study.get_trials(deepcopy=False):
            if RECORD_ATTR in t.user_attrs and t.state.is_finished():
                logs.append(
                    logged_trial(t, self.space, self.prepared.feasibility, self.trials.result_type)
                )
            elif t.state == OptunaState.FAIL:
                killed[str(t.number)] = "its trial was failed before its run was closed"
        self.tracker.catch_up(logs, killed)

    def _stored_profile(self) -> Profile | None:
        data = self.study.user_attrs.get(PROFILE_ATTR)
        return None if data is None else Profile.from_dict(data)

    def _baseline(self) -> TrialRecord:
        """The stored fp32 baseline, or (under the set-up lease) a new one."""
        prepared, tracker, study = self.prepared, self.tracker, self.study
        policy = self.space.policy(self.space.uniform_params("fp32"))
        stored = study.user_attrs.get("baseline")
        if stored is not None:
            result = result_of(stored["result"], self.trials.result_type)
            return TrialRecord("baseline", policy, result, 0.0, True)
        tags = {"autoprec.role": "baseline"}
        tracker.start_trial("baseline", BASELINE_RUN, tags)
        # The writer's first work (the store made, the parent run and the profile logged)
        # takes seconds of the CPU: done first, so that the baseline's steps are not timed
        # beside it (a busy core makes torch's two threads wait on each other: on a loaded
        # 2-core CPU a step took ~90x as long on two threads as on one).
        started_s = time.perf_counter()
        tracker.flush(FLUSH_WAIT_S)
        self._timed("tracking_wait", started_s)
        try:
            result = self.trials.measure(policy)
        except BaseException:
            tracker.kill_trial("baseline", "interrupted during the baseline")
            raise
        record = TrialRecord("baseline", policy, result, 0.0, True)
        tracker.log_trial(trial_log("baseline", BASELINE_RUN, self.space, record, tags))
        if result.state != TrialState.COMPLETE:
            raise AutoprecError(
                f"task {prepared.task.name!r}: the fp32 baseline did not "
                f"{self.trials.baseline_verb} "
                f"({result.reason}); fix the task before searching"
            )
        study.set_user_attr("baseline", {"result": result.to_dict()})
        return record

    # -- the trials -------------------------------------------------------------------------

    @property
    def trial_limit_s(self) -> float:
        """The per-trial time limit: the setting, or 25x the baseline's trial."""
        configured = self.prepared.config.trial_timeout_s
        if configured is not None:
            return float(configured)
        assert self.baseline is not None
        return max(TRIAL_TIMEOUT_MIN_S, TRIAL_TIMEOUT_FACTOR * self.baseline.result.run_time_s)

    def context(self, limit_s: float | None = None) -> TrialContext:
        """What every trial of the study shares, after the set-up."""
        prepared, config = self.prepared, self.prepared.config
        assert self.baseline is not None
        return TrialContext(
            task=prepared.task,
            space=self.space,
            backend=prepared.backend,
            tracker=self.tracker,
            baseline=self.baseline,
            feasibility=prepared.feasibility,
            trials=self.trials.judged_against(self.baseline.result, config.early_stopping),
            model=prepared.model,
            prefer=prepared.prefer,
            trial_timeout_s=self.trial_limit_s if limit_s is None else limit_s,
            guide=self._guidance(),
        )

    def _guidance(self) -> GuidedStrategy | None:
        if self.prepared.config.sampler != "guided" or self.profile is None:
            return None
        order = [name for name, _ in self.space.group_risk(self.profile, self.prepared.model)]
        fp8_order = fp8_group_order(self.space, self.profile, self.prepared.model)
        return GuidedStrategy(
            self.space,
            order,
            self.prepared.prefer,
            self.prepared.model,
            self.prepared.backend,
            max_gradient=self.profile.max_gradient(),
            fp8_risk_order=fp8_order,
            state_losses=self._state_losses(),
        )

    def _state_losses(self) -> list[GroupStateLoss]:
        """What each quantised state kind lost, per group, on the baseline's fp32 states
        (none where the space searches no states, or the baseline is from before)."""
        assert self.baseline is not None
        return list(self.baseline.result.entry_fields().get("state_loss") or [])

    def measured(self) -> list[TrialRecord]:
        feasibility, result_type = self.prepared.feasibility, self.trials.result_type
        return [record_of(t, feasibility, result_type) for t in finished(self.study)]

    # -- the choice ---------------------------------------------------------------------------

    def confirm(self, top: int) -> dict[str, float]:
        """Re-time the ``top`` best feasible policies (by the preference) and the baseline
        side by side; kept in the study, and measured again only when the set of
        candidates changes."""
        prefer = self.prepared.prefer
        if prefer == "memory" or top <= 0:
            return {}
        assert self.baseline is not None
        records = self.measured()
        base = candidates([self.baseline])[0]
        feasible = [c for c in candidates(records) if c.feasible]
        fastest = sorted(feasible, key=lambda c: rank_key(c, prefer, base))[:top]
        if not fastest:
            return {}
        keys = ["baseline", *(str(c.key) for c in fastest)]
        stored = self.study.user_attrs.get(CONFIRMED_ATTR) or {}
        if sorted(stored) == sorted(keys):
            return stored
        by_number = {str(r.number): r for r in records}
        policies = [self.baseline.policy, *(by_number[k].policy for k in keys[1:])]
        self.callbacks.confirming(len(keys))
        self.warm_up()
        times_ms = self.trials.retime(policies)
        confirmed = dict(zip(keys, times_ms, strict=True))
        self.study.set_user_attr(CONFIRMED_ATTR, confirmed)
        return confirmed


def _sqlite_file(storage_url: str, runs_dir: Path) -> Path | None:
    """The database file of a sqlite storage (None for a server). Its folder must exist,
    except the runs directory, which is made: a typo in --storage creates nothing."""
    if not storage_url.startswith("sqlite:///") or storage_url.endswith(":memory:"):
        return None
    database = Path(storage_url.removeprefix("sqlite:///"))
    if not database.parent.is_dir():
        if database.parent.resolve() != runs_dir.resolve():
            raise StoreError(
                f"--storage {redact(storage_url)!r}: the folder {database.parent} does not exist"
            )
        database.parent.mkdir(parents=True, exist_ok=True)
    return database


def _remove_sqlite(database: Path) -> None:
    """A sqlite file this search made before it refused to go on, and its companions."""
    for suffix in ("", "-wal", "-shm", ".queue.lock"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)


def _refuse_records_of_another_study(
    prepared: Prepared,
    tracker: Tracker,
    storage: optuna.storages.BaseStorage,
    outputs: StudyIdentity | None,
) -> None:
    """A StoreError if runs/<study>/ or the study's MLflow parent run came from another
    Optuna study than the one of that name in ``storage`` (or than a new one)."""
    current = StudyIdentity.of(prepared.config.storage, stored_study_id(storage, prepared.study))
    refuse_other_study(prepared.study, str(prepared.out_dir), outputs, current)
    parent = of_parent_run(tracker)
    refuse_other_study(prepared.study, "its MLflow parent run", parent, current)


def identity_of(study: optuna.Study, storage_url: str) -> StudyIdentity:
    """The study's identity, as summary.json and its MLflow parent run record it."""
    return StudyIdentity.of(storage_url, study.user_attrs.get(STUDY_ID_ATTR))


def _on_stale(tracker: Tracker) -> Callable[[optuna.Study, FrozenTrial], None]:
    """What happens to a trial whose worker died: its MLflow child run is closed as
    KILLED, and an anchor is queued again (Optuna has already failed the trial)."""

    def on_stale(study: optuna.Study, trial: FrozenTrial) -> None:
        if RECORD_ATTR in trial.user_attrs:  # measured and recorded before the worker died
            return
        tracker.kill_trial(str(trial.number), "its worker stopped sending heartbeats (killed?)")
        requeue_anchor(study, trial)

    return on_stale
