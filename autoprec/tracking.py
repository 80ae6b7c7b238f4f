"""MLflow: one experiment per study, one parent run per search, one child run per trial.

Each trial is logged with one ``log_batch`` call (params, metrics) after the run is
created with its tags, plus its policy YAML as an artifact. The parent carries the
search settings as params, the best policy and summary as artifacts, the best trial's
metrics as ``best.<metric>``, and the tag ``autoprec.best_run_id`` naming the best child.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from autoprec.errors import StoreError, first_line
from autoprec.policy import Policy
from autoprec.trial import TrialResult

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from autoprec.profile import Profile

DEFAULT_TRACKING_URI = "sqlite:///runs/mlflow.db"
ROLE_TAG = "autoprec.role"
BEST_TAG = "autoprec.best_run_id"
STUDY_TAG = "autoprec.study"
POLICY_ARTIFACT = "policy.yaml"
LAYERS_ARTIFACT = "telemetry_layers.csv"
MAX_CURVE_POINTS = 400  # per curve, so that one log_batch stays under MLflow's 1000
BEST_POLICY_ARTIFACT = "best_policy.yaml"
SUMMARY_ARTIFACT = "summary.json"
_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "databricks")


def check_tracking_uri(uri: str) -> str:
    """Refuse a URI MLflow would not understand, before anything is written."""
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme not in _SCHEMES:
        raise StoreError(
            f"--tracking-uri {uri!r}: unsupported scheme (expected sqlite:///path, "
            "http(s)://host:port, postgresql://..., or file:///path)"
        )
    return uri


def absolute_sqlite_uri(uri: str) -> str:
    """``sqlite:///runs/x.db`` made absolute: relative paths would follow the working
    directory, and MLflow caches its stores by URI within a process."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = uri.removeprefix(prefix)
        if path and path != ":memory:":
            return prefix + str(Path(path).resolve())
    return uri


def mlflow_client(uri: str) -> MlflowClient:
    """An MLflow client for the URI (sqlite paths made absolute), quiet: no telemetry,
    no progress bars, warnings only."""
    # No usage telemetry and no download progress bars from MLflow.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)

    uri = absolute_sqlite_uri(uri)
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def _is_local(uri: str) -> bool:
    return urlparse(uri).scheme.split("+")[0] in ("sqlite", "file", "postgresql", "mysql")


