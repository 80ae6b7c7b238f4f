"""A search outlives its servers and keeps its secrets, against real servers on loopback:
an ``mlflow server`` killed with SIGKILL and started again mid-search, a PostgreSQL
server restarted mid-search, and password-bearing URLs for both.

.ci/run installs PostgreSQL; without it the PostgreSQL tests skip with a reason.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest

from autoprec.study._studies import CLAIM_ATTR, RECORD_ATTR
from autoprec.tracking import KEY_TAG, mlflow_client
from tests.servers import mlflow_process, postgres_bin, postgres_server

TASKS = Path(__file__).with_name("contract_tasks.py")
CLI = "import sys; from autoprec.cli import main; sys.exit(main(sys.argv[1:]))"
requires_postgres = pytest.mark.skipif(
    postgres_bin() is None or importlib.util.find_spec("psycopg") is None,
    reason="PostgreSQL or psycopg is not installed (apt-get install postgresql; "
    "pip install -e '.[postgres]')",
)
pytestmark = pytest.mark.slow


class Search:
    """``autoprec search`` in a subprocess, its stderr read line by line with the time
    each line arrived."""

    def __init__(self, folder: Path, *args: str) -> None:
        command = [
            sys.executable,
            "-c",
            CLI,
            "search",
            "--task",
            f"{TASKS}:slow_tiny",
            "--steps",
            "20",
            "--confirm-top",
            "0",
            "--device",
            "cpu",
            "--no-progress",
            *args,
        ]
        self.process = subprocess.Popen(
            command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self._stdout: list[str] = []
        # Each pipe has one reader, to its end: were stderr also read by communicate(),
        # the lines it took (on a loaded machine, the last ones) would be missing here.
        self._readers = [
            threading.Thread(target=self._read_stderr, daemon=True),
            threading.Thread(target=self._read_stdout, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append((time.monotonic(), line.rstrip()))

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        self._stdout.extend(self.process.stdout)

    def finish(self, timeout_s: float = 600) -> int:
        """Wait for the search to end and for every line it wrote to be read."""
        self.process.wait(timeout=timeout_s)
        for reader in self._readers:
            reader.join(timeout=timeout_s)
            assert not reader.is_alive(), "a pipe of the search stayed open after it ended"
        return self.process.returncode

    @property
    def stdout(self) -> str:
        return "".join(self._stdout)

    def said(self, words: str) -> list[tuple[float, str]]:
        return [(t, line) for t, line in self.lines if words in line]

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _recorded(storage: str, study: str) -> list[optuna.trial.FrozenTrial]:
    try:
        trials = optuna.load_study(study_name=study, storage=storage).trials
    except Exception:  # not created yet, or the server is down
        return []
    return [t for t in trials if t.state.is_finished() and RECORD_ATTR in t.user_attrs]


def _wait(condition, timeout_s: float, what: str, search: Search) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert search.process.poll() is None, f"the search ended first: {search.stderr[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.3)


def _children(tracking_uri: str, study: str) -> tuple[list, list]:
    client = mlflow_client(tracking_uri)
    experiment = client.get_experiment_by_name(study)
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("autoprec.role") == "parent"]
    children = [r for r in runs if r not in parents]
    return parents, children


def test_a_tracking_server_killed_mid_search_stalls_nothing_and_loses_nothing(tmp_path):
    storage = f"sqlite:///{tmp_path}/runs/optuna.db"
    with mlflow_process(f"sqlite:///{tmp_path}/mlflow-server.db", tmp_path / "art") as server:
        args = ("--trials", "8", "--study", "outage", "--tracking-uri", server.url)
        search = Search(tmp_path, *args)
        _wait(lambda: len(_recorded(storage, "outage")) >= 3, 300, "3 trials", search)
        server.kill()
        killed_at = time.monotonic()
        recorded_at_kill = len(_recorded(storage, "outage"))
        # Within about 30 s on an idle machine, one line says so, and the trials go on in
        # Optuna. The bound is generous for a loaded machine, yet far below MLflow's own
        # retries (7 with exponential backoff, minutes per request), which autoprec bounds.
        _wait(lambda: search.said("unreachable"), 180, "warning", search)
        (warned_at, warning), *_ = search.said("unreachable")
        assert warned_at - killed_at < 180, warning
        assert "trials go on" in warning
        _wait(
            lambda: len(_recorded(storage, "outage")) >= recorded_at_kill + 2,
            300,
            "trials during the outage",
            search,
        )
        assert search.finish() == 0, search.stderr[-3000:]  # ended without the server
        assert len(search.said("is unreachable")) == 1  # one line, not one per write
        assert len(_recorded(storage, "outage")) == 8

        server.start()  # back: the same command catches up, and trains nothing more
        again = Search(tmp_path, *args)
        assert again.finish() == 0, again.stderr[-3000:]
        recorded = _recorded(storage, "outage")
        assert len(recorded) == 8  # the Optuna trial count is exact
        parents, children = _children(server.url, "outage")
        assert len(parents) == 1
        keys = [c.data.tags[KEY_TAG] for c in children]
        assert len(keys) == len(set(keys))  # one run per trial, never two
        assert set(keys) >= {"baseline"} | {str(t.number) for t in recorded}
        logged = {c.data.tags[KEY_TAG] for c in children if c.data.tags.get("autoprec.logged")}
        assert logged == {"baseline"} | {str(t.number) for t in recorded}
        summary = json.loads((tmp_path / "runs/outage/summary.json").read_text())
        assert {t["mlflow_run_id"] for t in summary["trials"]} <= {c.info.run_id for c in children}


@requires_postgres
@pytest.mark.parametrize("immediate", [False, True], ids=["fast", "immediate"])
def test_a_postgres_restart_mid_search_loses_no_trial_and_makes_none_twice(tmp_path, immediate):
    with postgres_server(("optuna",)) as server:
        storage = f"{server.url}/optuna"
        args = ("--trials", "8", "--study", "pg", "--storage", storage)
        search = Search(tmp_path, *args)
        _wait(lambda: len(_recorded(storage, "pg")) >= 2, 300, "2 trials", search)
        server.stop(immediate=immediate)
        # The search meets the outage at its next storage call, however long the trial
        # it is in takes on a loaded machine.
        _wait(lambda: search.said("Optuna storage is unreachable"), 300, "outage", search)
        server.start()
        assert search.finish() == 0, search.stderr[-3000:]
        recorded = _recorded(storage, "pg")
        assert len(recorded) == 8  # none lost
        assert len({t.user_attrs[CLAIM_ATTR] for t in recorded}) == 8  # none twice
        trials = optuna.load_study(study_name="pg", storage=storage).trials
        assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
        assert len(search.said("Optuna storage is unreachable")) == 1, search.stderr[-3000:]
        assert len(search.said("Optuna storage answers again")) == 1, search.stderr[-3000:]


@requires_postgres
def test_passwords_in_urls_are_written_nowhere(tmp_path):
    db_secret, tracking_secret = "db-Secret-4821", "track-Secret-7730"
    with (
        postgres_server(("optuna", "mlflow"), password=db_secret) as pg,
        mlflow_process(f"{pg.url}/mlflow", tmp_path / "art") as server,
    ):
        storage = f"{pg.url}/optuna"
        tracking = server.url.replace("http://", f"http://alice:{tracking_secret}@")
        args = ("--trials", "4", "--study", "secret", "--storage", storage)
        search = Search(tmp_path, *args, "--tracking-uri", tracking, "--workers", "2")
        assert search.finish() == 0, search.stderr[-3000:]
        printed = search.stdout + search.stderr
        assert "***@" in printed  # the URL was shown, redacted
        # A bad URL with the password in it: the one error line is redacted too.
        wrong = subprocess.run(
            [sys.executable, "-c", CLI, "search", "--storage", storage.replace("127.0.0.1", "x y")],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert wrong.returncode == 2
        printed += wrong.stdout + wrong.stderr
        for secret in (db_secret, tracking_secret):
            assert secret not in printed
            for path in (tmp_path / "runs").rglob("*"):
                if path.is_file():
                    assert secret.encode() not in path.read_bytes(), path
        client = mlflow_client(server.url)
        experiment = client.get_experiment_by_name("secret")
        runs = client.search_runs([experiment.experiment_id], max_results=1000)
        assert runs
        for run in runs:
            values = [*run.data.params.values(), *run.data.tags.values()]
            for secret in (db_secret, tracking_secret):
                assert not any(secret in str(value) for value in values), run.info.run_name
            folder = tmp_path / "downloaded" / run.info.run_id
            folder.mkdir(parents=True)
            client.download_artifacts(run.info.run_id, "", str(folder))
            for path in folder.rglob("*"):
                if path.is_file():
                    for secret in (db_secret, tracking_secret):
                        assert secret.encode() not in path.read_bytes(), path
