"""A server run as a child process that stops when autoprec is stopped.

``mlflow ui`` starts uvicorn workers of its own. Run in autoprec's process group, a Ctrl-C
in a terminal reaches them all, but a SIGTERM (or a SIGINT sent to autoprec alone) does
not, and they keep serving. So the server gets a process group of its own, every SIGINT
and SIGTERM autoprec receives is forwarded to that whole group, and autoprec returns only
once nothing of the group is left (on Linux it also adopts the workers the server
orphans, so that none is left a zombie either).

The server's own output (its start-up log, and the traceback uvicorn prints when a SIGINT
stops it) is kept from the terminal: autoprec prints its own lines, and shows the server's
last lines only where the server exits by itself with an error.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from types import FrameType

from autoprec.errors import AutoprecError, redact

FORWARDED = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 20.0  # after a forwarded signal, before the group is killed outright
POLL_S = 0.2
TAIL_LINES = 30  # of the server's output, shown where it fails on its own
_PR_SET_CHILD_SUBREAPER = 36


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on, before starting anything."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            probe.bind((host, port))
        except OSError as error:
            raise AutoprecError(
                f"--port {port}: cannot listen on {host} ({error.strerror})"
            ) from None


def serve(
    command: list[str],
    env: dict[str, str],
    ready_url: str,
    on_ready: Callable[[], None],
    prepare: Callable[[], None] = lambda: None,
) -> int:
    """Run ``command`` until it exits or autoprec is signalled. ``prepare`` runs while the
    server starts (its error stops the server and is raised); ``on_ready`` is called once
    ``ready_url`` answers. Returns the server's exit status, 0 when stopped by a SIGTERM;
    stopped by a SIGINT, raises KeyboardInterrupt once nothing of the server is left."""
    _adopt_orphans()
    stopped: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        stopped.append(signum)
        if child is not None:
            _signal_group(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        child = subprocess.Popen(
            command,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        tail, reader = _keep_tail(child)
        if stopped:  # signalled while the child was being started
            _signal_group(child.pid, stopped[0])
        prepare()
        ready = False
        while child.poll() is None:
            if not ready and not stopped and _answers(ready_url):
                ready = True
                on_ready()
            time.sleep(POLL_S)
            if stopped and not _waited(child, GRACE_S):
                _signal_group(child.pid, signal.SIGKILL)
        _reap_group(child.pid)
        if not stopped and child.returncode != 0:
            reader.join(timeout=POLL_S * 10)  # the last lines it wrote
            lines = redact("".join(tail).rstrip("\n"))
            print(f"{lines}\n(the server exited with status {child.returncode})", file=sys.stderr)
    finally:
        if child is not None and child.poll() is None:  # an error here: leave nothing behind
            _signal_group(child.pid, signal.SIGKILL)
            child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGINT in stopped:
        raise KeyboardInterrupt
    return 0 if stopped else child.returncode


def _keep_tail(
    child: subprocess.Popen[bytes],
) -> tuple[collections.deque[str], threading.Thread]:
    """Read the child's output as it comes (a full pipe would block it), keeping its last
    TAIL_LINES lines; the reading thread with them."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def read() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            tail.append(line.decode(errors="replace"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return tail, reader


def _waited(child: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the child exited within ``timeout_s``."""
    try:
        child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _adopt_orphans() -> None:
    """On Linux, become the subreaper of our descendants: a worker whose server exited
    first is then ours to wait for, not left to an init that may never reap it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_group(pgid: int) -> None:
    """Wait until no process of the server's group is left, killing the group after
    GRACE_S; with adopted orphans, wait for each of them too."""
    deadline = time.monotonic() + GRACE_S
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            _signal_group(pgid, signal.SIGKILL)
            deadline = float("inf")
        _reap_children()
        time.sleep(POLL_S)
    _reap_children()


def _reap_children() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (a zombie does not count)."""
    proc = "/proc"
    if not os.path.isdir(proc):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