class Tracker:
    """Writes one study's runs to an MLflow tracking store."""

    def __init__(self, tracking_uri: str, study: str, artifact_root: Path) -> None:
        """Connect and look the experiment up; nothing is written yet."""
        self.uri = tracking_uri
        self.study = study
        self.artifact_root = artifact_root
        try:
            self.client = mlflow_client(tracking_uri)
            self._experiment = self.client.get_experiment_by_name(study)
        except Exception as error:
            raise StoreError(f"MLflow store {tracking_uri}: {_first_line(error)}") from None

    def _experiment_id(self) -> str:
        """The study's experiment, created on first use with its artifacts under runs/."""
        experiment = self._experiment or self.client.get_experiment_by_name(self.study)
        self._experiment = experiment
        if experiment is None:
            location = None
            if _is_local(self.uri):
                location = (self.artifact_root / "mlartifacts" / self.study).resolve().as_uri()
            try:
                experiment_id = self.client.create_experiment(
                    self.study, artifact_location=location
                )
                self._experiment = self.client.get_experiment(experiment_id)
            except Exception:  # another host of the same search created it a moment ago
                self._experiment = self.client.get_experiment_by_name(self.study)
                if self._experiment is None:
                    raise
        elif experiment.lifecycle_stage == "deleted":
            self.client.restore_experiment(experiment.experiment_id)
            self._experiment = self.client.get_experiment(experiment.experiment_id)
        return self._experiment.experiment_id

    def start_parent(self, run_id: str | None, params: dict[str, Any]) -> str:
        """Create the study's parent run, or reopen it when the study is continued."""
        from mlflow.entities import Param

        if run_id is not None and self.has_run(run_id):
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        run = self.client.create_run(
            self._experiment_id(),
            run_name=f"search-{self.study}",
            tags={ROLE_TAG: "parent", STUDY_TAG: self.study},
        )
        self.client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])
        return run.info.run_id

    def has_run(self, run_id: str) -> bool:
        """Whether this store holds the run (a study continued against another MLflow
        store gets a parent run of its own there)."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise StoreError(f"MLflow store {self.uri}: {_first_line(error)}") from None
        return run.info.lifecycle_stage == "active"

    def start_child(self, parent_run_id: str, run_name: str, tags: dict[str, str]) -> str:
        """A child run, opened when its trial starts (so that a trial cut off by a crash
        leaves a run that can be closed as KILLED)."""
        run = self.client.create_run(
            self._experiment_id(),
            run_name=run_name,
            tags={"mlflow.parentRunId": parent_run_id, STUDY_TAG: self.study, **tags},
        )
        return run.info.run_id

    def log_trial(
        self,
        run_id: str,
        params: dict[str, str],
        result: TrialResult,
        extra_metrics: dict[str, float],
        tags: dict[str, str],
        policy: Policy,
    ) -> str:
        """Fill in and close a child run: one batch of tags, params, metrics and the
        per-step ``train_loss`` and ``loss_scale`` curves; the policy and the per-layer
        telemetry table as artifacts; then closed (FAILED for a failed trial)."""
        from mlflow.entities import Metric, Param, RunTag

        timestamp_ms = int(time.time() * 1000)
        # Every child gets every metric name, NaN where a pruned or failed trial measured
        # nothing, so that MLflow's compare and chart views line up.
        values = dict.fromkeys((*TrialResult.METRICS, "accuracy_drop"), float("nan"))
        values.update({**result.metrics(), **extra_metrics})
        metrics = [Metric(k, float(v), timestamp_ms, 0) for k, v in values.items()]
        stride = max(1, -(-len(result.losses) // MAX_CURVE_POINTS))
        for step in range(0, len(result.losses), stride):
            for key, values in (("train_loss", result.losses), ("loss_scale", result.loss_scales)):
                if math.isfinite(values[step]):
                    metrics.append(Metric(key, float(values[step]), timestamp_ms, step))
        self.client.log_batch(
            run_id,
            metrics=metrics,
            params=[Param(k, str(v)) for k, v in params.items()],
            tags=[RunTag(k, v) for k, v in tags.items()],
        )
        self.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
        layers = result.telemetry.get("layers") if result.telemetry else None
        if layers:
            self.client.log_text(run_id, layers_csv(layers), LAYERS_ARTIFACT)
        self.client.set_terminated(run_id, "FAILED" if result.state == "failed" else "FINISHED")
        return run_id

    def finish_parent(
        self,
        parent_run_id: str,
        best_run_id: str | None,
        best_metrics: dict[str, float],
        best_policy_path: Path,
        summary_path: Path,
        status: str = "FINISHED",
    ) -> None:
        from mlflow.entities import Metric, RunTag

        timestamp_ms = int(time.time() * 1000)
        tags = [RunTag(BEST_TAG, best_run_id)] if best_run_id else []
        self.client.log_batch(
            parent_run_id,
            metrics=[Metric(f"best.{k}", v, timestamp_ms, 0) for k, v in best_metrics.items()],
            tags=tags,
        )
        self.client.log_artifact(parent_run_id, str(best_policy_path))
        self.client.log_artifact(parent_run_id, str(summary_path))
        self.client.set_terminated(parent_run_id, status)

    def log_files(self, run_id: str, files: list[Path], folder: str) -> None:
        """Attach files to a run under ``folder`` (the report on the parent run)."""
        try:
            for path in files:
                self.client.log_artifact(run_id, str(path), folder)
        except Exception as error:
            raise StoreError(f"MLflow store {self.uri}: {_first_line(error)}") from None

    def mark_children(
        self, pareto_run_ids: set[str], best_run_id: str | None, child_run_ids: list[str]
    ) -> None:
        """Tag every child with its Pareto membership and whether it is the chosen one."""
        from mlflow.entities import RunTag

        for run_id in child_run_ids:
            if not self.has_run(run_id):
                continue  # logged to another MLflow store by an earlier search of the study
            self.client.log_batch(
                run_id,
                tags=[
                    RunTag("pareto", str(run_id in pareto_run_ids).lower()),
                    RunTag("best", str(run_id == best_run_id).lower()),
                ],
            )

    def log_profile(self, profile: Profile, path: Path, parent_run_id: str | None = None) -> str:
        """A sensitivity profile (``profile.json``, and the three riskiest modules as tags
        ``risk.1`` to ``risk.3``): on the parent run of the search that made it, or on a
        ``profile`` run of its own from ``autoprec profile``. Never a child run: every
        child is a trial, with the same params and metrics."""
        from mlflow.entities import Metric, RunTag

        run_id = parent_run_id
        if run_id is None:
            tags = {ROLE_TAG: "profile", STUDY_TAG: self.study}
            run_id = self.client.create_run(
                self._experiment_id(), run_name="profile", tags=tags
            ).info.run_id
        self.client.log_batch(
            run_id,
            metrics=[Metric("profile_time_s", profile.time_s, int(time.time() * 1000), 0)],
            tags=[
                RunTag(f"risk.{m.rank}", f"{m.name}: {m.reason}"[:4000])
                for m in profile.modules[:3]
            ],
        )
        self.client.log_artifact(run_id, str(path))
        if parent_run_id is None:
            self.client.set_terminated(run_id, "FINISHED")
        return run_id

    def end_parent(self, parent_run_id: str, status: str) -> None:
        self.client.set_terminated(parent_run_id, status)

    def close_if_open(self, run_id: str, reason: str) -> bool:
        """Close a run still RUNNING as KILLED (a trial failed before its run was closed,
        e.g. when the store was down as its worker died); whether it was open."""
        if not self.has_run(run_id) or self.client.get_run(run_id).info.status != "RUNNING":
            return False
        self.close_killed(run_id, reason)
        return True

    def close_killed(self, run_id: str, reason: str) -> None:
        """Close the child run of a trial that never finished (interrupted, or its worker
        died), with the reason as a tag."""
        from mlflow.entities import RunTag

        if not self.has_run(run_id):
            return
        self.client.log_batch(
            run_id, tags=[RunTag("state", "killed"), RunTag("reason", reason[:4000])]
        )
        self.client.set_terminated(run_id, "KILLED")


def layers_csv(layers: list[dict[str, Any]]) -> str:
    """The per-layer telemetry as CSV, one row per layer."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(layers[0]))
    writer.writeheader()
    writer.writerows(layers)
    return buffer.getvalue()


