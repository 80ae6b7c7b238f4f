"""Worker processes on one host, each pinned to one device, all on one shared study.

``autoprec search --workers N`` sets the study up in the calling process (parent run,
baseline, anchors), then starts N worker processes (`main`, given a JSON `WorkerSpec`). Each
worker opens the same Optuna study and MLflow experiment and runs trials until the
study's budget is met; Optuna's storage is the only thing they share. A worker pinned to
a device sees only that device (through ``CUDA_VISIBLE_DEVICES`` or
``ASCEND_RT_VISIBLE_DEVICES``, set before it starts), as device 0. On the CPU, workers
share the cores: each gets its share of torch's threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autoprec.errors import AutoprecError, DeviceError

_RANGE = re.compile(r"^(cuda|npu):(\d+)-(\d+)$")
_ENTRY = "import sys; from autoprec.workers import main; sys.exit(main(sys.argv[1:]))"
STOP_GRACE_S = 60.0  # how long workers get to record an interrupted trial after Ctrl-C


def parse_devices(text: str | Sequence[str] | None) -> list[str]:
    """``npu:0-7``, ``cuda:0,cuda:1`` or ``cpu`` as a list of device strings."""
    if text is None:
        return []
    items = text.split(",") if isinstance(text, str) else list(text)
    devices: list[str] = []
    for item in (i.strip().lower() for i in items):
        match = _RANGE.match(item)
        if match:
            kind, first, last = match.group(1), int(match.group(2)), int(match.group(3))
            if last < first:
                raise DeviceError(f"--devices {text!r}: empty range {item!r}")
            devices += [f"{kind}:{i}" for i in range(first, last + 1)]
        elif re.match(r"^(cpu|(cuda|npu):\d+)$", item):
            devices.append(item)
        else:
            raise DeviceError(
                f"--devices {text!r}: expected e.g. npu:0-7, cuda:0,cuda:1 or cpu, got {item!r}"
            )
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) > 1:
        raise DeviceError(f"--devices {text!r}: one kind of device per search")
    if len(set(devices)) != len(devices):
        raise DeviceError(f"--devices {text!r}: a device is listed twice")
    return devices


def pinned_env(device: str, threads: int) -> dict[str, str]:
    """The environment of a worker pinned to ``device`` with ``threads`` CPU threads."""
    env = dict(os.environ)
    from autoprec.devices import visible_devices_env  # torch: not before _die_with_parent

    kind, _, index = device.partition(":")
    variable = visible_devices_env(kind)
    if variable is not None:
        # Indices are as this process sees the devices: under an existing restriction
        # (a batch scheduler's), device i is the i-th of the visible ones.
        visible = [v for v in env.get(variable, "").split(",") if v.strip()]
        env[variable] = visible[int(index)].strip() if visible else index
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def local_device(device: str) -> str:
    """What a pinned worker calls its device: the only one it sees, index 0."""
    kind = device.split(":")[0]
    return kind if kind == "cpu" else f"{kind}:0"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to join a study; JSON on its command line."""

    index: int
    task: str
    space: str | None
    study: str
    storage: str
    tracking_uri: str
    runs_dir: str
    trials: int
    steps: int
    seed: int
    device: str
    prefer: str
    sampler: str
    tolerance: float
    early_stopping: bool
    trial_timeout_s: float
    heartbeat_s: int
    threads: int


def start_workers(specs: list[WorkerSpec], devices: list[str], log_dir: Path) -> list[Any]:
    """Start one process per spec, its output in ``log_dir/worker-<i>.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    processes = []
    for spec, device in zip(specs, devices, strict=True):
        log = (log_dir / f"worker-{spec.index}.log").open("a")
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", _ENTRY, json.dumps(asdict(spec))],
                env=pinned_env(device, spec.threads),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the search, which stops them once
            )
        )
        log.close()
    return processes


def wait_for_workers(
    processes: list[Any], poll: Callable[[], None], poll_s: float = 1.0
) -> list[int]:
    """Call ``poll`` every ``poll_s`` until every worker has exited; their exit codes.

    On Ctrl-C, each worker gets one SIGINT (it records its running trial as interrupted),
    then SIGKILL after STOP_GRACE_S; the KeyboardInterrupt is raised again after that.
    """
    try:
        while any(p.poll() is None for p in processes):
            poll()
            time.sleep(poll_s)
        poll()
    except KeyboardInterrupt:
        stop_workers(processes)
        raise
    return [p.returncode for p in processes]


def stop_workers(processes: list[Any]) -> None:
    """One SIGINT each, STOP_GRACE_S to record their running trials, then SIGKILL (at
    once on a second Ctrl-C; their trials are then failed by heartbeat)."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        for p in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()


def _die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when the search that started it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec(**json.loads(args[0]))
    _die_with_parent()
    import torch

    torch.set_num_threads(spec.threads)
    from autoprec.search import run_worker

    print(f"worker {spec.index}: pid {os.getpid()}, device {spec.device}", flush=True)
    try:
        done = run_worker(spec)
    except KeyboardInterrupt:
        print(f"worker {spec.index}: interrupted", flush=True)
        return 130
    except AutoprecError as error:
        print(f"worker {spec.index}: {error}", flush=True)
        return 2
    print(f"worker {spec.index}: done, {done} trials measured here", flush=True)
    return 0
