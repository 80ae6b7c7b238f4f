"""The Optuna side of a search shared by many workers: storage, heartbeats, claims, leases.

Optuna's relational storage already coordinates workers; this module only adds what a
precision search needs on top, all through that one storage:

- on sqlite, taking a queued trial is one process at a time (sqlite reads the queue
  outside the write's transaction, so two processes could take the same trial);
- every running trial has a heartbeat, from the moment it is taken; a trial whose
  process died (SIGKILL, a lost host) goes stale and is failed by the next worker that
  looks (`fail_stale`);
- a trial *claims* a slot of the study's budget and the policy it measures, then reads
  the study back and steps back if the other claims leave no room, so that the budget
  is exact and no policy is trained twice, however many workers ask at once (`claim`);
- one-off set-up work (the MLflow parent run, the fp32 baseline, the anchors) is done
  by whoever holds the study's set-up lease (`Lease`), renewed while it works; a lease
  that is not renewed lapses, so a set-up cut off by a crash is done again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
import sqlalchemy.exc

try:
    import fcntl
except ImportError:  # Windows: no lock file (one process per sqlite study there)
    fcntl = None  # type: ignore[assignment]
from optuna.trial import FrozenTrial, TrialState

from autoprec._util.files import open_log
from autoprec.errors import StoreError, first_line
from autoprec.settings import options, study_options
from autoprec.study._identity import STUDY_ID_ATTR, new_study_id
from autoprec.study.config import HEARTBEAT_INTERVAL_S
from autoprec.tracking import unwritable
from autoprec.trials import canonical

RECORD_ATTR = "autoprec"  # user attribute: the trial's policy and result, once measured
CLAIM_ATTR = "autoprec.claim"  # user attribute: the key of the policy the trial measures
STEPPED_BACK_ATTR = "stepped_back"  # user attribute: why a trial gave way untrained
LEASE_TTL_S = 60.0
STORAGE_OUTAGE_S = 600.0  # how long storage calls are tried again before the search stops
DIRECTIONS: tuple[Literal["maximize", "minimize"], ...] = ("maximize", "minimize", "minimize")
_CREATE_ATTEMPTS = 5
_SETTLE_S = 1.0  # between writing a lease and reading it back


def worker_id() -> str:
    """This process, as other workers see it."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class _Storage(optuna.storages.RDBStorage):
    """Optuna's relational storage, where a queued trial is taken by one process (on
    sqlite too) and a running trial has a heartbeat from its start.

    Optuna takes a queued trial by reading its state and writing RUNNING if it was
    WAITING. On sqlite the read runs outside the write's transaction, so two processes
    can both read WAITING and both take the trial (PostgreSQL and MySQL lock the row).
    Here the read and write hold a lock file beside the database, one process at a time.

    A trial taken or created running gets its first heartbeat at once: Optuna's stale
    check passes over a running trial with none, so a process killed before its
    heartbeat thread started would leave its trial running for good.

    A sqlite file is written in WAL mode with ``synchronous=NORMAL``: a commit does not
    wait for the disk (a power cut can lose the last trials' records, never the file's
    consistency), which makes Optuna's many small writes several times cheaper.
    """

    def __init__(self, url: str, warn: Callable[[str], None] = print, **kwargs: Any) -> None:
        self.warn = warn
        self.outage_since: float | None = None
        # Threads of one process (the trial loop, a lease's renewal) meet one outage:
        # it begins and ends once, and each is said once.
        self.outage_lock = threading.Lock()
        super().__init__(url, **kwargs)
        database = sqlalchemy.engine.make_url(url).database
        on_file = url.startswith("sqlite") and database not in (None, "", ":memory:")
        self._lock_path = Path(f"{Path(str(database)).resolve()}.queue.lock") if on_file else None
        if on_file:
            sqlalchemy.event.listen(self.engine, "connect", _sqlite_pragmas)
            self.engine.dispose()  # connections made before the listener are gone
            with self.engine.connect() as connection:
                connection.exec_driver_sql("PRAGMA journal_mode=WAL")

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[bool]:
        """Hold the lock file of a sqlite database on this host (one process at a time);
        yields whether there is one (elsewhere, on a database server, there is none)."""
        if self._lock_path is None or fcntl is None:
            yield False
            return
        with open_log(self._lock_path, append=True) as lock:  # never through a link
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
            yield True

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        if state != TrialState.RUNNING:
            return super().set_trial_state_values(trial_id, state, values)
        with self.exclusive():
            taken = super().set_trial_state_values(trial_id, state, values)
            if taken:
                self._first_heartbeat(trial_id)
        return taken

    def _create_new_trial(
        self, study_id: int, template_trial: FrozenTrial | None = None
    ) -> FrozenTrial:
        # Optuna's cached storage (around this one in every study) calls this, not
        # create_new_trial.
        trial = super()._create_new_trial(study_id, template_trial)
        if trial.state == TrialState.RUNNING:
            self._first_heartbeat(trial._trial_id)
        return trial

    def _first_heartbeat(self, trial_id: int) -> None:
        if self.heartbeat_interval is not None:
            self.record_heartbeat(trial_id)


