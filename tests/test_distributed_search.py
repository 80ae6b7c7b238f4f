"""Trials across several devices, from the launcher's side: ``--nproc-per-trial`` checked
before anything loads, every trial one launch of the real torchrun, and a launch whose
rank dies, crashes or hangs failing its trial in time with every rank ended.

The launcher's own tests run torchrun on `tests.distributed_fakes` (ranks that misbehave
on purpose in a real gloo process group); the searches run ``autoprec search`` as typed,
with the real rank program (`autoprec.distributed.rank`), at 2 ranks on the CPU.
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest

from autoprec.cli import main
from autoprec.distributed.launch import (
    LaunchOutcome,
    LaunchPlan,
    device_groups,
    failure_of,
    group_env,
    launch,
    launch_with_retry,
    local_group,
    settle_parallel,
    usable_cores,
)
from autoprec.errors import AutoprecError
from tests.distributed_fakes import ABORT_DIR_ENV, KILL_AT_ENV, KILL_DIR_ENV

REPO = Path(__file__).resolve().parents[1]
FAKES = "tests.distributed_fakes"
TASK = f"{REPO}/tests/distributed_tasks.py:blocks"


# -- the settings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nproc-per-trial", "0"], "--nproc-per-trial: expected a positive integer, got 0"),
        (["--parallel", "fsdp2"], "--parallel fsdp2: only with --nproc-per-trial 2 or more"),
        (["--nproc-per-trial", "4", "--devices", "npu:0-1"], "lists 2 device(s); a trial needs 4"),
        (["--nproc-per-trial", "3", "--devices", "cuda:0-7"], "does not divide the 8 devices"),
        (["--nproc-per-trial", "2", "--mode", "serving"], "only with --mode training"),
        (
            ["--nproc-per-trial", "4", "--devices", "cuda:0-7", "--workers", "3"],
            "--workers 3: --devices cuda:0-7 makes 2 group(s) of 4 devices",
        ),
        (["--nproc-per-trial", "2", "--compile"], "--compile: not with --nproc-per-trial 2"),
        (
            ["--nproc-per-trial", "3", "--device", "cpu"],
            "--nproc-per-trial 3: a batch of 64 does not split into 3 equal parts",
        ),
        (
            ["--nproc-per-trial", "2", "--confirm-steps", "500"],
            "--confirm-steps: not with --nproc-per-trial 2",
        ),
        (
            ["--nproc-per-trial", "2", "--trial-schedule", "compressed"],
            "--trial-schedule compressed: not with --nproc-per-trial 2",
        ),
    ],
)
def test_bad_launch_settings_exit_2_with_one_line(options, message, in_tmp, capsys, monkeypatch):
    monkeypatch.setattr("autoprec.distributed.launch.usable_cores", lambda: 8)  # any machine
    assert main(["search", "--trials", "1", *options]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (in_tmp / "runs").exists()  # refused before any store was opened


def test_optimizer_states_fsdp2_cannot_train_here_are_refused_before_any_store_opens(
    in_tmp, capsys, monkeypatch
):
    monkeypatch.setattr("autoprec.distributed.launch.usable_cores", lambda: 8)  # any machine
    space = in_tmp / "states.yaml"
    space.write_text(
        "name: states\ndtypes: [fp32]\ngroups: [{name: all, patterns: ['*']}]\n"
        "optimizer_states: {states: [fp32, 4bit], groups: [{name: blocks, patterns: [blocks]}]}\n"
    )
    argv = ["search", "--task", TASK, "--space", str(space), "--trials", "1", "--device", "cpu"]
    assert main([*argv, "--nproc-per-trial", "2", "--parallel", "fsdp2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "optimizer state 4bit under --parallel fsdp2: torchao's AdamW4bit fails" in err, err
    assert len(err.splitlines()) == 1 and not (in_tmp / "runs").exists()


def test_more_ranks_than_cores_are_refused_before_any_store_opens(in_tmp, capsys):
    cores = usable_cores()
    argv = ["search", "--nproc-per-trial", str(cores + 1), "--device", "cpu", "--trials", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"--nproc-per-trial {cores + 1}: this machine lets the search run on {cores} CPU" in err
    assert len(err.splitlines()) == 1 and not (in_tmp / "runs").exists()


def test_parallel_defaults_to_ddp_past_one_rank():
    assert settle_parallel(2, None, "training", None, None) == "ddp"
    assert settle_parallel(2, "fsdp2", "training", "cuda:0-3", 2) == "fsdp2"
    assert settle_parallel(1, None, "training", "cuda:0-7", None) is None
    with pytest.raises(AutoprecError, match="--parallel ddp: only with"):
        settle_parallel(1, "ddp", "training", None, None)


def test_eight_devices_at_four_per_trial_make_two_groups_each_seen_as_its_own():
    groups = device_groups([f"cuda:{i}" for i in range(8)], 4)
    assert groups == [[f"cuda:{i}" for i in range(4)], [f"cuda:{i}" for i in range(4, 8)]]
    env = group_env(groups[1], 3, {"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and env["OMP_NUM_THREADS"] == "3"
    assert local_group(groups[1]) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    # Under a scheduler's restriction, indices are of the devices this process sees.
    npus = group_env(["npu:2", "npu:3"], 1, {"ASCEND_RT_VISIBLE_DEVICES": "8,9,10,11"})
    assert npus["ASCEND_RT_VISIBLE_DEVICES"] == "10,11"
    assert device_groups(["cpu"], 2) == [["cpu"]]  # the ranks share the CPU's cores


def test_the_agents_failure_report_names_the_rank_and_why():
    report = """Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_14:38:50
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 24042)
  error_file: /tmp/x/error.json
  traceback : Traceback (most recent call last):
    File "rank.py", line 45, in main
      raise RuntimeError("boom")
  RuntimeError: boom

