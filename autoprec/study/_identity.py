"""Which Optuna study a study's outputs and MLflow runs came from.

A study's name alone does not say which study it is: the same ``--study`` with another
``--storage`` (a typo, another database) is a different Optuna study, and its trials must
not overwrite runs/<study>/ or be merged into the MLflow parent run of the first. So
every Optuna study gets a random id when it is created (a study attribute), and
summary.json and the MLflow parent run record it with the storage's URL (password
redacted). A search refuses, before anything is written, to continue outputs or a parent
run that another study made.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoprec.errors import StoreError, redact
from autoprec.tracking import ROLE_TAG, Tracker, absolute_sqlite_uri, holds_nothing
from autoprec.trials.schedule import DEFAULT_TRAIN_STEPS_PER_TRIAL_STEP

STUDY_ID_ATTR = "autoprec.study_id"  # Optuna study attribute: the study's random id
SUMMARY_KEY = "optuna_study"  # summary.json: {"storage": ..., "study_id": ...}
STORAGE_TAG = "autoprec.storage"  # MLflow parent run tags: the same two
STUDY_ID_TAG = "autoprec.study_id"


@dataclass(frozen=True)
class StudyIdentity:
    """An Optuna study as its outputs name it: the storage's URL (absolute for sqlite,
    password redacted) and the study's id (None where outputs older than ids say
    nothing of it)."""

    storage: str
    study_id: str | None

    @classmethod
    def of(cls, storage_url: str, study_id: str | None) -> StudyIdentity:
        return cls(redact(absolute_sqlite_uri(storage_url)), study_id)

    def to_dict(self) -> dict[str, Any]:
        return {"storage": self.storage, "study_id": self.study_id}

    def tags(self) -> dict[str, str]:
        """The MLflow parent run's tags."""
        return {STORAGE_TAG: self.storage, STUDY_ID_TAG: self.study_id or ""}


def new_study_id() -> str:
    return uuid.uuid4().hex


def of_outputs(out_dir: Path) -> StudyIdentity | None:
    """The study that wrote runs/<study>/summary.json (None if there is none, or it cannot
    be read: then nothing is known to be overwritten)."""
    try:
        summary = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict):
        return None
    recorded = summary.get(SUMMARY_KEY)
    if isinstance(recorded, dict) and isinstance(recorded.get("storage"), str):
        study_id = recorded.get("study_id")
        return StudyIdentity(recorded["storage"], study_id if isinstance(study_id, str) else None)
    settings = summary.get("settings")
    storage = settings.get("storage") if isinstance(settings, dict) else None
    return StudyIdentity.of(storage, None) if isinstance(storage, str) else None


# Settings a study's fingerprint holds since they were found to change its records (how
# the best is chosen), which summary.json has recorded all along, under the same names.
CHOICE_SETTINGS = ("accuracy_tolerance", "prefer", "sampler", "confirm_top", "confirm_steps")


def summary_settings(out_dir: Path) -> dict[str, Any]:
    """What runs/<study>/summary.json says of the settings a study made before they were
    fingerprinted did not record in Optuna: its forecast, its real run's length and how
    its best was chosen (`CHOICE_SETTINGS`); empty if there is no readable summary."""
    try:
        summary = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    settings = summary.get("settings") if isinstance(summary, dict) else None
    if not isinstance(settings, dict):
        return {}
    known: dict[str, Any] = {k: settings[k] for k in CHOICE_SETTINGS if k in settings}
    if settings.get("forecast") in ("infeasible", "warn"):
        known["forecast"] = settings["forecast"]
    asked, steps = settings.get("train_steps_asked"), settings.get("steps")
    if "train_steps_asked" in settings and isinstance(steps, int) and isinstance(asked, int | None):
        known["train_steps"] = asked or DEFAULT_TRAIN_STEPS_PER_TRIAL_STEP * steps
    return known


def refuse_other_storage(
    study: str, where: str, recorded: StudyIdentity | None, storage: str
) -> None:
    """A StoreError if ``where`` (the outputs, the MLflow parent run) came from another
    Optuna storage than ``storage`` (as `StudyIdentity.of` writes it)."""
    # Redacted again: outputs written before a form of secret was redacted still match.
    if recorded is not None and redact(recorded.storage) != storage:
        raise StoreError(
            f"study {study!r}: {where} came from the Optuna storage {recorded.storage}, not "
            f"{storage}; use the --storage it was run with, or another --study"
        )


def refuse_other_study(
    study: str, where: str, recorded: StudyIdentity | None, current: StudyIdentity
) -> None:
    """A StoreError if ``where`` came from another Optuna study than ``current`` (whose id
    is None while the study is not created yet): another storage, or another study of
    that name in it (the first was deleted, or its database lost)."""
    refuse_other_storage(study, where, recorded, current.storage)
    if recorded is not None and recorded.study_id not in (None, current.study_id):
        now = "has none of that name" if current.study_id is None else "has another of that name"
        raise StoreError(
            f"study {study!r}: {where} came from an Optuna study that {current.storage} "
            f"no longer holds (it {now}); use another --study, or move {where} away"
        )


def of_parent_run(tracker: Tracker) -> StudyIdentity | None:
    """The study that the MLflow parent run of the tracker's study came from (None if
    there is no parent run yet, or the tracking store cannot be read now: the tracker's
    writer says so, in one line)."""
    if holds_nothing(tracker.uri):  # a new store: no run in it, and nothing to wait for
        return None
    try:
        client = tracker.client
        experiment = client.get_experiment_by_name(tracker.study)
        if experiment is None:
            return None
        runs = client.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.`{ROLE_TAG}` = 'parent'",
            order_by=["attributes.start_time ASC"],
            max_results=1,
        )
    except Exception:  # an unreachable MLflow store: no parent known
        return None
    if not runs:
        return None
    tags, params = runs[0].data.tags, runs[0].data.params
    if STORAGE_TAG in tags:
        return StudyIdentity(tags[STORAGE_TAG], tags.get(STUDY_ID_TAG) or None)
    return StudyIdentity.of(params["storage"], None) if "storage" in params else None
