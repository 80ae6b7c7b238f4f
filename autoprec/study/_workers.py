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
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autoprec._util.files import open_log
from autoprec.distributed.launch import device_groups, group_env, local_group
from autoprec.errors import AutoprecError, redact
from autoprec.study._events import Callbacks, Progress
from autoprec.study._loop import run_trials
from autoprec.study._records import TrialRecord
from autoprec.study._session import Session, prepare
from autoprec.study._studies import finished
from autoprec.study.config import SearchConfig
from autoprec.tracking import absolute_sqlite_uri

# A worker dies with the search that started it (Linux: PR_SET_PDEATHSIG), set before the
# heavy imports so that a search killed early leaves no worker behind.
_ENTRY = """import ctypes, signal, sys
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
except OSError:
    pass
signal.signal(signal.SIGINT, signal.default_int_handler)  # its stop signal, even in nohup
from autoprec.study._workers import main
sys.exit(main())
"""
# The spec travels in the environment, not on the command line, which every user of
# the host can read (it may hold a database password).
SPEC_ENV = "AUTOPREC_WORKER_SPEC"
STOP_GRACE_S = 60.0  # how long workers get to record an interrupted trial after Ctrl-C


def pinned_env(device: str, threads: int) -> dict[str, str]:
    """The environment of a worker pinned to ``device`` with ``threads`` CPU threads."""
    env = dict(os.environ)
    # Indices are as this process sees the devices: under an existing restriction (a
    # batch scheduler's), device i is the i-th of the visible ones. A group of devices
    # (--nproc-per-trial) is listed in one variable.
    return group_env(device.split(","), threads, env)


def _local_devices(group: list[str]) -> str | None:
    """A worker's own ``--devices``: its group as it sees it (None: one device)."""
    return ",".join(local_group(group)) if len(group) > 1 and group[0] != "cpu" else None


def local_device(device: str) -> str:
    """What a pinned worker calls its device: the only one it sees, index 0."""
    kind = device.split(":")[0]
    return kind if kind == "cpu" else f"{kind}:0"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to join a study; JSON on its command line. ``settings``
    are the search's `SearchConfig` fields as the worker runs them (its own device, the
    study's resolved tolerance and time limit, absolute store paths)."""

    index: int
    task: str
    space: str | None
    threads: int
    settings: dict[str, Any]


def start_workers(specs: list[WorkerSpec], devices: list[str], log_dir: Path) -> list[Any]:
    """Start one process per spec, its output in ``log_dir/worker-<i>.log``."""
    processes = []
    for spec, device in zip(specs, devices, strict=True):
        log = open_log(log_dir / f"worker-{spec.index}.log", append=True)  # never through a link
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", _ENTRY],
                env={
                    **pinned_env(device, spec.threads),
                    SPEC_ENV: json.dumps(asdict(spec), default=str),
                },
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


class WorkerLog(Callbacks):
    """A worker's log: one line per trial it measured."""

    def trial_end(self, record: TrialRecord, progress: Progress) -> None:
        reason = record.result.reason or ""
        print(f"trial {record.number}: {record.result.state} {reason}", flush=True)

    def warning(self, message: str) -> None:
        print(f"warning: {redact(message)}", flush=True)


def run_worker(spec: WorkerSpec) -> int:
    """A worker process: join the study, run trials until its budget is met; the number
    of trials measured here."""
    config = SearchConfig(**spec.settings)
    prepared = prepare(spec.task, spec.space, config, check_data=False)
    session = Session.open(prepared, WorkerLog(), worker=spec.index + 1)
    try:
        session.join()
        if len(finished(session.study)) < config.trials:
            session.warm_up()
        return run_trials(session.study, session.context(), config.trials, session.callbacks)
    finally:  # what could not be written now is written by the next run of the study
        session.tracker.close()


def run_workers(session: Session, workers: int) -> None:
    """Start ``workers`` processes on this host, pinned round-robin to the search's
    devices, and follow the study until they are done."""
    prepared, config = session.prepared, session.prepared.config
    # With --nproc-per-trial N, each worker is pinned to a group of N devices.
    groups = device_groups(prepared.devices, config.nproc_per_trial)
    pinned_groups = [groups[i % len(groups)] for i in range(workers)]
    pinned = [",".join(group) for group in pinned_groups]
    cores = os.cpu_count() or 1
    threads = max(1, cores // workers)  # on the CPU, the workers share its cores
    settings = {
        **config.to_dict(),
        "storage": absolute_sqlite_uri(config.storage),
        "tracking_uri": absolute_sqlite_uri(config.tracking_uri),
        "runs_dir": str(Path(config.runs_dir).resolve()),
        "study": prepared.study,
        "accuracy_tolerance": prepared.tolerance,
        "trial_timeout_s": session.trial_limit_s,
        "workers": 1,
        "devices": None,
    }
    specs = [
        WorkerSpec(
            i,
            prepared.task_spec or "",
            prepared.space_spec,
            threads,
            {**settings, "device": local_device(g[0]), "devices": _local_devices(g)},
        )
        for i, g in enumerate(pinned_groups)
    ]
    kind = prepared.backend.kind
    session.callbacks.workers_started(workers, pinned, cores, threads, kind)
    ctx = session.context()
    seen = {r.number for r in session.measured()}
    session.callbacks.trials_start(ctx.progress(session.study, config.trials))

    def poll() -> None:
        progress = ctx.progress(session.study, config.trials)
        for record in progress.records:
            if record.number not in seen:
                seen.add(record.number)
                session.callbacks.trial_end(record, progress)

    log_dir = prepared.out_dir.resolve() / "workers"
    processes = start_workers(specs, pinned, log_dir)
    codes = wait_for_workers(processes, poll)
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed and len(finished(session.study)) < config.trials:
        raise AutoprecError(
            f"worker {failed[0]} stopped with status {codes[failed[0]]} before the budget "
            f"was met; see {log_dir / f'worker-{failed[0]}.log'}"
        )


def main() -> int:
    spec = WorkerSpec(**json.loads(os.environ.pop(SPEC_ENV)))
    import torch

    torch.set_num_threads(spec.threads)
    device = spec.settings["device"]
    print(f"worker {spec.index}: pid {os.getpid()}, device {device}", flush=True)
    try:
        done = run_worker(spec)
    except KeyboardInterrupt:
        print(f"worker {spec.index}: interrupted", flush=True)
        return 130
    except AutoprecError as error:
        print(f"worker {spec.index}: {redact(str(error))}", flush=True)
        return 2
    print(f"worker {spec.index}: done, {done} trials measured here", flush=True)
    return 0
