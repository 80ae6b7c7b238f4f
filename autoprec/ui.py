"""Where ``autoprec ui`` lands: a study's runs table, trials flat, its metrics as columns.

MLflow 3 opens an experiment on the GenAI Overview: the sidebar's workflow switch lives
in the browser's localStorage and defaults to GenAI (mlflow/mlflow#24498), whatever the
experiment's ``mlflow.experimentKind`` tag says. Its runs table also folds child runs
under their parent and shows no metric column until one is picked. The UI honours two
things in a URL, though: ``workflowType=machine_learning``, which beats localStorage, and
``viewStateShareKey=K``, which loads the table's state (filter, order, columns) from the
experiment tag ``mlflow.sharedViewState.K``, MLflow's own "share this view". So the view is
written into that tag, and the URL names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from autoprec.errors import StoreError, first_line, redact

SHARED_VIEW_TAG = "mlflow.sharedViewState."  # MLflow's prefix; the key follows it
VIEW_KEY = "autoprec"
# The metrics a reader looks at first; the others follow in their own order.
LEADING_METRICS = (
    "accuracy",
    "accuracy_drop",
    "step_time_ms",
    "latency_p50_ms",
    "throughput_per_s",
    "peak_memory_mb",
)
OUTCOME_TAGS = ("state", "feasible", "pareto", "best")
MAX_VIEW_CHARS = 4500  # MLflow keeps experiment tag values up to 5000 characters
COLUMN_WIDTH_PX = 130
NAME_WIDTH_PX = 300


@dataclass(frozen=True)
class RunsView:
    """A study's runs table in the MLflow UI: its experiment, and the URL path (after the
    server's address) that opens it with the trials and their metrics shown."""

    study: str
    experiment_id: str
    columns: tuple[str, ...]

    @property
    def path(self) -> str:
        return (
            f"/#/experiments/{self.experiment_id}/runs"
            f"?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
        )


def check_store_exists(tracking_uri: str) -> None:
    """A local sqlite store must exist: opening one creates it, and a typo would then
    show an empty UI instead of the user's studies."""
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix) and not Path(tracking_uri.removeprefix(prefix)).is_file():
        raise StoreError(
            f"--tracking-uri {redact(tracking_uri)}: no such store (run autoprec search first)"
        )


def find_runs_view(tracking_uri: str, study: str | None) -> RunsView | None:
    """The study's table view (``study`` None: the study searched last); None where the
    store holds no study yet. Reads only."""
    from autoprec.tracking import ROLE_TAG

    experiment = _call(tracking_uri, _experiment, study, ROLE_TAG)
    if experiment is None:
        return None
    runs = _call(
        tracking_uri,
        "search_runs",
        [experiment.experiment_id],
        filter_string=_table_filter(ROLE_TAG),
        max_results=50,
    )
    return RunsView(experiment.name, experiment.experiment_id, _columns(runs))


def write_runs_view(tracking_uri: str, view: RunsView) -> None:
    """Keep the view in the experiment's tag that the UI reads it from."""
    from autoprec.tracking import ROLE_TAG

    state = json.dumps(_view_state(view.columns, ROLE_TAG), separators=(",", ":"))
    _call(tracking_uri, "set_experiment_tag", view.experiment_id, SHARED_VIEW_TAG + VIEW_KEY, state)


def _call(tracking_uri: str, what: Any, *args: Any, **kwargs: Any) -> Any:
    """A client method (by name) or a function of the client, its failures one line."""
    from autoprec.tracking import mlflow_client

    try:
        client = mlflow_client(tracking_uri)
        if isinstance(what, str):
            return getattr(client, what)(*args, **kwargs)
        return what(client, *args, **kwargs)
    except StoreError:
        raise
    except Exception as error:  # the store is unreachable or not MLflow's
        raise StoreError(f"--tracking-uri {redact(tracking_uri)}: {first_line(error)}") from None


def _table_filter(role_tag: str) -> str:
    """The baseline and the trials: not the parent run, nor a profile's run."""
    return f"tags.`{role_tag}` != 'parent' AND tags.`{role_tag}` != 'profile'"


def _experiment(client: Any, study: str | None, role_tag: str) -> Any:
    """The study's experiment; without a name, the experiment of the newest search."""
    if study is not None:
        experiment = client.get_experiment_by_name(study)
        if experiment is None:
            names = [e.name for e in client.search_experiments()]
            close = get_close_matches(study, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise StoreError(f"--study {study!r}: no such study in this tracking store{hint}")
        return experiment
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return None
    newest = client.search_runs(
        experiments,
        filter_string=f"tags.`{role_tag}` = 'parent'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return client.get_experiment(newest[0].info.experiment_id) if newest else None


def _columns(runs: list[Any]) -> tuple[str, ...]:
    """The table's columns in MLflow's keys: every metric the trials logged (the leading
    ones first), the policy's per-group dtypes, and each trial's outcome."""
    metrics: dict[str, None] = {}
    params: dict[str, None] = {}
    tags: set[str] = set()
    for run in runs:
        metrics.update(dict.fromkeys(sorted(run.data.metrics)))
        params.update(dict.fromkeys(sorted(k for k in run.data.params if k.startswith("dtype."))))
        tags.update(run.data.tags)
    ordered = [m for m in LEADING_METRICS if m in metrics]
    ordered += [m for m in metrics if m not in ordered]
    return (
        *(f"metrics.`{m}`" for m in ordered),
        *(f"params.`{p}`" for p in params),
        *(f"tags.`{t}`" for t in OUTCOME_TAGS if t in tags),
    )


def _view_state(columns: tuple[str, ...], role_tag: str) -> dict[str, Any]:
    """MLflow's shared view state: a filter (which also lays the children out flat, as
    the UI nests them only when nothing is filtered), the order, the columns and their
    widths; trimmed from the end to fit an experiment tag."""
    name = "attributes.`Run Name`"
    kept = list(columns)
    while True:
        state = {
            "searchFilter": _table_filter(role_tag),
            "orderByKey": "tags.`mlflow.runName`",
            "orderByAsc": True,
            "selectedColumns": [name, *kept],
            "columnOrder": [name, *kept],
            "columnWidths": {name: NAME_WIDTH_PX, **dict.fromkeys(kept, COLUMN_WIDTH_PX)},
        }
        if len(json.dumps(state, separators=(",", ":"))) <= MAX_VIEW_CHARS or not kept:
            return state
        kept.pop()
