"""Trials that span several devices: each trial one launch of torch's own launcher.

``autoprec search --nproc-per-trial N`` runs every trial (the fp32 baseline too) of a mode
that names how a rank measures a policy (`Mode.rank_trial`: the training mode's) as
``python -m torch.distributed.run --nproc-per-node N --standalone -m
autoprec.distributed.rank SPEC RESULT``: torchrun's elastic agent starts the N ranks,
and rank 0 writes the trial's result. To the search a launch is one trial: one
``measure()`` call of `autoprec.trials.launched.LaunchedTrials` (this module's
`launched_trial`), under the worker's heartbeat, lease and time limit. Several trials
run at once where there are devices for them: ``--devices cuda:0-7 --nproc-per-trial 4``
is two workers, each launching on its own 4 devices (``CUDA_VISIBLE_DEVICES`` or
``ASCEND_RT_VISIBLE_DEVICES`` set to them; rank ``i`` uses its device ``i``).

A launch that goes wrong fails its trial and the search goes on:
- a rank that raises makes the agent end the other ranks and exit non-zero; the reason
  names the rank and its error, from the agent's failure report;
- a rank lost to a signal (killed, out of host memory, before or during the trial) or a
  launch that failed setting up is launched once more (`RETRIES`); the trial's result
  says why (``retries``: ``rank 1 was killed by SIGKILL``), and a second loss fails it
  with that reason;
- a rank that hangs is ended by the time limit: the agent's process group and every
  rank's (each rank runs in a session of its own) get SIGTERM, then SIGKILL, so that no
  rank is left holding its device;
- the agent dies with the process that launched it (PR_SET_PDEATHSIG), and then ends its
  ranks; each rank dies with the agent too (SIGKILL), so that a search killed by any
  signal leaves no rank behind.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec._util.files import open_log, write_atomic
from autoprec.devices import parse_devices, visible_devices_env
from autoprec.errors import AutoprecError, first_line
from autoprec.trials import MODES, mode_named
from autoprec.trials.base import R, TrialState

if TYPE_CHECKING:
    from autoprec.policy import Policy
    from autoprec.space import SearchSpace
    from autoprec.trials.base import Result

FSDP2_REDUCE_DTYPES = ("fp32", "bf16")  # searched under FSDP2 (DDP's: `ddp_reduce_dtypes`)
# The collective backend of each kind of device.
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
RANK_MODULE = "autoprec.distributed.rank"
# The time limit of a launch when --trial-timeout is not given. The search's own limit
# (25x the baseline's trial) applies to the trials too; this one also bounds the fp32
# baseline's launch, which sets that limit.
LAUNCH_TIMEOUT_S = 900.0
KILL_GRACE_S = 10.0  # between SIGTERM and SIGKILL of a launch's process groups
_LAUNCHES = itertools.count(1)  # this process's launches, each in a folder of its own
# torchrun's own variables, which a search itself run under torchrun must not hand on.
_INHERITED = re.compile(
    r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|"
    r"ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*)$"
)
# Who started whom, for a launch's processes to die with it: the launcher's pid (read by
# the agent) and the agent's (read by each rank, `autoprec.distributed.rank`).
LAUNCHER_PID_ENV = "AUTOPREC_LAUNCHER_PID"
AGENT_PID_ENV = "AUTOPREC_AGENT_PID"
# Each rank writes READY_PREFIX + its rank beside the result once its process group is up.
READY_PREFIX = "ready-"
# ... and DONE_PREFIX + its rank once it has ended its process group, the trial done.
DONE_PREFIX = "done-"
# A launch that failed setting up (a rank died before every rank joined the process group,
# which no policy touches: under heavy load, gloo's rendezvous once aborted a rank), or
# lost a rank to a signal before its trial was done (killed by someone, out of host
# memory), is launched again, this many times, before its trial fails.
RETRIES = 1
# The agent dies with its launcher (Linux: PR_SET_PDEATHSIG); on that SIGTERM it ends
# its ranks, and each rank dies with it too (SIGKILL). A launcher gone before the agent
# asked (its parent is then another) ends it at once. Then it is torch's launcher, run
# as ``python -m torch.distributed.run``.
_AGENT = f"""import ctypes, os, runpy, signal, sys
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
except OSError:
    pass
if str(os.getppid()) != os.environ.get("{LAUNCHER_PID_ENV}", str(os.getppid())):
    sys.exit(1)
