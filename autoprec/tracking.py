"""MLflow: one experiment per study, one parent run per study, one child run per trial.

The Optuna study is the record of what was measured; MLflow is where people compare the
trials. So tracking never holds a search up: a `Tracker` writes from a background thread,
in order, with short timeouts on a tracking server. When the store stops answering,
one warning says so and the trials go on; the writes wait and are retried until it
answers again, and what a search could not write before it ended is written by the
next run of the study (`Tracker.catch_up`). Runs are found by their tags (the study's
parent; one child per trial number, and the baseline), so a write that is retried, or
made again by a later run, never creates a second run.

Each trial is logged with one ``log_batch`` call (tags, params, metrics and the loss and
loss-scale curves; more calls only past MLflow's 1,000 entities a call, as many
optimizer-state groups can take), its policy YAML and telemetry table as artifacts, and
closed. The
parent carries the search settings as params, the best policy and summary as
artifacts (and, for a serving study, the chosen model as the MLflow model ``model``), the
best trial's metrics as ``best.<metric>``, and the tag ``autoprec.best_run_id`` naming the
best child.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from autoprec.errors import StoreError, first_line, redact
from autoprec.policy import Policy
from autoprec.settings import check_tracking_uri as check_tracking_uri
from autoprec.trials.base import Result, TrialState

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

    from autoprec.profile.sensitivity import Profile

DEFAULT_TRACKING_URI = "sqlite:///runs/mlflow.db"
ROLE_TAG = "autoprec.role"
BEST_TAG = "autoprec.best_run_id"
STUDY_TAG = "autoprec.study"
KEY_TAG = "autoprec.key"  # a child's trial number, or "baseline": how it is found again
LOGGED_TAG = "autoprec.logged"  # "true" once a child holds everything its trial measured
KIND_TAG = "mlflow.experimentKind"  # MLflow 3: the UI opens a training experiment on runs
KIND = "custom_model_development"
POLICY_ARTIFACT = "policy.yaml"
MAX_CURVE_POINTS = 400  # per curve, so that one log_batch usually holds a trial's all
MAX_ENTITIES = 1000  # MLflow's limits per log_batch: metrics, params and tags together
MAX_PARAMS_TAGS = 100  # ... and params, and tags, each
BEST_POLICY_ARTIFACT = "best_policy.yaml"
SUMMARY_ARTIFACT = "summary.json"
# A tracking server's requests: bounded, so that an outage is noticed in seconds, not
# after MLflow's default of 7 retries with exponential backoff (minutes per request).
HTTP_TIMEOUT_S = 10
HTTP_RETRIES = 2
RETRY_WAIT_S = (1.0, 30.0)  # between attempts while the store is unreachable: first, most
FLUSH_WAIT_S = 30.0  # how long the end of a search waits for writes still queued
# ... and after a Ctrl-C, which promises a prompt exit: what is left is written by the
# next run of the study.
INTERRUPTED_FLUSH_S = 5.0


def absolute_sqlite_uri(uri: str) -> str:
    """``sqlite:///runs/x.db`` made absolute: relative paths would follow the working
    directory, and MLflow caches its stores by URI within a process."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = uri.removeprefix(prefix)
        if path and path != ":memory:":
            return prefix + str(Path(path).resolve())
    return uri


def holds_nothing(uri: str) -> bool:
    """Whether the store is a local sqlite file that does not exist yet: it holds no run,
    and reading it would only make it (MLflow's import and its tables, seconds of a
    search's start), which the writer thread does beside the set-up instead."""
    uri = absolute_sqlite_uri(uri)
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return False
    return not Path(uri.removeprefix("sqlite:///")).exists()


