"""Real servers on loopback for the tests: PostgreSQL (Debian's package, a fresh cluster
in a temporary folder) and ``mlflow server``. Each is started on a free port and stopped
at the end of its ``with`` block."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
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
    check, what: str, process: subprocess.Popen, log: Path | None = None, timeout_s: float = 300
) -> None:
    """Wait until ``check()`` holds; the bound is generous (an MLflow server with its
    workers takes about a minute on 2 idle cores), it only stops a server that hangs."""
    deadline = time.monotonic() + timeout_s
    while not check():
        said = log.read_text()[-2000:] if log is not None else ""
        assert process.poll() is None, f"{what} exited with status {process.returncode}: {said}"
        assert time.monotonic() < deadline, f"{what} did not start in {timeout_s:.0f} s"
        time.sleep(0.3)


class PostgresServer:
    """A PostgreSQL cluster in a new folder under the system's temporary folder (which the
    postgres user can reach, unlike pytest's), on a free port; ``url`` is its base URL
    (append a database name). With a password, connections over TCP must give it."""

    def __init__(self, password: str | None = None) -> None:
        binaries = postgres_bin()
        assert binaries is not None
        self.binaries = binaries
        self.folder = Path(tempfile.mkdtemp(prefix="autoprec-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        self.data = self.folder / "data"
        auth = ["-A", "trust"]
        if password is not None:
            secret = self.folder / "password"
            secret.write_text(password)
            if os.geteuid() == 0:
                shutil.chown(secret, "postgres", "postgres")
            auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={secret}"]
        command = [str(binaries / "initdb"), "-D", str(self.data), *auth, "-U", "postgres"]
        subprocess.run(_as_postgres(command), check=True, capture_output=True)
        self.port = free_port()
        user = "postgres" if password is None else f"postgres:{password}"
        self.url = f"postgresql://{user}@127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [
            str(self.binaries / "postgres"),
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-k",
            str(self.folder),
            "-c",
            "listen_addresses=127.0.0.1",
        ]
        self.process = subprocess.Popen(
            _as_postgres(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        def ready() -> bool:
            probe = [str(self.binaries / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)]
            return subprocess.run(probe, capture_output=True).returncode == 0

        _wait_for(ready, "postgres", self.process)

    def create(self, database: str) -> None:
        # Over the local socket, where the cluster trusts its own user.
        command = [
            str(self.binaries / "createdb"),
            "-h",
            str(self.folder),
            "-p",
            str(self.port),
            "-U",
            "postgres",
            database,
        ]
        subprocess.run(_as_postgres(command), check=True, capture_output=True)

    def stop(self, immediate: bool = False) -> None:
        """Shut the server down: fast (clients told, sessions closed) or immediate (as in a
        crash: no checkpoint, recovery at the next start)."""
        if self.process is not None and self.process.poll() is None:
            mode = "immediate" if immediate else "fast"
            command = [str(self.binaries / "pg_ctl"), "-D", str(self.data), "-m", mode, "stop"]
            subprocess.run(_as_postgres(command), capture_output=True, timeout=60)
            self.process.wait(timeout=60)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def postgres_server(
    databases: tuple[str, ...], password: str | None = None
) -> Iterator[PostgresServer]:
    """A running PostgreSQL server with ``databases``, stopped and removed at the end."""
    server = PostgresServer(password)
    try:
        server.start()
        for name in databases:
            server.create(name)
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def postgres(databases: tuple[str, ...]) -> Iterator[str]:
    """A PostgreSQL server with ``databases``; yields the base URL (append a database
    name)."""
    with postgres_server(databases) as server:
        yield server.url


class MlflowServer:
    """``mlflow server`` over ``backend_store_uri`` (lean: one worker, no job runner) on a
    free port; it can be killed and started again on the same port and store."""

    def __init__(self, backend_store_uri: str, artifacts: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        mlflow = shutil.which("mlflow") or f"{sys.executable} -m mlflow"
        self.command = [
            *mlflow.split(),
            "server",
            "--backend-store-uri",
            backend_store_uri,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        if artifacts is not None:
            self.command += ["--artifacts-destination", artifacts.resolve().as_uri()]
        self.log = Path(tempfile.mkstemp(prefix="autoprec-mlflow-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("a") as output:
            self.process = subprocess.Popen(
                self.command,
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its workers go with it when it is killed
            )

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return True
            except OSError:
                return False

        _wait_for(healthy, "mlflow server", self.process, self.log)

    def kill(self) -> None:
        """SIGKILL, as a crashed or lost server: nothing is closed cleanly."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        self.log.unlink(missing_ok=True)


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, artifacts: Path | None = None) -> Iterator[str]:
    """A running ``mlflow server``; yields its http:// URL."""
    with mlflow_process(backend_store_uri, artifacts) as server:
        yield server.url


@contextlib.contextmanager
def mlflow_process(backend_store_uri: str, artifacts: Path | None = None) -> Iterator[MlflowServer]:
    server = MlflowServer(backend_store_uri, artifacts)
    try:
        server.start()
        yield server
    finally:
        server.close()