os.environ["{AGENT_PID_ENV}"] = str(os.getpid())
sys.argv[0] = "torch.distributed.run"
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
"""


# -- the settings -----------------------------------------------------------------------


def settle_parallel(
    nproc: Any,
    parallel: str | None,
    mode: str | None,
    devices: str | Sequence[str] | None,
    workers: int | None,
) -> str | None:
    """The parallel mode of a search's launched trials (``ddp`` unless given; None for
    trials on one device), after checking ``--nproc-per-trial`` (each checked as
    `autoprec.settings` declares it) against the other settings (``mode``: the search's,
    by a name `mode_named` knows, launchable). Raises AutoprecError with one line naming
    the option."""
    if nproc == 1:
        if parallel is not None:
            raise AutoprecError(
                f"--parallel {parallel}: only with --nproc-per-trial 2 or more "
                "(a trial on one device has nothing to spread)"
            )
        return None
    if not mode_named(mode).launchable:
        launchable = " or ".join(m.name for m in MODES.values() if m.launchable)
        raise AutoprecError(f"--nproc-per-trial {nproc}: only with --mode {launchable}")
    listed = parse_devices(devices)
    if listed and listed[0] != "cpu":
        if len(listed) < nproc:
            raise AutoprecError(
                f"--nproc-per-trial {nproc}: --devices {_text(devices)} lists {len(listed)} "
                f"device(s); a trial needs {nproc}"
            )
        if len(listed) % nproc:
            raise AutoprecError(
                f"--nproc-per-trial {nproc}: does not divide the {len(listed)} devices of "
                f"--devices {_text(devices)} (each trial takes {nproc})"
            )
        groups = len(listed) // nproc
        if workers is not None and workers > groups:
            raise AutoprecError(
                f"--workers {workers}: --devices {_text(devices)} makes {groups} group(s) of "
                f"{nproc} devices, one per worker"
            )
    return parallel or "ddp"


def _text(devices: str | Sequence[str] | None) -> str:
    return devices if isinstance(devices, str) else ",".join(devices or ())


def device_groups(devices: list[str], nproc: int) -> list[list[str]]:
    """The devices in groups of ``nproc``, one group per worker (the CPU: one group,
    whose ranks share its cores)."""
    if nproc == 1 or not devices or devices[0] == "cpu":
        return [[d] for d in devices] if nproc == 1 else [["cpu"]]
    return [devices[i : i + nproc] for i in range(0, len(devices) - nproc + 1, nproc)]


def trial_devices(devices: list[str], device: Any, nproc: int) -> list[str]:
    """The devices a search with ``--nproc-per-trial`` launches on: ``--devices``, else
    the first ``nproc`` from ``--device`` on (``cuda`` or ``cuda:2``), else the CPU."""
    if devices:
        return devices
    from autoprec.devices import get_backend

    backend = get_backend(device)
    if backend.kind == "cpu":
        return ["cpu"]
    first = backend.device.index or 0
    return [f"{backend.kind}:{first + i}" for i in range(nproc)]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity outside Linux
        return os.cpu_count() or 1


def check_cores(devices: list[str], nproc: int) -> None:
    """On the CPU a launch's ranks share its cores: at most one rank per core this
    process may run on (more only wait for each other, and for memory)."""
    if devices and devices[0] == "cpu" and nproc > usable_cores():
        raise AutoprecError(
            f"--nproc-per-trial {nproc}: this machine lets the search run on "
            f"{usable_cores()} CPU core(s); a trial on the CPU takes at most one rank per core"
        )


def group_env(group: list[str], threads: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process given ``group`` of devices and ``threads`` CPU threads:
    the device kind's visible-devices variable names the group (as this process sees its
    devices, under an existing restriction too)."""
    env = dict(os.environ if env is None else env)
    kind = group[0].split(":")[0]
    variable = visible_devices_env(kind)
    if variable is not None:
        visible = [v.strip() for v in env.get(variable, "").split(",") if v.strip()]
        indices = [int(d.partition(":")[2]) for d in group]
        env[variable] = ",".join(visible[i] if visible else str(i) for i in indices)
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def local_group(group: list[str]) -> list[str]:
    """What a process restricted to ``group`` calls its devices: ``cuda:0`` and on."""
    kind = group[0].split(":")[0]
    return ["cpu"] * len(group) if kind == "cpu" else [f"{kind}:{i}" for i in range(len(group))]