# The errors among which _connection_lost finds an outage.
_DATABASE_ERRORS = (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError)


def _connection_lost(error: BaseException) -> bool:
    """Whether an error says the database is out of reach (a server restarting, a
    network cut, a sqlite file locked for long), not that a request was wrong."""
    lost = (
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        sqlalchemy.exc.PendingRollbackError,  # a session whose connection dropped mid-way
    )
    if isinstance(error, (*lost, sqlalchemy.exc.DisconnectionError)):
        return True
    cause = error.__cause__
    return isinstance(error, optuna.exceptions.StorageInternalError) and isinstance(cause, lost)


def _outage_goes_on(storage: _Storage, error: BaseException) -> None:
    """A call found the database out of reach: the outage begins (said once), or has
    lasted too long (a StoreError)."""
    with storage.outage_lock:
        now = time.monotonic()
        if storage.outage_since is None:
            storage.outage_since = now
            storage.warn(
                f"the Optuna storage is unreachable ({first_line(error, 200)}); "
                f"trying again for up to {STORAGE_OUTAGE_S:.0f} s (Ctrl-C to stop)"
            )
        elif now - storage.outage_since > STORAGE_OUTAGE_S:
            raise StoreError(
                f"the Optuna storage was unreachable for {STORAGE_OUTAGE_S:.0f} s "
                f"({first_line(error, 200)}); run the same command again to continue"
            ) from None


