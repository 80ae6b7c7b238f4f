"""Real servers on loopback for the tests: PostgreSQL (Debian's package, a fresh cluster
in a temporary folder) and ``mlflow server``. Each is started on a free port and stopped
at the end of its ``with`` block."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin() -> Path | None:
    """The folder of PostgreSQL's server programs, if the server is installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _as_postgres(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as the postgres user."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


def _wait_for(
    check, what: str, process: subprocess.Popen, log: Path | None = None, timeout_s: float = 90
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        said = log.read_text()[-2000:] if log is not None else ""
        assert process.poll() is None, f"{what} exited with status {process.returncode}: {said}"
        assert time.monotonic() < deadline, f"{what} did not start in {timeout_s:.0f} s"
        time.sleep(0.3)


@contextlib.contextmanager
def postgres(databases: tuple[str, ...]) -> Iterator[str]:
    """A PostgreSQL server with ``databases``, its cluster in a new folder under the
    system's temporary folder (which the postgres user can reach, unlike pytest's);
    yields the base URL (append a database name)."""
    binaries = postgres_bin()
    assert binaries is not None
    folder = Path(tempfile.mkdtemp(prefix="autoprec-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
    data = folder / "data"
    subprocess.run(
        _as_postgres([str(binaries / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"]),
        check=True,
        capture_output=True,
    )
    port = free_port()
    server = subprocess.Popen(
        _as_postgres(
            [
                str(binaries / "postgres"),
                "-D",
                str(data),
                "-p",
                str(port),
                "-k",
                str(folder),
                "-c",
                "listen_addresses=127.0.0.1",
            ]
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"postgresql://postgres@127.0.0.1:{port}"
    try:

        def ready() -> bool:
            probe = [str(binaries / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)]
            return subprocess.run(probe, capture_output=True).returncode == 0

        _wait_for(ready, "postgres", server)
        for name in databases:
            subprocess.run(
                [
                    str(binaries / "createdb"),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(port),
                    "-U",
                    "postgres",
                    name,
                ],
                check=True,
                capture_output=True,
            )
        yield base
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, artifacts: Path | None = None) -> Iterator[str]:
    """``mlflow server`` over ``backend_store_uri`` (lean: one worker, no job runner);
    yields its http:// URL."""
    port = free_port()
    mlflow = shutil.which("mlflow") or f"{sys.executable} -m mlflow"
    command = [
        *mlflow.split(),
        "server",
        "--backend-store-uri",
        backend_store_uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    if artifacts is not None:
        command += ["--artifacts-destination", artifacts.resolve().as_uri()]
    log = Path(tempfile.mkstemp(prefix="autoprec-mlflow-", suffix=".log")[1])
    with log.open("w") as output:
        server = subprocess.Popen(
            command,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                return True
        except OSError:
            return False

    try:
        _wait_for(healthy, "mlflow server", server, log)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.unlink(missing_ok=True)