# -- one launch -------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchOutcome:
    """How a launch ended: the agent's exit code (None: ended by the time limit), the
    result file rank 0 wrote if any, and the agent's log (its output and the ranks')."""

    exit_code: int | None
    result_path: Path
    log_path: Path
    elapsed_s: float

    @property
    def timed_out(self) -> bool:
        return self.exit_code is None

    def failed_setting_up(self, nproc: int) -> bool:
        """Whether the launch ended in error, in time and with no result, before all
        ``nproc`` ranks were ready (`READY_PREFIX`): before the policy ran."""
        if self.exit_code in (None, 0) or self.result_path.exists():
            return False
        return not self._all(READY_PREFIX, nproc)

    def finished(self, nproc: int) -> bool:
        """Whether every one of ``nproc`` ranks ended its process group after the trial
        (`DONE_PREFIX`): the result stands whatever the exit codes say of what came after
        (an abort at exit, in a destructor, of a rank or of the agent)."""
        return self.result_path.is_file() and self._all(DONE_PREFIX, nproc)

    def lost_rank(self, nproc: int) -> str | None:
        """Why the launch lost a rank before its trial was done, where a signal ended it
        (`failure_of`'s line: ``rank 1 was killed by SIGKILL``); None where none did."""
        if self.exit_code in (None, 0) or self.finished(nproc):
            return None
        failure = _root_failure(_read(self.log_path))
        return None if failure is None or int(failure["code"]) >= 0 else _described(failure)

    def retried_because(self, nproc: int) -> str | None:
        """Why this launch is launched again (`RETRIES`), in one line naming its log: it
        failed setting up, or lost a rank to a signal; None where neither."""
        if self.failed_setting_up(nproc):
            why: str | None = f"{failure_of(_read(self.log_path))}, before every rank was ready"
        else:
            why = self.lost_rank(nproc)
        return None if why is None else f"{why} (log: {self.log_path})"

    def _all(self, prefix: str, nproc: int) -> bool:
        folder = self.result_path.parent
        return all((folder / f"{prefix}{rank}").exists() for rank in range(nproc))

    def reason(self, limit_s: float, nproc: int) -> str:
        """Why the launch gave no result, in one line."""
        log = self.log_path
        if self.timed_out:
            return (
                f"TrialTimeout: no result after {limit_s:.0f} s (the per-trial time limit); "
                f"its {nproc} ranks were ended (log: {log})"
            )
        if self.exit_code == 0:
            return f"rank 0 wrote no result though every rank exited 0 (log: {log})"
        return f"{failure_of(_read(log))} (log: {log})"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


_FAILURE = re.compile(
    r"rank\s*:\s*(?P<rank>\d+).*?exitcode\s*:\s*(?P<code>-?\d+)"
    r"(?:[^\n]*\n\s*error_file[^\n]*\n\s*traceback\s*:\s*(?P<why>.*?))?"
    r"(?=\n\s*\[\d+\]:|\n\s*-{10,}|\n\s*={10,}|\Z)",
    re.S,
)


_LOST_PEER = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|gloo/transport"
    r"|communicator was aborted|nccl.*(abort|timeout)|hccl.*(abort|timeout)",
    re.IGNORECASE,
)


def failure_of(agent_log: str) -> str:
    """The rank that failed first and why, as torchrun's failure report says (the
    ``Failures`` and ``Root Cause`` blocks its agent prints): ``rank 1 was killed by
    SIGKILL``, ``rank 3 exited with code 1: RuntimeError: boom``; the log's last line
    where it has none."""
    failure = _root_failure(agent_log)
    if failure is None:
        lines = [line for line in agent_log.splitlines() if line.strip()]
        last = _cut(lines[-1]) if lines else "no output"
        return f"the launch failed: {last}"
    return _described(failure)


def _root_failure(agent_log: str) -> re.Match[str] | None:
    """The failure of the agent's report that came first: a rank ended by a signal
    (killed, out of host memory) before the ranks that then lost their connection to it,
    or were ended by the agent (SIGTERM); a rank that raised, before one whose collective
    lost its peer. None where the log holds no report."""
    _, marker, report = agent_log.partition("Failures:")
    if not marker:
        _, marker, report = agent_log.partition("Root Cause")
    failures = list(_FAILURE.finditer(report)) if marker else []
    if not failures:
        return None
    root = report.find("Root Cause")
    rooted = [f for f in failures if f.start() > root >= 0]
    # SIGTERM is how the agent ends the others; any other signal ended a rank itself.
    ended_by_agent = -int(signal.SIGTERM)
    signalled = [
        f for f in [*rooted, *failures] if int(f["code"]) < 0 and int(f["code"]) != ended_by_agent
    ]
    # A rank whose collective lost its peer failed because another rank did first, even
    # where torchrun's clock names it the root cause.
    own = [f for f in [*rooted, *failures] if not _LOST_PEER.search(f["why"] or "")]
    return (signalled or own or rooted or failures)[0]