def find_parent_run(client: MlflowClient, study: str, uri: str) -> Any:
    experiment = client.get_experiment_by_name(study)
    if experiment is None:
        raise StoreError(f"study {study!r}: no MLflow experiment of that name in {uri}")
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{ROLE_TAG}` = 'parent' and attributes.status = 'FINISHED'",
        order_by=["attributes.end_time DESC"],
    )
    runs = [r for r in runs if BEST_TAG in r.data.tags]
    if not runs:
        raise StoreError(f"study {study!r}: no finished search in {uri}")
    return runs[0]


def load_best_policy(study: str, tracking_uri: str = DEFAULT_TRACKING_URI) -> Policy:
    """The best policy of a finished search, read back from MLflow."""
    check_tracking_uri(tracking_uri)
    local = absolute_sqlite_uri(tracking_uri)
    if local.startswith("sqlite:///") and not Path(local.removeprefix("sqlite:///")).is_file():
        raise StoreError(f"MLflow store {tracking_uri}: no such database file")
    try:
        client = mlflow_client(tracking_uri)
        parent = find_parent_run(client, study, tracking_uri)
        with tempfile.TemporaryDirectory() as folder:
            path = client.download_artifacts(parent.info.run_id, BEST_POLICY_ARTIFACT, folder)
            text = Path(path).read_text()
    except StoreError:
        raise
    except Exception as error:
        raise StoreError(
            f"study {study!r}: cannot read {BEST_POLICY_ARTIFACT} from {tracking_uri} "
            f"({_first_line(error)})"
        ) from None
    return Policy.from_yaml(text, f"{tracking_uri} {study}/{BEST_POLICY_ARTIFACT}")


def _first_line(error: BaseException) -> str:
    return first_line(error) or type(error).__name__