def _retrying(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of the storage, tried again while the database is out of reach: one
    warning when it goes, one when it answers again, a StoreError after STORAGE_OUTAGE_S.
    Nothing is lost or made twice by trying again that the study does not already
    survive: a trial created twice is failed by heartbeat, a queued one measured twice
    is a duplicate (not counted)."""

    @functools.wraps(method)
    def retried(self: _Storage, *args: Any, **kwargs: Any) -> Any:
        wait_s = 1.0
        while True:
            try:
                result = method(self, *args, **kwargs)
            except _DATABASE_ERRORS as error:  # any other error propagates as it is
                cause = error.__cause__ or error  # Optuna wraps the database's own error
                if unwritable(cause):  # a full disk is no outage: waiting frees nothing
                    raise StoreError(
                        f"the Optuna storage cannot be written ({first_line(cause, 200)}); "
                        "free some space (or make it writable), then run the same command "
                        "again to continue"
                    ) from None
                if not _connection_lost(error):
                    raise
                self.scoped_session.remove()  # the next try starts on a fresh session
                _outage_goes_on(self, error)
                time.sleep(wait_s)
                wait_s = min(2 * wait_s, 30.0)
                continue
            if self.outage_since is not None:
                with self.outage_lock:
                    if self.outage_since is not None:
                        self.outage_since = None
                        self.warn("the Optuna storage answers again; the search goes on")
            return result

    return retried


# Every storage call the study makes (Optuna's cache in front of it calls some private
# ones), tried again through an outage.
for _name in (
    *(n for n in dir(optuna.storages.BaseStorage) if not n.startswith("_")),
    "record_heartbeat",
    "_get_stale_trial_ids",
    "_create_new_trial",
    "_get_trials",
    "_get_best_trial_id",
    "_set_trial_param",
):
    if callable(getattr(_Storage, _name, None)):
        setattr(_Storage, _name, _retrying(getattr(_Storage, _name)))


def _sqlite_pragmas(connection: Any, record: Any) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def open_storage(
    url: str,
    heartbeat_s: int = HEARTBEAT_INTERVAL_S,
    on_stale: Callable[[optuna.Study, FrozenTrial], None] | None = None,
    warn: Callable[[str], None] = print,
) -> optuna.storages.RDBStorage:
    """A relational Optuna storage with heartbeats (grace: 3 intervals, at least 3 s),
    whose calls are tried again while the database is out of reach (``warn`` says so);
    on sqlite, a queued trial is handed to one process only."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # Heartbeats serve ask/tell here as they serve study.optimize (see `heartbeat`).
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    logging.getLogger("sqlalchemy").setLevel(logging.WARNING)
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Several processes write one file: wait for the lock rather than fail.
        engine_kwargs["connect_args"] = {"timeout": 120}
    else:
        engine_kwargs["pool_pre_ping"] = True
    for attempt in range(_CREATE_ATTEMPTS):
        try:
            return _Storage(
                url,
                warn,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=heartbeat_s,
                grace_period=max(3, 3 * heartbeat_s),
                heartbeat_stale_trial_callback=on_stale,
            )
        except sqlalchemy.exc.DBAPIError:
            # Several hosts opening a new database at once race to create Optuna's
            # tables; the loser finds them made on the next try.
            if attempt == _CREATE_ATTEMPTS - 1:
                raise
            time.sleep(1.0 + random.random())
    raise AssertionError("unreachable")


def fail_stale(study: optuna.Study) -> None:
    """Fail the trials whose process stopped sending heartbeats (and run the callback)."""
    optuna.storages.fail_stale_trials(study)


@contextlib.contextmanager
def heartbeat(study: optuna.Study, trial: optuna.Trial) -> Iterator[None]:
    """Record the trial's heartbeat in the background while the block runs. A heartbeat
    that cannot be written (the database restarting) is written at the next beat: an
    outage shorter than the grace leaves the trial alive."""
    storage = _relational(study)
    if storage is None or storage.heartbeat_interval is None:
        yield
        return
    stop = threading.Event()
    trial_id = trial._trial_id  # Optuna's ask/tell has no public trial id

    def beat() -> None:
        while not stop.wait(storage.heartbeat_interval):
            with contextlib.suppress(Exception):
                # optuna's record_heartbeat is wrapped (functools.wraps) with its retry
                storage.record_heartbeat.__wrapped__(storage, trial_id)  # type: ignore[attr-defined]

    thread = threading.Thread(target=beat, name="autoprec-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@dataclass(frozen=True)
class Ledger:
    """The study as the budget sees it: trials measured and recorded, and trials running
    under a claim (their keys), by trial number."""

    recorded: dict[int, FrozenTrial]
    running: dict[int, str]
    trials: dict[int, FrozenTrial]

    @classmethod
    def read(cls, study: optuna.Study) -> Ledger:
        recorded: dict[int, FrozenTrial] = {}
        running: dict[int, str] = {}
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        for t in trials.values():
            if t.state.is_finished() and RECORD_ATTR in t.user_attrs:
                recorded[t.number] = t
            elif t.state == TrialState.RUNNING and CLAIM_ATTR in t.user_attrs:
                running[t.number] = t.user_attrs[CLAIM_ATTR]
        return cls(recorded, running, trials)


@dataclass(frozen=True)
class Claim:
    """What reading the study back after claiming says about a trial."""

    duplicate_of: int | str | None = None  # a trial that measured the same policy
    step_back: str | None = None  # why this trial gives way: "budget" or "policy running"


def claim(
    study: optuna.Study,
    trial: optuna.Trial,
    key: str,
    budget: int,
    measured: Callable[[FrozenTrial], str],
    baseline_key: str,
) -> Claim:
    """Claim a slot of the budget and the policy ``key`` for ``trial``.

    The claim is written first and the study read after, and every other running claim
    counts against it, whatever its number. Of several workers claiming at once, the
    last to write sees all the others; so no more trials go ahead than the budget
    allows, and no policy is trained twice (at worst, all of them step back and ask
    again). A policy counts as a duplicate only once it was measured.
    """
    trial.set_user_attr(CLAIM_ATTR, key)
    ledger = Ledger.read(study)
    if key == baseline_key:
        return Claim(duplicate_of="baseline")
    for number, t in sorted(ledger.recorded.items()):
        if measured(t) == key:
            return Claim(duplicate_of=number)
    others = {n: k for n, k in ledger.running.items() if n != trial.number}
    if key in others.values():  # not a duplicate yet: that trial may still fail or die
        return Claim(step_back="policy running")
    if len(ledger.recorded) + len(others) >= budget:
        return Claim(step_back="budget")
    return Claim()


class Lease:
    """A named lease on one-off work in a study, held by one worker at a time.

    Optuna's storage has no compare-and-set. On a sqlite file, the lease is read and
    written under the database's lock file, which makes it exact. On a database server,
    it is written and read back after a short settle: of two workers taking it at once,
    both read the same last writer. The holder renews it in the background; a lease not
    renewed for ``ttl_s`` lapses.
    """

    def __init__(self, study: optuna.Study, name: str, owner: str, ttl_s: float = LEASE_TTL_S):
        self.study = study
        self.key = f"lease.{name}"
        self.owner = owner
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> str | None:
        """The live holder, if any."""
        lease = self.study.user_attrs.get(self.key)
        if lease and lease.get("until", 0) > time.time():
            return lease.get("owner")
        return None

    def acquire(self) -> bool:
        storage = _relational(self.study)
        with storage.exclusive() if storage is not None else contextlib.nullcontext(False) as exact:
            holder = self.holder()
            if holder is not None and holder != self.owner:
                return False
            self._write()
        if not exact:
            time.sleep(_SETTLE_S)
            if self.holder() != self.owner:
                return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()
        return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.holder() == self.owner:
            self.study.set_user_attr(self.key, {"owner": self.owner, "until": 0})

    def _write(self) -> None:
        self.study.set_user_attr(self.key, {"owner": self.owner, "until": time.time() + self.ttl_s})

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            with contextlib.suppress(Exception):  # a missed renewal only shortens the lease
                self._write()


def _give_id(study: optuna.Study) -> None:
    """The study's random id (`autoprec.study._identity`), written once: on sqlite under
    the database's lock file; on a server, as a lease is, read back after a settle, so
    that of two processes creating the study at once, both read the same last writer."""
    storage = _relational(study)
    with storage.exclusive() if storage is not None else contextlib.nullcontext(False) as exact:
        if STUDY_ID_ATTR not in study.user_attrs:
            study.set_user_attr(STUDY_ID_ATTR, new_study_id())
    if not exact:
        time.sleep(_SETTLE_S)


def _relational(study: optuna.Study) -> _Storage | None:
    """The study's own storage, when it is ours (under Optuna's cache)."""
    storage = study._storage  # Optuna keeps no public reference to it
    storage = getattr(storage, "_backend", storage)
    return storage if isinstance(storage, _Storage) else None


def finished(study: optuna.Study) -> list[FrozenTrial]:
    """Trials that were measured to an end and recorded, by number. Duplicates of
    measured policies, trials over the budget, and trials cut off by an interrupt or a
    crash are not counted."""
    return [t for _, t in sorted(Ledger.read(study).recorded.items())]


def make_sampler(name: str, seed: int, trials: int, worker: int = 0) -> optuna.samplers.BaseSampler:
    """The study's sampler; each worker seeds its own (seed + worker index)."""
    seed += worker
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(
            seed=seed, population_size=max(4, min(20, trials // 2))
        )
    # TPE, also after guidance. constant_liar: a running trial counts as a poor result,
    # so that workers asking at the same time are steered apart.
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=max(4, trials // 3), multivariate=True, constant_liar=True
    )


def stored_study_id(storage: optuna.storages.BaseStorage, name: str) -> str | None:
    """The id of the storage's study of that name (None: no such study, or one made before
    studies had ids)."""
    where = getattr(storage, "url", "the Optuna storage")
    try:
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    except Exception as error:  # whatever the database driver raises
        raise StoreError(f"Optuna storage {where}: {first_line(error)}") from None
    existing = {s.study_name: s for s in summaries}.get(name)
    return None if existing is None else existing.user_attrs.get(STUDY_ID_ATTR)


# The study attribute holding every setting a study was made with (its fingerprint).
FINGERPRINT_ATTR = "autoprec.fingerprint"
# Studies made before the fingerprint kept a setting as an attribute of its own, and only
# where it was away from its default: absent, it was this.
LEGACY_DEFAULTS: dict[str, Any] = {
    "mode": "training",
    "emulated": "",
    "compile": False,
    "trial_schedule": "as-is",
    "nproc_per_trial": 1,
    "parallel": None,
    "backend": None,
    "fp8": None,
}
# The option that sets each fingerprinted setting, for the refusal's line.
_OPTIONS = study_options()
# The keys a fingerprint holds only where they are set (`option`'s ``study_if_set``).
_OPTIONAL = {key for o in options() for key in o.study_if_set}


def refuse_other_settings(
    name: str, where: str, recorded: dict[str, Any], settings: dict[str, Any]
) -> None:
    """A StoreError naming the first setting in which ``settings`` differ from those the
    study ``recorded`` (a setting only one side has differs too), with both values."""
    for key in [*settings, *(k for k in recorded if k not in settings)]:
        old, new = recorded.get(key), settings.get(key)
        if old != new:
            option = _OPTIONS.get(key, key)
            raise StoreError(
                f"study {name!r} in {where} was run with {key}={old!r}, not {new!r} "
                f"({option}); use another --study (say --study {name}-2) for the new "
                "settings, or the same settings"
            )


def _recorded_settings(
    attrs: dict[str, Any], settings: dict[str, Any], legacy: dict[str, Any]
) -> tuple[dict[str, Any], bool]:
    """The settings an existing study was made with, and whether its fingerprint is to be
    recorded again. A study made before the fingerprint: those it recorded as attributes
    of their own, the defaults of those it left out (`LEGACY_DEFAULTS`), and what its
    summary.json says of others (``legacy``). A study whose fingerprint predates some of
    the settings now in it: those as its summary.json says. A setting none of them knows
    is taken as given, and recorded now."""
    fingerprint = attrs.get(FINGERPRINT_ATTR)
    if isinstance(fingerprint, dict):
        # (a key recorded only where set was not set: it is not a later one)
        later = [k for k in settings if k not in fingerprint and k not in _OPTIONAL]
        known = {**fingerprint, **{k: legacy.get(k, settings[k]) for k in later}}
        return _current_names(known), bool(later)
    known = {**LEGACY_DEFAULTS, **legacy}
    known.update({k: attrs[k] for k in settings if attrs.get(k) is not None})
    return _current_names({k: known.get(k, settings[k]) for k in settings}), True


def _current_names(recorded: dict[str, Any]) -> dict[str, Any]:
    """The recorded settings with the mode under its name now (a study made with
    ``--mode inference`` is a serving study)."""
    if "mode" not in recorded:
        return recorded
    return {**recorded, "mode": canonical(recorded["mode"])}


def open_study(
    name: str,
    storage: optuna.storages.BaseStorage,
    sampler: optuna.samplers.BaseSampler,
    settings: dict[str, Any],
    objectives: Sequence[str] = ("accuracy", "peak_memory_mb", "step_time_ms"),
    legacy: dict[str, Any] | None = None,
) -> optuna.Study:
    """Create the study, or load it when it exists and was run with the same settings:
    every setting that changes what a trial measures (``settings``, recorded when the
    study is made as the attribute `FINGERPRINT_ATTR`, and each as an attribute of its
    own). A study made before the fingerprint is checked on what it recorded then
    (``legacy``: what its summary.json says of the rest) and given one."""
    where = getattr(storage, "url", "the Optuna storage")
    record = False
    try:
        existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage)}.get(name)
        if existing is not None:
            recorded, record = _recorded_settings(existing.user_attrs, settings, legacy or {})
            refuse_other_settings(name, where, recorded, settings)
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            sampler=sampler,
            directions=list(DIRECTIONS),
            load_if_exists=True,
        )
    except StoreError:
        raise
    except Exception as error:  # whatever the database driver raises
        raise StoreError(f"Optuna storage {where}: {first_line(error)}") from None
    if existing is None or record:
        for key, value in settings.items():
            if study.user_attrs.get(key) is None:
                study.set_user_attr(key, value)
        study.set_user_attr(FINGERPRINT_ATTR, settings)
    if STUDY_ID_ATTR not in study.user_attrs:  # new, or made before studies had ids
        _give_id(study)
    if study.metric_names is None:  # optuna-dashboard then names the Pareto plot's axes
        study.set_metric_names(list(objectives))  # the mode's (`Trials.objectives`)
    return study