============================================================
"""
    assert failure_of(report) == "rank 3 exited with code 1: RuntimeError: boom"
    # A rank killed: the agent ends the other (SIGTERM), which had lost its peer.
    killed = """Failures:
[1]:
  time      : 2026-12-01_14:38:44
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 24028)  (SIGTERM)
  error_file: /tmp/x/error.json
  traceback : Traceback (most recent call last):
    File "distributed_c10d.py", line 5356, in barrier
  RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:14758.
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_14:38:44
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 24029)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 24029
============================================================
"""
    assert failure_of(killed) == "rank 1 was killed by SIGKILL"
    # A rank raised; the other's collective lost its peer and torchrun's clock, a few ms
    # off, names that one the root cause (seen on a loaded machine).
    raced = """Failures:
[1]:
  time      : 2026-12-01_16:02:11
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 3101)
  error_file: /tmp/x/error.json
  traceback : Traceback (most recent call last):
    File "distributed_fakes.py", line 40, in main
  RuntimeError: rank 1 crashed on purpose
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_16:02:10
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 3100)
  error_file: /tmp/x/error.json
  traceback : Traceback (most recent call last):
    File "distributed_c10d.py", line 5356, in barrier
  RuntimeError: [/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1.
============================================================
"""
    assert failure_of(raced) == "rank 1 exited with code 1: RuntimeError: rank 1 crashed on purpose"


# -- one launch of the real torchrun ----------------------------------------------------


def _pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted((folder / "pids").iterdir())]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_a_killed_rank_fails_the_launch_and_the_next_launch_runs(tmp_path):
    limit_s = 120.0
    dead = launch({"fake": "die"}, 2, tmp_path / "die", limit_s, module=FAKES)
    assert dead.exit_code not in (0, None)
    reason = dead.reason(limit_s, 2)
    assert reason.startswith("rank 1 was killed by SIGKILL (log: "), reason
    assert dead.lost_rank(2) == "rank 1 was killed by SIGKILL"  # it is launched again
    assert dead.elapsed_s < limit_s / 2  # the agent noticed: the limit never came into it
    assert not any(_running(pid) for pid in _pids(tmp_path / "die"))
    started = time.monotonic()
    fine = launch({"fake": "ok"}, 2, tmp_path / "ok", limit_s, module=FAKES)
    assert fine.exit_code == 0 and time.monotonic() - started < limit_s
    result = json.loads(fine.result_path.read_text())
    assert result["step_time_ms"] == 3.0 and result["nproc"] == 2  # 1 + 2: both ranks
    assert result["backend"] == "gloo"


@pytest.mark.slow
def test_a_crashing_rank_names_its_error(tmp_path):
    crashed = launch({"fake": "crash"}, 2, tmp_path, 120.0, module=FAKES)
    assert crashed.reason(120.0, 2).startswith(
        "rank 1 exited with code 1: RuntimeError: rank 1 crashed on purpose"
    )
    assert crashed.retried_because(2) is None  # it raised: it would raise again


@pytest.mark.slow
def test_a_hanging_rank_that_ignores_sigterm_is_ended_by_the_limit(tmp_path):
    limit_s = 30.0
    hung = launch({"fake": "hang"}, 2, tmp_path, limit_s, module=FAKES)
    assert hung.timed_out
    assert "TrialTimeout: no result after 30 s" in hung.reason(limit_s, 2)
    assert hung.elapsed_s < limit_s + 20  # the limit, the grace, then SIGKILL
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(_running(pid) for pid in pids)


@pytest.mark.slow
def test_a_launch_that_fails_setting_up_is_launched_again_once(tmp_path):
    aborts = tmp_path / "aborts"
    plan = LaunchPlan(
        nproc=2,
        parallel="ddp",
        backend="gloo",
        group=["cpu", "cpu"],
        task_spec="unused",
        folder=tmp_path / "launches",
        limit_s=120.0,
        module=FAKES,
        env={ABORT_DIR_ENV: str(aborts)},  # rank 1 of the first launch aborts at its start
    )
    outcome, retries = launch_with_retry({"fake": "ok"}, plan)
    assert outcome.exit_code == 0, outcome.reason(120.0, 2)
    (retry,) = retries  # why, naming the first launch's log
    assert retry.startswith("rank 1 was killed by SIGABRT, before every rank was ready"), retry
    assert json.loads(outcome.result_path.read_text())["step_time_ms"] == 3.0  # both ranks
    first, second = sorted(plan.folder.iterdir(), key=lambda f: int(f.name.split("-")[1]))
    assert not (first / "ready-1").exists() and (second / "ready-1").exists()
    failed = LaunchOutcome(1, first / "result.json", first / "launch.log", 0.0)
    assert failed.failed_setting_up(2)
    assert "SIGABRT" in failed.reason(120.0, 2), failed.reason(120.0, 2)
    # A launch whose ranks all got ready fails as it ended: the policy ran.
    assert not LaunchOutcome(
        1, second / "result.json", second / "launch.log", 0.0
    ).failed_setting_up(2)
    assert len(list(aborts.iterdir())) == 2  # launched twice, never a third time


@pytest.mark.slow
def test_a_rank_that_aborts_after_the_trial_is_done_leaves_its_result(tmp_path):
    aborted = launch({"fake": "abort-at-exit"}, 2, tmp_path, 120.0, module=FAKES)
    assert aborted.exit_code not in (0, None)
    assert "SIGABRT" in aborted.reason(120.0, 2)  # the agent saw it
    assert aborted.finished(2) and not aborted.failed_setting_up(2)  # the result stands
    assert json.loads(aborted.result_path.read_text())["step_time_ms"] == 3.0
    crashed = launch({"fake": "crash"}, 2, tmp_path / "crash", 120.0, module=FAKES)
    assert not crashed.finished(2)  # a rank that failed during the trial


# -- searches through the CLI -----------------------------------------------------------


def _search(folder: Path, *options: str, env: dict[str, str] | None = None) -> str:
    command = [sys.executable, "-m", "autoprec.cli", "search", "--no-progress", *options]
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    done = subprocess.run(
        command, cwd=folder, env=environment, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _trials(folder: Path, study: str) -> list[optuna.trial.FrozenTrial]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{folder}/runs/optuna.db"
    return optuna.load_study(study_name=study, storage=storage).trials


def _why(result: dict, folder: Path) -> str:
    """A failed launch's reason, and the end of the log it names (kept for a failed one)."""
    reason = str(result.get("reason"))
    log = folder / reason.rpartition("(log: ")[2].rstrip(")")  # where it is relative
    tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
    return f"{reason}\n{tail}"


def _parent_runs(folder: Path, study: str) -> int:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{folder}/runs/mlflow.db")
    runs = mlflow.search_runs(experiment_names=[study])
    return int(runs["tags.mlflow.parentRunId"].isna().sum())


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_a_search_at_two_ranks_finishes(parallel, tmp_path):
    _search(
        tmp_path,
        *("--task", TASK, "--trials", "3", "--steps", "6", "--device", "cpu"),
        *("--nproc-per-trial", "2", "--parallel", parallel, "--confirm-top", "1"),
    )
    summary = json.loads((tmp_path / "runs/blocks/summary.json").read_text())
    settings = summary["settings"]
    assert (settings["nproc_per_trial"], settings["parallel"], settings["backend"]) == (
        2,
        parallel,
        "gloo",
    )
    trials = _trials(tmp_path, "blocks")
    assert len(trials) == 3 and len(summary["trials"]) == 3
    assert _parent_runs(tmp_path, "blocks") == 1
    for trial in trials:
        result = trial.user_attrs["autoprec"]["result"]
        assert "distributed" in (result.get("telemetry") or {}), _why(result, tmp_path)  # ranks ran
        record = result["telemetry"]["distributed"]
        assert (record["nproc"], record["parallel"], record["backend"]) == (2, parallel, "gloo")
        assert [r["rank"] for r in record["ranks"]] == [0, 1]
        for rank in record["ranks"]:
            if rank["state"] == "complete":
                assert math.isfinite(rank["step_time_ms"]) and math.isfinite(rank["final_loss"])
                assert math.isfinite(rank["peak_memory_mb"])
    # The dtype gradients are communicated in is searched: FSDP2's reduce_dtype, DDP's
    # compression hook (fp16 only on the CPU wheel: torch refuses bf16's hook without NCCL)
    param, other = (
        ("fsdp.reduce_dtype", "ddp.reduce_dtype")
        if parallel == "fsdp2"
        else ("ddp.reduce_dtype", "fsdp.reduce_dtype")
    )
    offered = {"fp32", "bf16"} if parallel == "fsdp2" else {"fp32", "fp16"}
    reduce = {t.params.get(param) for t in trials}
    assert reduce <= offered and reduce != {None}, reduce
    assert {t.params.get(other) for t in trials} == {None}
    for trial in trials:
        record = trial.user_attrs["autoprec"]["result"]["telemetry"]["distributed"]
        assert record["reduce_dtype"] == trial.params.get(param, "fp32")


@pytest.mark.slow  # five launches of two ranks
def test_a_rank_killed_mid_trial_is_launched_again_once_and_every_record_says_so(
    tmp_path, monkeypatch, capsys
):
    """Rank 1 kills itself (SIGKILL) two batches into launches 2 and 3 (the first trial's,
    and its retry) and 4 (the second trial's first): the first trial fails, its reason
    naming the rank and the signal; the second is launched again and completes. Both
    retries are on the trials' results, in summary.json, on their MLflow child runs, in
    the search's table and in the report."""
    timeout_s = 400
    printed = _search(
        tmp_path,
        *("--task", "tests.distributed_fakes:killed_blocks", "--trials", "2", "--steps", "6"),
        *("--device", "cpu", "--nproc-per-trial", "2", "--confirm-top", "0"),
        *("--trial-timeout", str(timeout_s)),
        env={KILL_DIR_ENV: str(tmp_path / "launches"), KILL_AT_ENV: "2,3,4"},
    )
    killed = "launched again after rank 1 was killed by SIGKILL (log: "
    trials = [t for t in _trials(tmp_path, "killed-blocks") if t.state.is_finished()]
    results = [t.user_attrs["autoprec"]["result"] for t in trials]
    assert [r["state"] for r in results] == ["failed", "complete"], [r["reason"] for r in results]
    failed, retried = results
    assert failed["reason"].startswith("rank 1 was killed by SIGKILL"), failed
    assert failed["run_time_s"] < timeout_s  # ended by the agent, not by the limit
    for result in results:
        (retry,) = result["retries"]
        assert retry.startswith("rank 1 was killed by SIGKILL (log: "), retry
        log = tmp_path / retry.rpartition("(log: ")[2].rstrip(")")
        assert "SIGKILL" in log.read_text()  # the first launch keeps its log
    assert retried["retries"] != failed["retries"]  # each its own launch
    assert retried["telemetry"]["distributed"]["nproc"] == 2  # the second launch's ranks

    summary = json.loads((tmp_path / "runs/killed-blocks/summary.json").read_text())
    assert "retries" not in summary["baseline"]  # it ran once
    assert [e["retries"] for e in summary["trials"]] == [r["retries"] for r in results]

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/runs/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["killed-blocks"])
    tags = {t: r for t, r in zip(runs["tags.trial_number"], runs["tags.retries"], strict=True)}
    assert tags["0"] == failed["retries"][0] and tags["1"] == retried["retries"][0]
    baseline = runs[runs["tags.autoprec.role"] == "baseline"]
    assert baseline["tags.retries"].isna().all()

    assert printed.count(killed) == 2, printed  # the search's table: a line a trial
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--study", "killed-blocks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("trial ") and killed in line for line in lines) == 2, lines
    page = (tmp_path / "runs/killed-blocks/report.html").read_text()
    for result in results:  # in the trials' table
        assert html.escape(f"launched again after {result['retries'][0]}") in page