def mlflow_client(uri: str) -> MlflowClient:
    """An MLflow client for the URI (sqlite paths made absolute), quiet (no telemetry, no
    progress bars, warnings only) and, on a server, with short request timeouts."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(HTTP_TIMEOUT_S))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(HTTP_RETRIES))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    # MLflow prints a "View run ... at <URL>" line for every closed run on a server.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    uri = _credentials_to_environment(uri)
    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Its database layer logs every failed write with a traceback, and every failed
    # connection (ten, over 100 s) with a retry line; the Tracker says so in one line.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    uri = absolute_sqlite_uri(uri)
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    if urlparse(uri).scheme.split("+")[0] in ("postgresql", "mysql"):
        _probe_database(uri)
    return MlflowClient(tracking_uri=uri)


def _probe_database(uri: str) -> None:
    """Connect once, with a short timeout: a database server that is not there raises at
    once, instead of after MLflow's ten attempts to create its engine."""
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(
        uri, poolclass=NullPool, connect_args={"connect_timeout": HTTP_TIMEOUT_S}
    )
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()


def unwritable(error: BaseException) -> bool:
    """Whether a write failed because the store cannot take writes now (a full disk, a
    read-only file), which retrying later may fix, not because the write was wrong."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
        return True
    text = str(error).lower()
    return any(
        words in text
        for words in ("disk is full", "readonly database", "read-only", "no space left")
    )


def _credentials_to_environment(uri: str) -> str:
    """A tracking server's URI without ``user:password@``, which MLflow would show in its
    own messages: the credentials go where MLflow reads them, the variables
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD of this process."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or parsed.password is None:
        return uri
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parsed.username or "")
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parsed.password)
    return parsed._replace(netloc=parsed.netloc.rsplit("@", 1)[1]).geturl()


def _is_local(uri: str) -> bool:
    return urlparse(uri).scheme.split("+")[0] in ("sqlite", "file", "postgresql", "mysql")