def _described(failure: re.Match[str]) -> str:
    """A failure of the agent's report in one line: the rank, and the signal that ended
    it or its exit code and why."""
    code = int(failure["code"])
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {failure['rank']} was killed by {name}"
    why_lines = [line.strip() for line in (failure["why"] or "").splitlines() if line.strip()]
    # A Python traceback says why on its last line.
    why = why_lines[-1] if why_lines else ""
    why = "" if why.startswith("To enable traceback") else why
    text = f"rank {failure['rank']} exited with code {code}"
    return f"{text}: {_cut(why)}" if why else text


def _cut(text: str) -> str:
    """A line of a log, cut as an error's message is (`first_line`)."""
    return first_line(AutoprecError(text), 300)


def launch(
    spec: dict[str, Any],
    nproc: int,
    folder: Path,
    limit_s: float,
    env: dict[str, str] | None = None,
    module: str = RANK_MODULE,
) -> LaunchOutcome:
    """Run ``module`` as ``nproc`` ranks through torchrun, given ``spec`` (written to
    ``folder/spec.json``); rank 0 writes ``folder/result.json``. Past ``limit_s`` (0: no
    limit), and whatever ends this call (a Ctrl-C, the search's own time limit), every
    process of the launch is ended."""
    spec_path, result_path, log_path = (
        folder / "spec.json",
        folder / "result.json",
        folder / "launch.log",
    )
    # No link is followed: not the launch's folder, nor a file planted at one of its names.
    write_atomic(spec_path, json.dumps(spec, indent=1, default=str), within=folder.parent)
    result_path.unlink(missing_ok=True)
    command = [
        sys.executable, "-c", _AGENT,
        "--nproc-per-node", str(nproc),
        "--standalone",
        "--max-restarts", "0",
        "--monitor-interval", "0.5",
        "-m", module, str(spec_path), str(result_path),
    ]  # fmt: skip
    environment = {k: v for k, v in (env or dict(os.environ)).items() if not _INHERITED.match(k)}
    environment[LAUNCHER_PID_ENV] = str(os.getpid())
    started_s = time.monotonic()
    with open_log(log_path) as log:
        process = subprocess.Popen(
            command,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, ended as one
        )
    code: int | None = None
    try:
        code = process.wait(timeout=limit_s or None)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        end_launch(process)
    return LaunchOutcome(code, result_path, log_path, time.monotonic() - started_s)