@pytest.mark.slow
def test_input_a_rank_refuses_stops_the_search_as_bad_input(tmp_path):
    command = [sys.executable, "-m", "autoprec.cli", "search", "--no-progress"]
    command += ["--task", "tests.distributed_fakes:refused_on_ranks", "--trials", "2"]
    command += ["--steps", "6", "--device", "cpu", "--nproc-per-trial", "2"]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "task refused on the ranks, on purpose" in done.stderr


# -- a killed search ------------------------------------------------------------------------

MARKER_ENV = "AUTOPREC_TEST_MARKER"  # in the environment of every process a search starts


def _marked(marker: str) -> list[int]:
    """The live processes (not zombies) whose environment holds the marker."""
    tag = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if tag in environ.split(b"\0") and _running(int(entry.name)):
            found.append(int(entry.name))
    return found


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ranks(pids: list[int]) -> int:
    return sum(b"autoprec.distributed.rank" in _command(pid) for pid in pids)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGKILL to the agent too"])
def test_a_killed_search_leaves_no_rank_behind(how, tmp_path):
    """The search is killed while its ranks run: the agent dies with the search, and
    each rank with the agent (also where the agent is killed outright, and cannot end
    its ranks itself); no process the search started is left."""
    sig = signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), MARKER_ENV: marker}
    command = [sys.executable, "-m", "autoprec.cli", "search", "--no-progress", "--task", TASK]
    command += ["--trials", "2", "--steps", "400", "--nproc-per-trial", "2", "--device", "cpu"]
    search = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 600  # a guard, never a measured time
        while _ranks(_marked(marker)) < 2:
            assert search.poll() is None, "the search ended before its ranks started"
            assert time.monotonic() < deadline, "no ranks started"
            time.sleep(0.2)
        if how == "SIGKILL to the agent too":
            for pid in _marked(marker):
                if b"torch.distributed.run" in _command(pid):
                    os.kill(pid, signal.SIGKILL)
        search.send_signal(sig)
        search.wait(timeout=120)
        deadline = time.monotonic() + 120  # the agent's own grace for its ranks is 30 s
        while _marked(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _marked(marker) == []
    finally:
        for pid in [search.pid, *_marked(marker)]:  # only what this test started
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
