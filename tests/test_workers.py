"""Several workers on one study, and searches that survive faults: a trial that raises,
runs out of memory or hangs; a search killed with SIGKILL and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import autoprec
from autoprec.devices import parse_devices
from autoprec.errors import DeviceError
from autoprec.study._loop import interrupts_held
from autoprec.study._studies import CLAIM_ATTR, RECORD_ATTR
from autoprec.study._workers import pinned_env
from autoprec.tracking import KEY_TAG, mlflow_client

TASKS = Path(__file__).with_name("contract_tasks.py")
CLI = "import sys; from autoprec.cli import main; sys.exit(main(sys.argv[1:]))"
SMALL_SPACE = """\
name: small
dtypes: [fp32, fp16, bf16]
groups:
  - {name: fc1, patterns: [fc1]}
  - {name: head, patterns: [head]}
loss_scale:
  modes: [dynamic]
  init_scale_log2: [16, 16]
  growth_interval: [2000, 2000]
  hysteresis: [1, 1]
  growth_factor: [2.0]
  backoff_factor: [0.5]
  min_scale: [0.0]
"""


def _recorded(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.state.is_finished() and RECORD_ATTR in t.user_attrs]


def _peek(folder: Path, study: str) -> optuna.Study | None:
    """The study as a running search has it so far (None before it exists)."""
    if not (folder / "runs/optuna.db").is_file():
        return None
    try:
        return optuna.load_study(study_name=study, storage=f"sqlite:///{folder}/runs/optuna.db")
    except Exception:  # not created yet, or the file is being set up
        return None


def _runs_of(tracking_uri: str, study: str) -> tuple[object, list[object]]:
    """The study's one parent run and the runs under it."""
    client = mlflow_client(tracking_uri)
    experiment = client.get_experiment_by_name(study)
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("autoprec.role") == "parent"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == len(runs) - 1  # nothing outside the one parent
    return parents[0], children


@pytest.mark.slow
def test_three_workers_share_one_budget_exactly(in_tmp):
    result = autoprec.search(
        f"{TASKS}:tiny", trials=12, steps=20, study="w3", device="cpu", workers=3
    )
    study = optuna.load_study(study_name="w3", storage=f"sqlite:///{in_tmp}/runs/optuna.db")
    recorded = _recorded(study)
    assert len(recorded) == 12
    # Nothing else was trained: the other trials are duplicates, or claims that stepped
    # back (budget taken, or the policy running elsewhere).
    others = [t for t in study.trials if t not in recorded]
    for t in others:
        assert "duplicate_of" in t.user_attrs or t.user_attrs.get("stepped_back"), (
            t.number,
            t.state,
            t.user_attrs,
        )
    keys = [t.user_attrs[CLAIM_ATTR] for t in recorded]
    assert len(set(keys)) == 12  # no policy evaluated twice
    # The workers shared the trials (their logs say how many each measured).
    logs = sorted((in_tmp / "runs/w3/workers").glob("worker-*.log"))
    assert len(logs) == 3
    measured = [int(log.read_text().split("done, ")[1].split()[0]) for log in logs]
    assert sum(measured) == 12 and sum(n >= 1 for n in measured) >= 2, measured

    _, children = _runs_of(f"sqlite:///{in_tmp}/runs/mlflow.db", "w3")
    roles = [c.data.tags["autoprec.role"] for c in children]
    assert roles.count("baseline") == 1 and roles.count("trial") == 12
    assert all(c.info.status in ("FINISHED", "FAILED") for c in children)
    # One run per measured trial, found by its trial number; none for a trial never trained.
    assert {c.data.tags[KEY_TAG] for c in children} == {"baseline"} | {
        str(t.number) for t in recorded
    }
    assert result.summary["settings"]["workers"] == 3
    assert len(result.summary["trials"]) == 12


@pytest.mark.slow
def test_a_trial_that_raises_runs_out_of_memory_or_hangs_fails_and_the_search_goes_on(in_tmp):
    space = in_tmp / "small.yaml"
    space.write_text(SMALL_SPACE)
    result = autoprec.search(
        f"{TASKS}:trapped",
        space,
        trials=8,  # the whole space: 3 dtypes for fc1 x 3 for the head, less all-fp32
        steps=12,
        study="faults",
        device="cpu",
        sampler="random",
        trial_timeout_s=2,
        confirm_top=0,
    )
    reasons = {t["number"]: t["reason"] or "" for t in result.summary["trials"]}
    states = {t["number"]: t["state"] for t in result.summary["trials"]}
    assert len(reasons) == 8
    hung = [n for n, r in reasons.items() if r.startswith("TrialTimeout: no result after 2 s")]
    oom = [n for n, r in reasons.items() if r == "out of memory: tried to allocate 80.00 GiB"]
    boom = [n for n, r in reasons.items() if "boom: a bug that shows only in fp16" in r]
    assert len(hung) == 3  # fc1 in fp16 hangs, whatever the head
    assert len(oom) == 3  # fc1 in bf16 runs out of memory
    assert len(boom) == 1  # fc1 in fp32, head in fp16
    assert all(states[n] == "failed" for n in hung + oom + boom)
    assert [s for s in states.values() if s == "complete"] == ["complete"]  # fc1 fp32, head bf16
    # Every failed trial is closed as FAILED in MLflow with its reason.
    _, children = _runs_of(f"sqlite:///{in_tmp}/runs/mlflow.db", "faults")
    failed = [c for c in children if c.info.status == "FAILED"]
    assert len(failed) == 7
    assert all(c.data.tags["reason"] for c in failed)
    timed = [t for t in result.summary["trials"] if t["number"] in hung]
    # Cut off by the 2 s limit (the hang never ends by itself); generous for a loaded machine.
    assert all(t["metrics"]["run_time_s"] < 60 for t in timed)


