"""Two hosts join one study: a real PostgreSQL server holds the Optuna study, and a real
``mlflow server`` (its own PostgreSQL database, an artifact store) collects the runs.

Each "host" is the same command run from its own folder, as on two machines; one of them
runs two workers. .ci/run installs PostgreSQL; without it the test skips with a reason.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from autoprec.study._studies import CLAIM_ATTR, RECORD_ATTR
from autoprec.tracking import KEY_TAG, mlflow_client
from tests.servers import mlflow_server, postgres, postgres_bin

TASKS = Path(__file__).with_name("contract_tasks.py")
CLI = "import sys; from autoprec.cli import main; sys.exit(main(sys.argv[1:]))"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        postgres_bin() is None, reason="PostgreSQL is not installed (apt-get install postgresql)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("psycopg") is None,
        reason="psycopg is not installed (pip install -e '.[postgres]')",
    ),
]


def test_two_hosts_share_one_study_on_postgres_and_an_mlflow_server(tmp_path):
    with (
        postgres(("optuna", "mlflow")) as pg,
        mlflow_server(f"{pg}/mlflow", tmp_path / "artifacts") as tracking_uri,
    ):
        storage = f"{pg}/optuna"
        command = [
            sys.executable,
            "-c",
            CLI,
            "search",
            "--task",
            f"{TASKS}:tiny",
            "--trials",
            "8",
            "--steps",
            "20",
            "--study",
            "shared",
            "--device",
            "cpu",
            "--storage",
            storage,
            "--tracking-uri",
            tracking_uri,
            "--confirm-top",
            "0",
            "--no-progress",
        ]
        hosts = []
        for name, workers in (("host-a", "2"), ("host-b", "1")):
            folder = tmp_path / name
            folder.mkdir()
            hosts.append(
                subprocess.Popen(
                    [*command, "--workers", workers],
                    cwd=folder,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outputs = [h.communicate(timeout=600) for h in hosts]
        for host, (_, err) in zip(hosts, outputs, strict=True):
            assert host.returncode == 0, err[-3000:]

        study = optuna.load_study(study_name="shared", storage=storage)
        recorded = [
            t for t in study.trials if t.state.is_finished() and RECORD_ATTR in t.user_attrs
        ]
        assert len(recorded) == 8  # the budget is the study's, not each host's
        assert len({t.user_attrs[CLAIM_ATTR] for t in recorded}) == 8  # no policy twice
        assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]

        client = mlflow_client(tracking_uri)
        experiment = client.get_experiment_by_name("shared")
        runs = client.search_runs([experiment.experiment_id], max_results=1000)
        parents = [r for r in runs if r.data.tags.get("autoprec.role") == "parent"]
        assert len(parents) == 1  # created once, whoever came first
        parent = parents[0]
        children = [r for r in runs if r is not parent]
        assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children)
        roles = [c.data.tags["autoprec.role"] for c in children]
        assert roles.count("baseline") == 1 and roles.count("trial") == 8
        trials = [c for c in children if c.data.tags["autoprec.role"] == "trial"]
        assert {c.data.tags[KEY_TAG] for c in trials} == {str(t.number) for t in recorded}
        artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
        assert {"best_policy.yaml", "summary.json"} <= artifacts
        assert parent.info.status == "FINISHED"

    # Both hosts wrote the same study's outcome in their own folders.
    for name in ("host-a", "host-b"):
        summary = json.loads((tmp_path / name / "runs/shared/summary.json").read_text())
        assert sorted(t["number"] for t in summary["trials"]) == sorted(t.number for t in recorded)
        assert summary["mlflow_parent_run_id"] == parent.info.run_id