def _warn_on_stderr(message: str) -> None:
    print(f"autoprec: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class TrialLog:
    """Everything a trial's child run holds: made from the study's record of the trial,
    so that it can be written again by a later run of the study."""

    key: str  # the trial number, or "baseline"
    name: str
    params: dict[str, str]
    result: Result  # what the trial measured, in its mode's kind (`Trials.result_type`)
    extra_metrics: dict[str, float]
    tags: dict[str, str]
    policy: Policy


@dataclass
class _Job:
    what: str
    work: Callable[[], object]  # its value, if any, is not used
    attempts: int = field(default=0)


class Tracker:
    """Writes one study's runs to an MLflow tracking store from a background thread."""

    def __init__(
        self,
        tracking_uri: str,
        study: str,
        artifact_root: Path,
        warn: Callable[[str], None] = _warn_on_stderr,
    ) -> None:
        """Nothing is connected or written here: the writer thread does it."""
        self.uri = tracking_uri
        self.shown_uri = redact(tracking_uri)  # for messages: its password, if any, hidden
        self.study = study
        self.artifact_root = artifact_root
        self.warn = warn
        self._client: MlflowClient | None = None
        self._experiment_id: str | None = None
        self._parent_id: str | None = None
        self._children: dict[str, str] = {}  # key -> run id, of the runs found or made here
        # The parent run's tags naming the Optuna study it records (set by the session).
        self.parent_tags: dict[str, str] = {}
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._down_since: float | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._write, name="autoprec-tracking", daemon=True)
        self._thread.start()

    # -- the writer -------------------------------------------------------------------------

    def _later(self, what: str, work: Callable[[], object]) -> None:
        self._jobs.put(_Job(what, work))

    def _write(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                self._run(job)
            finally:
                self._jobs.task_done()

    def _run(self, job: _Job) -> None:
        """Do one write; while the store is unreachable, try again with growing waits."""
        wait_s = RETRY_WAIT_S[0]
        while True:
            try:
                job.work()
            except Exception as error:  # MLflow or its store: told apart below
                full = unwritable(error)
                if not full and self._reachable():
                    self.warn(f"MLflow: could not {job.what} ({first_line(error)}); skipped")
                    return
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    what = "cannot be written" if full else "is unreachable"
                    self.warn(
                        f"the MLflow tracking store {self.shown_uri} {what} "
                        f"({_first_line(error)}); the trials go on, recorded in the Optuna "
                        "study, and are logged to MLflow once it answers again (or by the "
                        "next run of this study)"
                    )
                if self._stopping.wait(wait_s):
                    return  # the search is over: the next run of the study catches up
                wait_s = min(2 * wait_s, RETRY_WAIT_S[1])
                continue
            if self._down_since is not None:
                self.warn(f"the MLflow tracking store {self.shown_uri} answers again")
                self._down_since = None
            return

    def _reachable(self) -> bool:
        try:
            self.client.search_experiments(max_results=1)
        except Exception:  # any failure of the probe: unreachable
            self._client = None  # connect afresh once it answers
            return False
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write is done (or ``timeout_s`` passed); whether all
        were done. While the store is unreachable, give up at once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks:
            if self._down_since is not None or (
                deadline is not None and time.monotonic() > deadline
            ):
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout_s: float = FLUSH_WAIT_S) -> bool:
        """Flush, then stop retrying; whether every write was done. What was not is
        written by the next run of the study."""
        done = self.flush(timeout_s)
        if not done and self._down_since is None:  # (a store that is down was said so)
            pending = self._jobs.unfinished_tasks
            self.warn(
                f"{pending} MLflow write(s) could not be done now; the next run of this "
                "study writes them"
            )
        self._stopping.set()
        return done

    # -- runs ---------------------------------------------------------------------------------

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            self._client = mlflow_client(self.uri)
        return self._client

    def _experiment(self) -> str:
        """The study's experiment (artifacts under runs/ for a local store), created on
        first use and tagged as a model-training experiment."""
        if self._experiment_id is not None:
            return self._experiment_id
        client = self.client
        experiment = client.get_experiment_by_name(self.study)
        if experiment is None:
            location = None
            if _is_local(self.uri):
                location = (self.artifact_root / "mlartifacts" / self.study).resolve().as_uri()
            # Another host of the same search may have created it a moment ago.
            with contextlib.suppress(Exception):
                client.create_experiment(
                    self.study, artifact_location=location, tags={KIND_TAG: KIND}
                )
            experiment = client.get_experiment_by_name(self.study)
            if experiment is None:
                raise StoreError(f"MLflow store {self.shown_uri}: cannot create {self.study!r}")
        elif experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        if experiment.tags.get(KIND_TAG) != KIND:
            client.set_experiment_tag(experiment.experiment_id, KIND_TAG, KIND)
        self._experiment_id = experiment.experiment_id
        return self._experiment_id

    def _find(self, filter_string: str) -> Run | None:
        runs = self.client.search_runs(
            [self._experiment()],
            filter_string=filter_string,
            order_by=["attributes.start_time ASC"],
            max_results=1,
        )
        return runs[0] if runs else None

    def _parent(self) -> str:
        """The study's parent run, found by its tags or created."""
        if self._parent_id is None:
            found = self._find(f"tags.`{ROLE_TAG}` = 'parent'")
            if found is None:
                found = self.client.create_run(
                    self._experiment(),
                    run_name=f"search-{self.study}",
                    tags={ROLE_TAG: "parent", STUDY_TAG: self.study, **self.parent_tags},
                )
            self._parent_id = found.info.run_id
        return self._parent_id

    def _existing_child(self, key: str) -> str | None:
        parent = self._parent()
        found = self._find(f"tags.`{KEY_TAG}` = '{key}' and tags.`mlflow.parentRunId` = '{parent}'")
        return None if found is None else found.info.run_id

    def _child(self, key: str, name: str, tags: dict[str, str]) -> str:
        """The child run of a trial (or of the baseline), found by its key or created."""
        if key not in self._children:
            parent = self._parent()
            found = self._existing_child(key)
            if found is None:
                all_tags = {"mlflow.parentRunId": parent, STUDY_TAG: self.study, KEY_TAG: key}
                run = self.client.create_run(
                    self._experiment(), run_name=name, tags={**all_tags, **tags}
                )
                found = run.info.run_id
            self._children[key] = found
        return self._children[key]

    # -- what a search writes -----------------------------------------------------------------

    def start_parent(self, params: dict[str, Any]) -> None:
        """The study's parent run, RUNNING, with the search settings as params."""
        from mlflow.entities import Param, RunTag

        def work() -> None:
            run_id = self._parent()
            self.client.update_run(run_id, status="RUNNING")
            data = self.client.get_run(run_id).data
            fresh = [Param(k, str(v)) for k, v in params.items() if k not in data.params]
            # A parent made before runs named their study gets the tags (never replaced).
            tags = [RunTag(k, v) for k, v in self.parent_tags.items() if k not in data.tags]
            if fresh or tags:
                self.client.log_batch(run_id, params=fresh, tags=tags)

        self._later("open the study's parent run", work)

    def start_trial(self, key: str, name: str, tags: dict[str, str]) -> None:
        """A trial's child run, opened when it starts (so that a trial cut off by a crash
        leaves a run that can be closed as KILLED)."""
        self._later(f"open the run of trial {key}", lambda: self._child(key, name, tags))

    def log_trial(self, log: TrialLog) -> None:
        """Fill in and close a trial's child run (FAILED for a failed trial)."""
        self._later(f"log trial {log.key}", lambda: self._log_trial(log))

    def _log_trial(self, log: TrialLog) -> None:
        from mlflow.entities import Metric, Param, RunTag

        run_id = self._child(log.key, log.name, log.tags)
        timestamp_ms = int(time.time() * 1000)
        # Every child gets every metric name, NaN where a pruned or failed trial measured
        # nothing, so that MLflow's compare and chart views line up.
        result = log.result
        values = dict.fromkeys((*result.METRICS, "accuracy_drop"), float("nan"))
        values.update({**result.metrics(), **result.extra_metrics(), **log.extra_metrics})
        metrics = [Metric(k, float(v), timestamp_ms, 0) for k, v in values.items()]
        curves = result.curves()
        length = max((len(curve) for curve in curves.values()), default=0)
        stride = max(1, -(-length // MAX_CURVE_POINTS))
        for step in range(0, length, stride):
            for key, curve in curves.items():
                if step < len(curve) and math.isfinite(curve[step]):
                    metrics.append(Metric(key, float(curve[step]), timestamp_ms, step))
        logged = self.client.get_run(run_id).data.params
        params = [
            Param(k, str(v))
            for k, v in {**log.params, **result.run_params()}.items()
            if k not in logged
        ]
        tags = [RunTag(k, v) for k, v in log.tags.items()]
        for batch in _batches(metrics, params, tags):
            self.client.log_batch(run_id, **batch)
        self.client.log_text(run_id, log.policy.to_yaml(), POLICY_ARTIFACT)
        for name, text in result.artifacts().items():
            self.client.log_text(run_id, text, name)
        self.client.set_tag(run_id, LOGGED_TAG, "true")
        self.client.set_terminated(
            run_id, "FAILED" if result.state == TrialState.FAILED else "FINISHED"
        )

    def kill_trial(self, key: str, reason: str) -> None:
        """Close the child run of a trial that never finished (interrupted, or its worker
        died) as KILLED, with the reason; a run already closed is left as it is."""

        def work() -> None:
            from mlflow.entities import RunTag

            run_id = self._children.get(key) or self._existing_child(key)
            if run_id is None or self.client.get_run(run_id).info.status != "RUNNING":
                return
            tags = [RunTag("state", "killed"), RunTag("reason", reason[:4000])]
            self.client.log_batch(run_id, tags=tags)
            self.client.set_terminated(run_id, "KILLED")

        self._later(f"close the run of trial {key}", work)

    def log_profile(self, profile: Profile, path: Path, on_parent: bool = True) -> None:
        """A sensitivity profile (``profile.json``, and the three riskiest modules as tags
        ``risk.1`` to ``risk.3``): on the study's parent run, or on a ``profile`` run of
        its own (``autoprec profile``). Never a child run: every child is a trial."""
        from mlflow.entities import Metric, RunTag

        def work() -> None:
            if on_parent:
                run_id = self._parent()
            else:
                tags = {ROLE_TAG: "profile", STUDY_TAG: self.study}
                run = self.client.create_run(self._experiment(), run_name="profile", tags=tags)
                run_id = run.info.run_id
            self.client.log_batch(
                run_id,
                metrics=[Metric("profile_time_s", profile.time_s, int(time.time() * 1000), 0)],
                tags=[
                    RunTag(f"risk.{m.rank}", f"{m.name}: {m.reason}"[:4000])
                    for m in profile.modules[:3]
                ],
            )
            self.client.log_artifact(run_id, str(path))
            if not on_parent:
                self.client.set_terminated(run_id, "FINISHED")

        self._later("log the profile", work)

    def finish_parent(
        self,
        best_key: str | None,
        best_metrics: dict[str, float],
        files: list[Path],
        status: str = "FINISHED",
    ) -> None:
        """The best trial's metrics and run, the summary files, and the closing status."""
        from mlflow.entities import Metric, RunTag

        def work() -> None:
            run_id = self._parent()
            timestamp_ms = int(time.time() * 1000)
            best = self._children.get(best_key or "") or self.run_ids().get(best_key or "")
            self.client.log_batch(
                run_id,
                metrics=[Metric(f"best.{k}", v, timestamp_ms, 0) for k, v in best_metrics.items()],
                tags=[RunTag(BEST_TAG, best)] if best else [],
            )
            for path in files:
                self.client.log_artifact(run_id, str(path))
            self.client.set_terminated(run_id, status)

        self._later("close the study's parent run", work)

    def end_parent(self, status: str) -> None:
        """Close the parent run with this status (a search stopped by an error)."""
        self._later(
            "close the parent run", lambda: self.client.set_terminated(self._parent(), status)
        )

    def mark_children(self, pareto_keys: set[str], best_key: str | None) -> None:
        """Tag every child with its Pareto membership and whether it is the chosen one."""
        from mlflow.entities import RunTag

        def work() -> None:
            for key, run_id in self.run_ids().items():
                self.client.log_batch(
                    run_id,
                    tags=[
                        RunTag("pareto", str(key in pareto_keys).lower()),
                        RunTag("best", str(key == best_key).lower()),
                    ],
                )

        self._later("tag the Pareto front", work)

    def log_model_folder(
        self, folder: Path, name: str = "model", tags: dict[str, str] | None = None
    ) -> None:
        """An MLflow model folder (``mlflow.pytorch.save_model``'s) as the parent run's
        artifact ``name``: ``mlflow.pyfunc.load_model("runs:/<parent>/model")`` loads it.
        ``tags`` on the parent say how it is saved (whether loading it unpickles)."""

        def work() -> None:
            self.client.log_artifacts(self._parent(), str(folder), name)
            for key, value in (tags or {}).items():
                self.client.set_tag(self._parent(), key, value)

        self._later("log the served model", work)

    def log_files(self, run_id: str, files: list[Path], folder: str) -> None:
        """Attach files to a run under ``folder`` (the report on the parent run), now."""
        try:
            for path in files:
                self.client.log_artifact(run_id, str(path), folder)
        except Exception as error:  # MLflow's artifact store: any type
            raise StoreError(f"MLflow store {self.shown_uri}: {_first_line(error)}") from None

    # -- reading back ---------------------------------------------------------------------------

    def run_ids(self) -> dict[str, str]:
        """Every child run of the study's parent, by key (trial number or "baseline")."""
        parent = self._parent()
        runs = self.client.search_runs(
            [self._experiment()],
            filter_string=f"tags.`mlflow.parentRunId` = '{parent}'",
            max_results=50_000,
        )
        found = {r.data.tags[KEY_TAG]: r.info.run_id for r in runs if KEY_TAG in r.data.tags}
        self._children.update(found)
        return found

    @property
    def parent_id(self) -> str | None:
        """The parent run's id, once the writer has found or made it."""
        return self._parent_id

    def catch_up(self, logs: list[TrialLog], killed: dict[str, str]) -> None:
        """Write what earlier runs of the study could not: the trials whose child run
        does not hold everything they measured, and the runs of trials that never
        finished, closed as KILLED."""

        def work() -> None:
            parent = self._parent()
            runs = self.client.search_runs(
                [self._experiment()],
                filter_string=f"tags.`mlflow.parentRunId` = '{parent}'",
                max_results=50_000,
            )
            done = {r.data.tags.get(KEY_TAG) for r in runs if r.data.tags.get(LOGGED_TAG)}
            open_runs = {r.data.tags.get(KEY_TAG) for r in runs if r.info.status == "RUNNING"}
            for log in logs:
                if log.key not in done:
                    self.log_trial(log)
            for key, reason in killed.items():
                if key in open_runs:
                    self.kill_trial(key, reason)

        self._later("catch up with the study", work)


def _batches(metrics: list[Any], params: list[Any], tags: list[Any]) -> list[dict[str, Any]]:
    """Everything a run is given, in as few ``log_batch`` calls as MLflow's limits allow
    (each call costs a transaction: ~10 ms on sqlite): at most ``MAX_PARAMS_TAGS`` params
    and as many tags, and ``MAX_ENTITIES`` entities in all, per call; one call for a
    trial's usual load (its curves, metrics, params and tags)."""
    batches: list[dict[str, Any]] = []
    while metrics or params or tags or not batches:
        batch_params, params = params[:MAX_PARAMS_TAGS], params[MAX_PARAMS_TAGS:]
        batch_tags, tags = tags[:MAX_PARAMS_TAGS], tags[MAX_PARAMS_TAGS:]
        room = MAX_ENTITIES - len(batch_params) - len(batch_tags)
        batch_metrics, metrics = metrics[:room], metrics[room:]
        batches.append({"metrics": batch_metrics, "params": batch_params, "tags": batch_tags})
    return batches


def find_parent_run(client: MlflowClient, study: str, uri: str) -> Any:
    experiment = client.get_experiment_by_name(study)
    if experiment is None:
        raise StoreError(f"study {study!r}: no MLflow experiment of that name in {uri}")
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{ROLE_TAG}` = 'parent' and attributes.status = 'FINISHED'",
        order_by=["attributes.end_time DESC"],
    )
    finished = [r for r in runs if BEST_TAG in r.data.tags]
    if not finished:
        raise StoreError(f"study {study!r}: no finished search in {uri}")
    return finished[0]


def load_best_policy(study: str, tracking_uri: str = DEFAULT_TRACKING_URI) -> Policy:
    """The best policy of a finished search, read back from MLflow."""
    check_tracking_uri(tracking_uri)
    local = absolute_sqlite_uri(tracking_uri)
    database = local.removeprefix("sqlite:///").partition("?")[0]  # less its query
    if local.startswith("sqlite:///") and not Path(database).is_file():
        raise StoreError(f"MLflow store {redact(tracking_uri)}: no such database file")
    try:
        client = mlflow_client(tracking_uri)
        parent = find_parent_run(client, study, tracking_uri)
        with tempfile.TemporaryDirectory() as folder:
            path = client.download_artifacts(parent.info.run_id, BEST_POLICY_ARTIFACT, folder)
            text = Path(path).read_text()
    except StoreError:
        raise
    except Exception as error:  # MLflow or its store: any type
        raise StoreError(
            f"study {study!r}: cannot read {BEST_POLICY_ARTIFACT} from {redact(tracking_uri)} "
            f"({_first_line(error)})"
        ) from None
    return Policy.from_yaml(text, f"{redact(tracking_uri)} {study}/{BEST_POLICY_ARTIFACT}")


def _first_line(error: BaseException) -> str:
    """The line of an error that says what went wrong, password redacted (SQLAlchemy puts
    a line on where the flush happened before the database's own message)."""
    lines = [line for line in str(error).splitlines() if not line.startswith("(raised as")]
    return redact((lines[0][:300] if lines else "") or type(error).__name__)