def _search_command(tmp: Path, study: str, trials: int, sigint: bool = False) -> list[str]:
    """The search command; with ``sigint``, it takes SIGINT as a KeyboardInterrupt even if
    it was started with SIGINT ignored."""
    restore = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    return [
        sys.executable,
        "-c",
        (restore if sigint else "") + CLI,
        "search",
        "--task",
        f"{TASKS}:slow_tiny",
        "--trials",
        str(trials),
        "--steps",
        "40",
        "--study",
        study,
        "--device",
        "cpu",
        "--heartbeat",
        "1",
        "--confirm-top",
        "0",
        "--no-progress",
    ]


@pytest.mark.slow
def test_sigkill_mid_trial_then_resume_keeps_every_finished_trial(in_tmp):
    storage = f"sqlite:///{in_tmp}/runs/optuna.db"
    command = _search_command(in_tmp, "kill", trials=5)
    killed = None
    for _ in range(5):  # until the kill lands mid-trial, however slow the machine
        killed = _sigkill_mid_trial(command, in_tmp)
        if killed is not None:
            break
    assert killed is not None
    study = optuna.load_study(study_name="kill", storage=storage)
    before = {t.number: t.user_attrs[RECORD_ATTR] for t in _recorded(study)}
    assert study.trials[killed].state == TrialState.RUNNING  # nobody has looked yet

    resumed = subprocess.run(command, cwd=in_tmp, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    study = optuna.load_study(study_name="kill", storage=storage)
    after = {t.number: t.user_attrs[RECORD_ATTR] for t in _recorded(study)}
    assert len(after) == 5  # the budget counts only what finished
    assert {n: after[n] for n in before} == before  # finished trials intact
    cut = study.trials[killed]
    assert cut.state == TrialState.FAIL and RECORD_ATTR not in cut.user_attrs
    _, children = _runs_of(f"sqlite:///{in_tmp}/runs/mlflow.db", "kill")
    by_key = {c.data.tags[KEY_TAG]: c for c in children}
    assert len(by_key) == len(children)  # one run per trial, whatever was retried
    cut_run = by_key.get(str(killed))
    if cut_run is not None:  # opened before the kill (the writer runs beside the trial)
        assert cut_run.info.status == "KILLED"
        assert "heartbeat" in cut_run.data.tags["reason"]
    measured = [c for c in children if c.info.status in ("FINISHED", "FAILED")]
    assert {c.data.tags[KEY_TAG] for c in measured} == {"baseline"} | {str(n) for n in after}
    # The summary lists every trial: the killed one too, failed with the reason.
    summary = json.loads((in_tmp / "runs/kill/summary.json").read_text())
    assert sorted(t["number"] for t in summary["trials"]) == sorted([*after, killed])
    (entry,) = [t for t in summary["trials"] if t["number"] == killed]
    assert entry["state"] == "failed" and "heartbeat" in entry["reason"], entry
    assert not entry["counted"] and sum(t["counted"] for t in summary["trials"]) == 5
    assert not entry["pareto"] and not entry["feasible"]


def _sigkill_mid_trial(command: list[str], folder: Path) -> int | None:
    """Run the search until it has recorded 2 trials and is running a third, SIGKILL it,
    and return the number of the trial it was running then, as the study says after the
    kill (None if the kill fell between two trials)."""
    process = subprocess.Popen(
        command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 600
    while process.poll() is None:
        assert time.monotonic() < deadline, "no trial running after 2 recorded within 600 s"
        time.sleep(0.2)
        study = _peek(folder, "kill")
        if study is None or len(_recorded(study)) < 2:
            continue
        if any(t.state == TrialState.RUNNING and CLAIM_ATTR in t.user_attrs for t in study.trials):
            os.kill(process.pid, signal.SIGKILL)
            break
    output = process.communicate()[0].decode()
    assert process.returncode == -signal.SIGKILL, output[-2000:]
    study = _peek(folder, "kill")
    running = [
        t for t in study.trials if t.state == TrialState.RUNNING and CLAIM_ATTR in t.user_attrs
    ]
    return running[0].number if running else None


@pytest.mark.slow
def test_ctrl_c_stops_the_workers_and_writes_what_was_measured(in_tmp):
    # A Ctrl-C as a terminal sends it: the search takes SIGINT as Python does by default,
    # even where this suite was started with SIGINT ignored (from a background job).
    command = [*_search_command(in_tmp, "cc", trials=30, sigint=True), "--workers", "2"]
    storage = f"sqlite:///{in_tmp}/runs/optuna.db"
    process = subprocess.Popen(command, cwd=in_tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.3)
        study = _peek(in_tmp, "cc")
        if study is None:
            continue
        if len(_recorded(study)) >= 2 and any(
            t.state == TrialState.RUNNING and CLAIM_ATTR in t.user_attrs for t in study.trials
        ):
            break
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr.decode()[-2000:]
    study = optuna.load_study(study_name="cc", storage=storage)
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    cut = [t for t in study.trials if t.user_attrs.get("interrupted")]
    assert cut and all(t.state == TrialState.FAIL for t in cut)
    summary = json.loads((in_tmp / "runs/cc/summary.json").read_text())
    assert summary["interrupted"] is True
    assert len(_recorded(study)) >= 2
    # Every trial that ran: the recorded ones, and the ones cut off, failed with the reason.
    listed = {t["number"]: t for t in summary["trials"]}
    claimed_cut = {t.number for t in cut if CLAIM_ATTR in t.user_attrs}
    assert set(listed) == {t.number for t in _recorded(study)} | claimed_cut
    assert all("interrupted" in listed[n]["reason"] for n in claimed_cut)
    assert (in_tmp / "runs/cc/best_policy.yaml").is_file()
    _, children = _runs_of(f"sqlite:///{in_tmp}/runs/mlflow.db", "cc")
    killed = {c.data.tags[KEY_TAG] for c in children if c.info.status == "KILLED"}
    # A trial cut off before its MLflow run was opened (while claiming) has none.
    assert killed <= {str(t.number) for t in cut}
    assert not [c for c in children if c.info.status == "RUNNING"]


def test_a_ctrl_c_while_a_trial_is_asked_for_strikes_once_the_trial_is_in_hand():
    # Otherwise a Ctrl-C inside study.ask() would leave its new trial RUNNING for good.
    # Python's own handler, as in a terminal, whatever this suite was started with.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ask_with_ctrl_c()
    finally:
        signal.signal(signal.SIGINT, previous)


def _ask_with_ctrl_c() -> None:
    handed = None
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the signal arrives here, and is held
        handed = "trial"
    assert handed == "trial"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # Asked twice, it stops waiting.
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        handed = "never"
    assert handed == "trial"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_devices_are_parsed_and_pinned(monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    assert parse_devices("npu:0-3") == ["npu:0", "npu:1", "npu:2", "npu:3"]
    assert parse_devices("cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    for bad in ("npu:3-1", "cuda:0,npu:1", "gpu:0", "cuda:0,cuda:0"):
        with pytest.raises(DeviceError):
            parse_devices(bad)
    env = pinned_env("npu:5", threads=4)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "5" and env["OMP_NUM_THREADS"] == "4"
    assert pinned_env("cuda:1", threads=1)["CUDA_VISIBLE_DEVICES"] == "1"
    # Under a scheduler's restriction, cuda:1 is the second GPU this process sees.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert pinned_env("cuda:1", threads=1)["CUDA_VISIBLE_DEVICES"] == "5"


@pytest.mark.slow
def test_workers_refuse_bad_input_before_any_store(in_tmp):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", CLI, "search", *args],
            cwd=in_tmp,
            capture_output=True,
            text=True,
        )

    for args, words in (
        (["--workers", "0"], "--workers"),
        (["--devices", "cuda:0-1"], "CUDA"),
        (["--devices", "tpu:0"], "--devices"),
        (["--trial-timeout", "-1"], "--trial-timeout"),
        (["--heartbeat", "0"], "--heartbeat"),
    ):
        done = cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert words in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert not (in_tmp / "runs/optuna.db").exists()


def test_a_failed_trial_whose_run_stayed_open_is_closed_when_the_study_continues(in_tmp):
    from autoprec.tracking import Tracker

    tracker = Tracker(f"sqlite:///{in_tmp}/runs/mlflow.db", "sweep", in_tmp / "runs")
    tracker.start_parent({})
    for key in ("0", "1"):
        tracker.start_trial(key, f"t00{key}", {})
    assert tracker.flush(60)
    runs = tracker.run_ids()
    tracker.client.set_terminated(runs["1"], "FINISHED")
    # Both trials were failed while MLflow was down: the next run of the study closes the
    # run that stayed open, and leaves the closed one as it is.
    tracker.catch_up([], {"0": "its trial was failed", "1": "its trial was failed"})
    assert tracker.close(60)
    run = tracker.client.get_run(runs["0"])
    assert run.info.status == "KILLED" and run.data.tags["state"] == "killed"
    assert tracker.client.get_run(runs["1"]).info.status == "FINISHED"
    assert set(tracker.run_ids()) == {"0", "1"}  # nothing made twice
