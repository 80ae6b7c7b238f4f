"""The study storage that workers share: a queued trial is handed to one process only,
and a running trial has a heartbeat from the moment it is handed over."""

import json
import subprocess
import sys
import time

import optuna
from optuna.trial import TrialState

from autoprec.study._studies import fail_stale, open_storage

# Each process says it is ready and waits for all four, then takes queued trials until
# none is left, and prints the numbers it was handed.
_TAKE = """
import json, os, pathlib, sys, time
import optuna
from autoprec.study._studies import open_storage
url, ready = sys.argv[1], pathlib.Path(sys.argv[2])
study = optuna.load_study(study_name="queue", storage=open_storage(url))
(ready / str(os.getpid())).touch()
deadline = time.monotonic() + 120
while len(list(ready.iterdir())) < 4 and time.monotonic() < deadline:
    time.sleep(0.005)
taken = []
while True:
    trial = study.ask()
    if "slot" not in trial.user_attrs:  # the queue is empty: a fresh trial
        break
    taken.append(trial.number)
print(json.dumps(taken))
"""


def test_four_processes_taking_from_one_sqlite_queue_never_take_the_same_trial(tmp_path):
    # Optuna alone hands some of these 40 trials to two processes at once on sqlite
    # (5 to 10 a run here).
    url = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="queue", storage=open_storage(url))
    for slot in range(40):
        study.enqueue_trial({}, user_attrs={"slot": slot})
    ready = tmp_path / "ready"
    ready.mkdir()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _TAKE, url, str(ready)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    taken = []
    for p in processes:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        taken.extend(json.loads(out))
    assert sorted(taken) == list(range(40))


def test_a_trial_whose_process_stops_before_its_first_heartbeat_is_failed_too(tmp_path):
    # Optuna's stale check passes over running trials that never sent a heartbeat; a
    # worker killed between asking and starting its heartbeat thread left one for good.
    study = optuna.create_study(
        study_name="s", storage=open_storage(f"sqlite:///{tmp_path}/optuna.db", heartbeat_s=1)
    )
    study.enqueue_trial({}, user_attrs={"slot": 0})
    queued, fresh = study.ask(), study.ask()  # and then nothing: no heartbeat thread
    time.sleep(4.5)  # the grace is 3 heartbeats of 1 s
    fail_stale(study)
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {queued.number: TrialState.FAIL, fresh.number: TrialState.FAIL}
