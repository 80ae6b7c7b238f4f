"""``autoprec ui``: the URL it prints opens the study's runs table in a real browser, with
the trials flat and their metrics as columns, and a signal stops MLflow's whole server."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import mlflow
import pytest
from PIL import Image

import autoprec
from tests.contract_tasks import make_tiny_task

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
START_LIMIT_S = 300  # an upper bound for a loaded machine, never a measured figure
PAGE_TRIES = 6


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A small real search, its stores under its own folder's runs/."""
    folder = tmp_path_factory.mktemp("ui")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        autoprec.search(
            make_tiny_task(), trials=2, steps=5, study="tiny", device="cpu", confirm_top=0
        )
    return folder


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class _Ui:
    """``autoprec ui`` started as a user starts it, its stderr read line by line."""

    def __init__(self, folder: Path, port: int, *extra: str) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autoprec.cli", "ui", "--port", str(port), *extra],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # the test's own group stays out of its signals
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put("")

    def wait_for(self, prefix: str) -> str:
        while True:
            line = self.lines.get(timeout=START_LIMIT_S)
            assert line, f"autoprec ui exited ({self.proc.wait()}) before printing {prefix!r}"
            if line.startswith(prefix):
                return line.strip()

    def descendants(self) -> set[int]:
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        found, frontier = set(), {self.proc.pid}
        while frontier:
            frontier = {pid for pid, parent in parents.items() if parent in frontier}
            found |= frontier
        return found

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _stop_leaves_nothing(ui: _Ui, signum: int, port: int) -> None:
    server = ui.descendants()
    assert server, "mlflow ui was not started as autoprec's child"
    os.kill(ui.proc.pid, signum)  # autoprec alone, as kill or a supervisor sends it
    # Ctrl-C is an interruption (exit 130, as the search's); a SIGTERM a normal stop
    assert ui.proc.wait(timeout=START_LIMIT_S) == (130 if signum == signal.SIGINT else 0)
    left = [pid for pid in server if Path(f"/proc/{pid}").exists()]
    assert not left, f"processes of mlflow ui still there: {left}"
    assert _port_free(port)


def _rest(ui: _Ui) -> list[str]:
    """What autoprec ui printed after the lines already read, once it has exited."""
    lines = []
    while line := ui.lines.get(timeout=START_LIMIT_S):
        lines.append(line.rstrip("\n"))
    return lines


def _browser(flags: list[str], url: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [CHROMIUM, *flags, url], capture_output=True, text=True, timeout=START_LIMIT_S
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_ui_url_opens_the_runs_table_with_trials_and_metrics(searched, tmp_path):
    client = mlflow.MlflowClient(f"sqlite:///{searched / 'runs/mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    children = [r.info.run_name for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert "baseline-fp32" in children and len(children) == 3
    port = _free_port()
    ui = _Ui(searched, port)
    try:
        line = ui.wait_for("MLflow UI:")
        url = line.split(": ", 2)[2].split(" ")[0]
        assert url.startswith(f"http://127.0.0.1:{port}/#/experiments/{experiment.experiment_id}/")
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",  # a fresh browser: GenAI by default
            "--window-size=2400,1200",
            "--virtual-time-budget=20000",
        ]
        for _ in range(PAGE_TRIES):  # the table fills in once MLflow has answered
            dom = _browser([*flags, "--dump-dom"], url).stdout
            if all(f">{name}</span>" in dom for name in children):
                break
        for name in children:  # every trial a row of its own, not folded under the parent
            assert f">{name}</span>" in dom
        assert ">search-tiny</span>" not in dom
        for metric in ("accuracy", "accuracy_drop", "step_time_ms", "peak_memory_mb"):
            assert f'col-id="metrics.`{metric}`"' in dom
        shot = tmp_path / "runs-table.png"
        _browser([*flags, f"--screenshot={shot}"], url)
        with Image.open(shot) as image:
            assert image.size == (2400, 1200)
        _stop_leaves_nothing(ui, signal.SIGINT, port)
    finally:
        ui.kill()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_mlflow_and_its_workers_in_one_line(searched, signum):
    """Only autoprec's own lines reach the terminal: not MLflow's start-up log, nor the
    traceback uvicorn prints when a Ctrl-C stops it."""
    port = _free_port()
    ui = _Ui(searched, port, "--study", "tiny")
    try:
        first = ui.lines.get(timeout=START_LIMIT_S)
        assert first.startswith(f"starting the MLflow UI on http://127.0.0.1:{port} ...")
        assert "study tiny: http://" in ui.lines.get(timeout=START_LIMIT_S)
        _stop_leaves_nothing(ui, signum, port)
        rest = [line for line in _rest(ui) if line]
        assert rest == (["autoprec ui: interrupted"] if signum == signal.SIGINT else [])
    finally:
        ui.kill()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--study", "nope"], "--study 'nope': no such study"),
        (
            ["--study", "tin"],
            "--study 'tin': no such study in this tracking store (did you mean 'tiny'?)",
        ),
        (["--tracking-uri", "sqlite:///elsewhere/mlflow.db"], "no such store"),
        (["--port", "{busy}"], "--port {busy}: cannot listen on 127.0.0.1"),
    ],
)
def test_ui_bad_input_is_one_line_and_starts_nothing(searched, args, message):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        args = [a.replace("{busy}", port) for a in args]
        args += [] if "--port" in args else ["--port", str(_free_port())]
        done = subprocess.run(
            [sys.executable, "-m", "autoprec.cli", "ui", *args],
            cwd=searched,
            capture_output=True,
            text=True,
            timeout=START_LIMIT_S,
        )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message.replace("{busy}", port) in done.stderr
    assert not (searched / "elsewhere").exists()


def test_a_server_that_fails_by_itself_shows_its_last_lines(capfd):
    """Its output is kept from the terminal while it runs; where it exits with an error
    before anyone stopped it, its last lines (passwords redacted) say why."""
    from autoprec._util.server_process import serve

    code = (
        "print('x' * 10); print('cannot open postgresql://u:hunter2@db/optuna'); "
        "raise SystemExit(3)"
    )
    ready: list[bool] = []
    status = serve(
        [sys.executable, "-c", code],
        dict(os.environ),
        "http://127.0.0.1:9/health",
        lambda: ready.append(True),
    )
    err = capfd.readouterr().err
    assert status == 3 and not ready
    assert "cannot open" in err and "hunter2" not in err
    assert err.rstrip().endswith("(the server exited with status 3)")