def end_launch(process: subprocess.Popen[Any], grace_s: float = KILL_GRACE_S) -> None:
    """End the agent and every rank, each in its own process group: SIGTERM, then SIGKILL
    after ``grace_s``. Nothing is sent once the agent has exited on its own (it ended its
    ranks itself)."""
    if process.poll() is not None:
        return
    # Who is there now, by pid and start time (a pid is only signalled again while it is
    # still the same process), and their process groups (torchrun starts each rank in a
    # session of its own), never this process's own group.
    members = {pid: _started(pid) for pid in [process.pid, *_descendants(process.pid)]}
    groups: dict[int, int] = {}  # group -> the member it was read from
    for pid in members:
        with contextlib.suppress(OSError):
            groups[os.getpgid(pid)] = pid
    groups.pop(os.getpgrp(), None)
    _signal(groups, members, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    _signal(groups, members, signal.SIGKILL)
    process.wait()
    # Killed is not yet gone: a device is freed once its process has been reaped.
    deadline_s = time.monotonic() + grace_s
    while time.monotonic() < deadline_s and _still_there(members):
        time.sleep(0.05)


def _still_there(members: dict[int, str | None]) -> bool:
    """Whether any of ``members`` is still running (a zombie has ended)."""
    for pid, started in members.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if stat[19] == started and stat[0] not in ("Z", "X"):
            return True
    return False


def _signal(groups: dict[int, int], members: dict[int, str | None], sig: int) -> None:
    """``sig`` to each group whose member is still the process seen, and to each such
    member (a rank that left its group)."""
    same = {pid for pid, started in members.items() if started and _started(pid) == started}
    for group, member in groups.items():
        if member in same:
            with contextlib.suppress(OSError):
                os.killpg(group, sig)
    for pid in same:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def _started(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat): who a pid is, now."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (Linux /proc), children before their own."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


# -- the trials -------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchPlan:
    """How a search launches each trial: ``nproc`` ranks in ``parallel`` mode over
    ``backend``, on ``group`` (as this process sees its devices), ``threads`` CPU
    threads per rank, the task as ``task_spec`` names it (each rank loads it), and what
    each rank runs to measure a policy (``rank_trial``, the mode's) over ``budget``."""

    nproc: int
    parallel: str
    backend: str
    group: list[str]
    task_spec: str
    folder: Path
    limit_s: float
    default_limit: bool = False  # no --trial-timeout: LAUNCH_TIMEOUT_S until the baseline
    baseline: dict[str, Any] | None = None  # the fp32 baseline's result: early stopping
    threads: int = 1
    emulate: tuple[str, ...] = ()
    reduce_dtype: str = "fp32"
    module: str = RANK_MODULE
    env: dict[str, str] = field(default_factory=dict)
    budget: dict[str, Any] = field(default_factory=dict)  # the search's `Budget`, as fields
    rank_trial: str | None = None  # `Mode.rank_trial`; None: the rank program's default

    def spec(self, policy: Policy) -> dict[str, Any]:
        """The rank program's spec: what `autoprec.distributed.rank` reads."""
        return {
            "task": self.task_spec,
            **({"rank_trial": self.rank_trial} if self.rank_trial else {}),
            "policy": policy.to_dict(),
            "budget": self.budget,
            "parallel": self.parallel,
            "backend": self.backend,
            "devices": local_group(self.group),
            "reduce_dtype": getattr(policy, "reduce_dtype", None) or self.reduce_dtype,
            "emulate": list(self.emulate),
            "baseline": self.baseline,
            # The ranks' collectives give up no later than the launch is ended.
            **({"timeout_s": self.limit_s} if self.limit_s else {}),
        }

    def environment(self) -> dict[str, str]:
        return group_env(self.group, self.threads, {**os.environ, **self.env})

    def fit(self, space: SearchSpace) -> SearchSpace:
        """``space`` (refused where its optimizer states cannot train under FSDP2 here),
        with the dtype gradients are communicated in searched too, unless the space names
        its own: under FSDP2 its ``reduce_dtype`` (``fsdp.reduce_dtype``: fp32 or bf16),
        under DDP its compression hook (``ddp.reduce_dtype``: fp32 or fp16, and bf16
        where torch allows its hook)."""
        from autoprec.distributed.ddp import ddp_reduce_dtypes
        from autoprec.distributed.fsdp import fsdp2_state_refusal
        from autoprec.space import DDP_REDUCE_PARAM, FSDP_REDUCE_PARAM

        if self.parallel == "fsdp2" and space.optimizer_states is not None:
            kind = self.group[0].split(":")[0]
            states = space.optimizer_states
            refused = {k for k in states.kinds() if fsdp2_state_refusal({k}, kind) is not None}
            if refused and space.auto_states:  # offered, not asked for: those left out
                space = replace(space, optimizer_states=states.without(refused))
            elif refused:  # before any store is opened
                raise AutoprecError(f"{space.source}: {fsdp2_state_refusal(refused, kind)}")
        if space.reduce_dtypes:
            return space
        if self.parallel == "fsdp2":
            return replace(space, reduce_dtypes=FSDP2_REDUCE_DTYPES, reduce_param=FSDP_REDUCE_PARAM)
        return replace(space, reduce_dtypes=ddp_reduce_dtypes(), reduce_param=DDP_REDUCE_PARAM)


def plan_for(
    config: Any,
    task_spec: str | None,
    devices: list[str],
    folder: Path,
    budget: Any,
    rank_trial: str,
) -> LaunchPlan:
    """The launch plan of a search's settings on ``devices`` (the first group of
    ``config.nproc_per_trial``; a worker is given only its own group), its ranks running
    ``rank_trial`` over ``budget`` (a dataclass: its fields go to the ranks)."""
    nproc = config.nproc_per_trial
    if task_spec is None:
        raise AutoprecError(
            f"--nproc-per-trial {nproc}: each rank loads the task itself; name it "
            "(built-in name, module:attr or file.py:attr)"
        )
    group = device_groups(devices, nproc)[0]
    kind = group[0].split(":")[0]
    group = [group[0]] * nproc if kind == "cpu" else group
    import torch

    limit = LAUNCH_TIMEOUT_S if config.trial_timeout_s is None else float(config.trial_timeout_s)
    return LaunchPlan(
        nproc=nproc,
        parallel=config.parallel or "ddp",
        backend=BACKENDS[kind],
        group=group,
        task_spec=task_spec,
        folder=folder,
        limit_s=limit,
        default_limit=config.trial_timeout_s is None,
        threads=max(1, torch.get_num_threads() // nproc),
        emulate=tuple(config.emulate),
        budget=asdict(budget),
        rank_trial=rank_trial,
    )


def launched_trial(plan: LaunchPlan, policy: Policy, result_type: type[R]) -> R:
    """One launch of the policy's trial (`launch_with_retry`: again where it failed setting
    up or lost a rank to a signal), its result read as ``result_type`` (the mode's); a
    launch that failed is a failed trial, and one whose rank was refused its input (an
    AutoprecError) raises it here. The result's ``retries`` say why it was launched again."""
    outcome, retries = launch_with_retry(plan.spec(policy), plan)
    folder = outcome.result_path.parent
    if outcome.result_path.is_file():  # a rank that raised wrote why, as a failed result
        result = read_result(outcome.result_path, result_type)
        if _refused(outcome.result_path):  # as a trial on one device raises it
            raise AutoprecError(f"{result.reason} (log: {outcome.log_path})")
        if outcome.exit_code != 0 and outcome.finished(plan.nproc):
            # Every rank ended its process group: what failed came after the trial.
            _note(result, "exit_code_after_done", outcome.exit_code)
        elif outcome.exit_code != 0 and result.state == TrialState.FAILED:
            # The agent names the rank that died first; the written reason is what
            # the rank that wrote it saw then (often: its peer gone).
            agent = failure_of(_read(outcome.log_path))
            result.reason = f"{agent}; {result.reason}"[:600] + f" (log: {outcome.log_path})"
        elif outcome.exit_code != 0:  # a rank died after rank 0 wrote the result
            result = result_type(TrialState.FAILED, outcome.reason(plan.limit_s, plan.nproc))
    else:
        result = result_type(TrialState.FAILED, outcome.reason(plan.limit_s, plan.nproc))
    if result.state != TrialState.FAILED and outcome.exit_code == 0:
        shutil.rmtree(folder, ignore_errors=True)  # a failed launch keeps its log
    result.retries = retries  # a failed trial's reason is its last launch's
    result.run_time_s = outcome.elapsed_s
    return result


def _note(result: Result, key: str, value: Any) -> None:
    """``value`` under ``key`` in the ranks' record of ``result`` (none: a failed launch)."""
    record = (getattr(result, "telemetry", None) or {}).get("distributed")
    if isinstance(record, dict):
        record[key] = value


def launch_with_retry(spec: dict[str, Any], plan: LaunchPlan) -> tuple[LaunchOutcome, list[str]]:
    """One trial's launch (`launch`) in a folder of its own under ``plan.folder``, launched
    again where it failed setting up or lost a rank to a signal
    (`LaunchOutcome.retried_because`), at most `RETRIES` times: the last outcome, and why
    each earlier launch was launched again. Each such launch keeps its folder and log."""
    retries: list[str] = []
    while True:
        folder = plan.folder / f"{os.getpid()}-{next(_LAUNCHES)}"
        outcome = launch(spec, plan.nproc, folder, plan.limit_s, plan.environment(), plan.module)
        why = outcome.retried_because(plan.nproc)
        if len(retries) == RETRIES or why is None:
            return outcome, retries
        retries.append(why)


def _refused(path: Path) -> bool:
    """Whether a rank crashed on autoprec refusing its input (an AutoprecError): bad
    input to the search, not a result of the policy."""
    try:
        return json.loads(path.read_text()).get("bad_input") is True
    except (OSError, ValueError, AttributeError):
        return False


def result_from_json(path: str | Path, result_type: type[R]) -> R:
    """The result rank 0 wrote to ``path`` (the launcher's side of the interface), as
    ``result_type``: the mode's result."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "state" not in data:
        raise AutoprecError(f"{path}: not a trial result written by autoprec.distributed.rank")
    return result_type.from_dict(data)


def read_result(path: Path, result_type: type[R]) -> R:
    """The trial's result as its ranks wrote it (a damaged file: a failed trial)."""
    try:
        return result_from_json(path, result_type)
    except (AutoprecError, ValueError, TypeError) as error:
        return result_type(TrialState.FAILED, f"unreadable result: {first_line(error, 300)}")
